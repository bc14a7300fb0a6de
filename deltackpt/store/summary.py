"""What ``ls`` and ``du`` show: a checkpoint's summary without its item list, and a store's usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from .manifest import Manifest


class CheckpointInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What ``ls`` shows of a checkpoint, without its item list."""

    name: str
    created_ns: int
    parent: str | None
    logical_bytes: int
    stored_bytes: int
    num_chunks: int
    new_chunks: int
    num_items: int
    metadata: dict[str, Any]
    manifest_bytes: int
    manifest_mtime_s: float = 0.0  # with manifest_bytes and _version: a cached summary is stale when one differs
    manifest_version: str = ""  # the backend's version of the manifest object (an S3 ETag): mtimes are seconds
    damage: str | None = None  # why the manifest cannot be read; None for an intact checkpoint

    @property
    def damaged(self) -> bool:
        return self.damage is not None

    @property
    def added_bytes(self) -> int:
        """What this checkpoint added to the store: its new pack bytes and its manifest (``ls`` and ``show``)."""
        return self.stored_bytes + self.manifest_bytes

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.added_bytes if self.added_bytes else float("inf")


@dataclass(frozen=True)
class StoreUsage:
    num_checkpoints: int
    logical_bytes: int  # sum over checkpoints of their items' bytes
    physical_bytes: int  # what the checkpoints need, as stored: packs, manifests, config
    pack_bytes: int
    manifest_bytes: int
    num_packs: int
    num_chunks: int
    # The store's other objects (commit records, tags, a tier's record, the gc epoch): physical + other is all
    # it holds, less locks and temp files, which come and go, and a local store's index cache (cache/).
    other_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.physical_bytes if self.physical_bytes else 0.0


def summarize_manifest(m: Manifest, manifest_bytes: int, manifest_mtime_s: float,
                       manifest_version: str | None = None) -> CheckpointInfo:
    return CheckpointInfo(
        name=m.name,
        created_ns=m.created_ns,
        parent=m.parent,
        logical_bytes=m.stats.logical_bytes,
        stored_bytes=m.stats.stored_bytes,
        num_chunks=m.stats.num_chunks,
        new_chunks=m.stats.new_chunks,
        num_items=len(m.items),
        metadata=m.metadata,
        manifest_bytes=manifest_bytes,
        manifest_mtime_s=manifest_mtime_s,
        manifest_version=manifest_version or "",
    )


def damaged_info(name: str, obj, damage: str) -> CheckpointInfo:
    """A listing entry for an unreadable manifest, placed in time by when it was written."""
    return CheckpointInfo(name=name, created_ns=int(obj.mtime_s * 1e9), parent=None, logical_bytes=0,
                          stored_bytes=0, num_chunks=0, new_chunks=0, num_items=0, metadata={},
                          manifest_bytes=obj.size_bytes, manifest_mtime_s=obj.mtime_s,
                          manifest_version=obj.version or "", damage=damage)

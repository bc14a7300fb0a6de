"""verifyreport: what :func:`~.verify.verify_store` returns, a report with its problems as data.

Each :class:`Problem` names the damage (its :class:`ProblemKind`), the pack and chunk where known, and every
checkpoint and item that depends on it; :class:`VerifyReport` adds what was checked and what was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class ProblemKind(str, Enum):
    """What a :class:`Problem` is (its ``kind`` in the JSON report is the value)."""

    MANIFEST = "manifest"  # a manifest does not parse
    MISSING_CHUNK = "missing-chunk"  # a referenced chunk is in no pack
    MISSING_PACK = "missing-pack"  # the pack holding a chunk is gone
    BAD_BASE = "bad-base"  # a delta's base is missing, or is itself a delta
    PACK_HASH = "pack-hash"  # a pack's bytes do not hash to its name, or its table is unreadable
    BAD_CHUNK = "bad-chunk"  # a chunk does not decode to its id (or its pack's table is unreadable)
    TAGS = "tags"  # a checkpoint's tags object does not read (the checkpoint stays pinned; its data is intact)

    def __str__(self) -> str:
        return self.value


@dataclass
class Problem:
    """One piece of damage, of a :class:`ProblemKind` (a plain string is accepted and checked)."""

    kind: ProblemKind
    detail: str
    pack: str | None = None
    chunk_id: str | None = None
    checkpoints: list[str] = field(default_factory=list)
    items: list[str] = field(default_factory=list)  # "checkpoint:item"

    def __post_init__(self) -> None:
        self.kind = ProblemKind(self.kind)

    def as_dict(self) -> dict:
        return {"kind": self.kind.value, "detail": self.detail, "pack": self.pack, "chunk_id": self.chunk_id,
                "checkpoints": self.checkpoints, "items": self.items}


@dataclass
class VerifyReport:
    level: int
    num_checkpoints: int = 0
    num_packs: int = 0
    packs_checked: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    complete: bool = True  # False when sample / max_duration_s / a concurrent gc left something unchecked
    packs_skipped: int = 0  # packs in use that were not read (sample or time limit)
    chunks_skipped: int = 0  # chunks in use whose pack was not read, or whose finding a gc left unsettled
    # "sample", "max_duration" or "concurrent-gc" (a pack gone, or a gc still moving chunks while verify checked
    # its findings again: run verify again) when incomplete
    skipped_by: str | None = None
    duration_s: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    orphan_packs: list[str] = field(default_factory=list)  # packs no checkpoint uses (gc removes them)

    @property
    def ok(self) -> bool:
        """No problems found in what was checked."""
        return not self.problems

    @property
    def clean(self) -> bool:
        """Everything was checked and no problem found."""
        return self.ok and self.complete

    @property
    def damaged_checkpoints(self) -> list[str]:
        return sorted({c for p in self.problems for c in p.checkpoints})

    def as_dict(self) -> dict:
        return {"level": self.level, "ok": self.ok, "clean": self.clean, "num_checkpoints": self.num_checkpoints,
                "num_packs": self.num_packs, "packs_checked": self.packs_checked,
                "chunks_checked": self.chunks_checked, "bytes_checked": self.bytes_checked,
                "complete": self.complete, "packs_skipped": self.packs_skipped,
                "chunks_skipped": self.chunks_skipped, "skipped_by": self.skipped_by,
                "duration_s": round(self.duration_s, 3),
                "damaged_checkpoints": self.damaged_checkpoints, "orphan_packs": self.orphan_packs,
                "problems": [p.as_dict() for p in self.problems]}


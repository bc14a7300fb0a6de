"""gc: reclaim the space of chunks no checkpoint needs, as a plan first, then its execution.

Mark: the live chunks are those the manifests reference plus the delta bases of those chunks. The set is
a sorted numpy array of 16-byte ids (16 bytes a chunk, not a Python object each), so stores with millions
of chunks stay within tens of MB.

Sweep, per pack (read from its table, the truth): an entry is live if its chunk is live and the index
locates that chunk in this pack (a copy elsewhere, left by an interrupted repack, is dead). A pack with no
live entry is deleted; a pack whose dead fraction exceeds ``max_unused`` is repacked: its live entries are
copied byte for byte (no re-encoding) into new packs, the index is pointed at them, then the old pack is
deleted. Packs younger than ``grace_s`` are never touched, nor are stray temp files: an in-flight save may
still need them. gc runs under the store's exclusive lock, so no save commits meanwhile.

Crash safety: every step publishes new objects before it removes old ones, so a crash leaves at worst
duplicate chunks or unindexed packs, which the index refresh and the next gc clean up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from . import codec
from .faults import crash_point
from .lock import EXCLUSIVE
from .pack import HEADER_SIZE, PackBuilder, PackEntry, pack_key, pack_name_from_key, read_pack_entries

DEFAULT_GRACE_S = 3600.0


@dataclass
class GcPlan:
    """What gc would do. ``execute()`` does it (under the exclusive lock)."""

    store: object
    live_chunks: int
    max_unused: float = 0.1
    grace_s: float = DEFAULT_GRACE_S
    delete_packs: dict[str, int] = field(default_factory=dict)  # name -> size
    repack: dict[str, list[PackEntry]] = field(default_factory=dict)  # name -> live entries to keep
    repack_sizes: dict[str, int] = field(default_factory=dict)
    temp_files: list[str] = field(default_factory=list)
    kept_young: int = 0  # packs skipped because younger than the grace period

    @property
    def reclaim_bytes(self) -> int:
        moved = sum(HEADER_SIZE + e.stored_len for es in self.repack.values() for e in es)
        return sum(self.delete_packs.values()) + sum(self.repack_sizes.values()) - moved

    def as_dict(self) -> dict:
        return {"live_chunks": self.live_chunks, "delete_packs": sorted(self.delete_packs),
                "repack_packs": sorted(self.repack), "temp_files": self.temp_files,
                "kept_young_packs": self.kept_young, "reclaim_bytes": self.reclaim_bytes}

    def execute(self) -> "GcResult":
        """Take the exclusive lock, plan again under it (a save may have committed since this plan was
        made), and carry that plan out."""
        store = self.store
        t0 = time.monotonic()
        with store.lock(EXCLUSIVE):
            plan = plan_gc(store, max_unused=self.max_unused, grace_s=self.grace_s)
            moved = 0
            for old, entries in sorted(plan.repack.items()):
                moved += _repack(store, old, entries)
                crash_point("gc:after-repack")
            for name in sorted(plan.delete_packs):
                crash_point("gc:before-delete")
                store.backend.delete(pack_key(name))
            for name in sorted(plan.repack):
                store.backend.delete(pack_key(name))
            store.index.remove_packs(set(plan.delete_packs) | set(plan.repack))
            for path in plan.temp_files:
                store.backend.delete_temp(path)
        return GcResult(deleted_packs=len(plan.delete_packs), repacked_packs=len(plan.repack),
                        moved_chunks=moved, reclaimed_bytes=plan.reclaim_bytes,
                        removed_temp_files=len(plan.temp_files), duration_s=time.monotonic() - t0)


@dataclass
class GcResult:
    deleted_packs: int
    repacked_packs: int
    moved_chunks: int
    reclaimed_bytes: int
    removed_temp_files: int
    duration_s: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def live_chunk_ids(store) -> np.ndarray:
    """Sorted unique ids (dtype S16) of every chunk a manifest references, plus their delta bases."""
    parts = []
    for name in store.checkpoint_names():
        manifest = store.read_manifest(name)
        ids = [ref.id for item in manifest.items for ref in item.chunks]
        if ids:
            parts.append(np.array(ids, dtype="S16"))
    live = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype="S16")
    bases = []
    index = store.index
    for cid in live.tolist():
        entry = index.lookup(cid)
        if entry is not None and entry.codec == codec.DELTA:
            bases.append(entry.base_id)
    if bases:
        live = np.unique(np.concatenate([live, np.array(bases, dtype="S16")]))
    return live


def _contains(sorted_ids: np.ndarray, cid: bytes) -> bool:
    i = np.searchsorted(sorted_ids, np.array(cid, dtype="S16"))
    return bool(i < sorted_ids.size and sorted_ids[i] == cid)


def plan_gc(store, *, max_unused: float = 0.1, grace_s: float = DEFAULT_GRACE_S) -> GcPlan:
    """Plan a gc. ``max_unused``: repack a pack once more than this fraction of its bytes is dead."""
    if not (0.0 <= max_unused <= 1.0):
        raise ValueError("max_unused must be a fraction in [0, 1]")
    store.refresh_index()
    now = time.time()
    live = live_chunk_ids(store)
    plan = GcPlan(store=store, live_chunks=int(live.size), max_unused=max_unused, grace_s=grace_s)
    index = store.index
    for info in store.backend.list("packs/"):
        name = pack_name_from_key(info.key)
        if name is None:
            continue
        if now - info.mtime_s < grace_s:
            plan.kept_young += 1
            continue
        try:
            entries = read_pack_entries(store.backend, name, info.size_bytes)
        except Exception:  # noqa: BLE001 - an unreadable pack is verify's business; gc leaves it alone
            continue
        keep = []
        for e in entries:
            if _contains(live, e.chunk_id):
                where = index.lookup(e.chunk_id)
                if where is not None and where.pack == name:
                    keep.append(e)
        live_bytes = sum(HEADER_SIZE + e.stored_len for e in keep)
        if not keep:
            plan.delete_packs[name] = info.size_bytes
        elif 1.0 - live_bytes / info.size_bytes > max_unused:
            plan.repack[name] = keep
            plan.repack_sizes[name] = info.size_bytes
    list_temp = getattr(store.backend, "list_temp", None)
    if list_temp is not None:
        plan.temp_files = [p for p, mtime in list_temp() if now - mtime >= grace_s]
    return plan


def _repack(store, old: str, entries: list[PackEntry]) -> int:
    """Copy ``entries`` of pack ``old`` into new packs and point the index at them. Returns entries moved."""
    data = store.backend.get(pack_key(old))
    target = store.config.pack_target_bytes
    builder = PackBuilder(store.backend.spool_path())
    moved = []

    def flush(b: PackBuilder):
        name, size, new_entries = b.publish(store.backend)
        store.index.relocate(new_entries, {name: size})
        moved.extend(new_entries)

    for e in entries:
        payload = memoryview(data)[e.offset + HEADER_SIZE : e.offset + HEADER_SIZE + e.stored_len]
        builder.add(e.chunk_id, e.codec, e.elem_size, e.raw_len, payload, e.base_id, e.age)
        if builder.size_bytes >= target:
            flush(builder)
            builder = PackBuilder(store.backend.spool_path())
    if len(builder):
        flush(builder)
    else:
        builder.discard()
    return len(moved)

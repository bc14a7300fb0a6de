"""gc: reclaim the space of chunks no checkpoint needs, as a plan first, then its execution.

Mark: the live chunks are those the manifests reference plus the delta bases of those chunks. The set is
a sorted numpy array of 16-byte ids (16 bytes a chunk, not a Python object each), so stores with millions
of chunks stay within tens of MB. The index cache is not trusted for liveness: a live chunk whose cached
location does not hold it keeps the copy gc finds, and the cache is corrected.

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
from ..errors import ManifestFormatError
from .pack import (
    FOOTER_SIZE,
    HEADER_SIZE,
    PACK_MAGIC,
    ROW_SIZE,
    PackBuilder,
    PackEntry,
    decode_header,
    pack_key,
    pack_name_from_key,
    read_pack_entries,
)

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
        moved = sum(HEADER_SIZE + e.stored_len + ROW_SIZE for es in self.repack.values() for e in es)
        moved += len(self.repack) * (len(PACK_MAGIC) + FOOTER_SIZE)
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
            moved, published = 0, set()
            for old, entries in sorted(plan.repack.items()):
                n, names = _repack(store, old, entries)
                moved += n
                published |= names
                crash_point("gc:after-repack")
            for name in sorted(plan.delete_packs):
                crash_point("gc:before-delete")
                store.backend.delete(pack_key(name))
            # A repack can reproduce a pack byte for byte (same name): never delete what was just published.
            old_repacked = set(plan.repack) - published
            for name in sorted(old_repacked):
                store.backend.delete(pack_key(name))
            store.index.remove_packs(set(plan.delete_packs) | old_repacked)
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


# Chunk ids as two big-endian u64 fields: sortable, searchable, and (unlike numpy's S16) never stripped of
# trailing NUL bytes.
ID_DTYPE = np.dtype([("hi", ">u8"), ("lo", ">u8")])


def _ids(ids: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(ids), dtype=ID_DTYPE) if ids else np.empty(0, dtype=ID_DTYPE)


def live_chunk_ids(store) -> np.ndarray:
    """Sorted unique ids (dtype ID_DTYPE, 16 bytes each) of every chunk a manifest references, plus their
    delta bases."""
    parts = []
    for name in store.checkpoint_names():
        manifest = store.read_manifest(name)
        parts.append(_ids([ref.id for item in manifest.items for ref in item.chunks]))
    # (concatenate may turn the fields native-endian; astype restores the byte-order the ids are kept in)
    live = np.unique(np.concatenate(parts)).astype(ID_DTYPE) if parts else np.empty(0, dtype=ID_DTYPE)
    bases = []
    index = store.index
    raw = live.tobytes()
    for k in range(live.size):
        entry = index.lookup(raw[16 * k : 16 * k + 16])
        if entry is not None and entry.codec == codec.DELTA:
            bases.append(entry.base_id)
    if bases:
        live = np.unique(np.concatenate([live, _ids(bases)])).astype(ID_DTYPE)
    return live


def _contains(sorted_ids: np.ndarray, cid: bytes) -> bool:
    i = int(np.searchsorted(sorted_ids, _ids([cid])[0]))
    return i < sorted_ids.size and sorted_ids[i : i + 1].tobytes() == cid


def _indexed_copy_is_valid(store, where: PackEntry, present: set[str]) -> bool:
    """Whether the index's location of a chunk really holds it (the cache could be wrong)."""
    if where.pack not in present:
        return False
    try:
        head = store.backend.get_range(pack_key(where.pack), where.offset, HEADER_SIZE)
        return decode_header(head, f"pack {where.pack}")[0] == where.chunk_id
    except (ManifestFormatError, FileNotFoundError):
        return False


def plan_gc(store, *, max_unused: float = 0.1, grace_s: float = DEFAULT_GRACE_S) -> GcPlan:
    """Plan a gc. ``max_unused``: repack a pack once more than this fraction of its bytes is dead."""
    if not (0.0 <= max_unused <= 1.0):
        raise ValueError("max_unused must be a fraction in [0, 1]")
    store.refresh_index()
    now = time.time()
    live = live_chunk_ids(store)
    plan = GcPlan(store=store, live_chunks=int(live.size), max_unused=max_unused, grace_s=grace_s)
    index = store.index
    listed = [(pack_name_from_key(i.key), i) for i in store.backend.list("packs/")]
    listed = [(n, i) for n, i in listed if n is not None]
    present = {n for n, _ in listed}
    for name, info in listed:
        if now - info.mtime_s < grace_s:
            plan.kept_young += 1
            continue
        try:
            entries = read_pack_entries(store.backend, name, info.size_bytes)
        except Exception:  # noqa: BLE001 - an unreadable pack is verify's business; gc leaves it alone
            continue
        keep, fixes = [], []
        for e in entries:
            if not _contains(live, e.chunk_id):
                continue
            where = index.lookup(e.chunk_id)
            if where is not None and where.pack == name:
                keep.append(e)
            elif where is None or not _indexed_copy_is_valid(store, where, present):
                keep.append(e)  # the only trustworthy copy: keep it, and point the index at it
                fixes.append(e)
            # else: a duplicate of a chunk that lives elsewhere (e.g. left by an interrupted repack)
        if fixes:
            index.relocate(fixes, {})
        # The pack's fixed overhead (magic, table rows, footer) belongs to its live entries too.
        live_bytes = sum(HEADER_SIZE + e.stored_len + ROW_SIZE for e in keep) + len(PACK_MAGIC) + FOOTER_SIZE
        if not keep:
            plan.delete_packs[name] = info.size_bytes
        elif 1.0 - live_bytes / info.size_bytes > max_unused:
            plan.repack[name] = keep
            plan.repack_sizes[name] = info.size_bytes
    list_temp = getattr(store.backend, "list_temp", None)
    if list_temp is not None:
        plan.temp_files = [p for p, mtime in list_temp() if now - mtime >= grace_s]
    return plan


def _repack(store, old: str, entries: list[PackEntry]) -> tuple[int, set[str]]:
    """Copy ``entries`` of pack ``old`` into new packs and point the index at them.

    Returns (entries moved, names of the packs published)."""
    data = store.backend.get(pack_key(old))
    target = store.config.pack_target_bytes
    builder = PackBuilder(store.backend.spool_path())
    moved, names = [], set()

    def flush(b: PackBuilder):
        name, size, new_entries = b.publish(store.backend)
        store.index.relocate(new_entries, {name: size})
        moved.extend(new_entries)
        names.add(name)

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
    return len(moved), names

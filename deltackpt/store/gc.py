"""gc: reclaim the space of chunks no checkpoint needs, as a plan first, then its execution.

Mark (:mod:`.mark`): the live chunks are those the manifests reference plus the delta bases of those
chunks, down each chain, followed in the pack tables the sweep reads anyway.

Sweep, per pack (read from its table, the truth): an entry is live if its chunk is live and it is the only
copy gc found; of a chunk stored in several packs (an interrupted repack leaves a second copy) the copy the
index locates is live, or, when the index locates none that holds it, the first one, and the index is
pointed at it. A pack with no
live entry is deleted; a pack whose dead fraction exceeds ``max_unused`` is repacked: its live entries are
copied byte for byte (no re-encoding) into new packs, the index is pointed at them, then the old pack is
deleted. Small packs (every rank of a DCP save seals its own, so packs grow with ranks x saves) are merged
the same way into packs of the target size, once those under ``SMALL_PACK_SHARE`` of it hold that share
together (then the merged pack is not small again) or number ``MAX_SMALL_PACKS``. No delta is left without
its base: a pack that would keep a dead delta whose base is deleted is repacked (its dead entries dropped),
and the bases of deltas in young packs stay. Packs younger than
``grace_s`` are never touched, nor are temp files younger than it (nor a temp file under ``locks/``
younger than the lock staleness limit: it may be a lock being taken right now).

Two phases, so that saves go on while gc works (see :mod:`.lock` for the waiting rules):

1. ``plan_gc`` marks and plans under a *shared* lock, like a save: saves run and commit meanwhile. It lists
   the manifests, then the packs, once, and refreshes the index from that listing: a checkpoint's packs are
   published before its manifest, so the tables read (or the index refreshed from the listing) hold every
   chunk of every manifest listed, and a delta's base is found however young or old its pack looks.
2. ``GcPlan.execute`` takes the *exclusive* lock, which waits for running saves to finish and makes new
   ones wait; it re-checks the plan against the store as it is now, and deletes only what still holds.
   When no manifest, pack or gc epoch changed since the mark, the plan holds as it is and is not re-checked.
   A save that committed since the mark may reference a chunk the plan meant to delete (it deduplicated
   against it): every manifest new or changed since the mark is read, its chunks and their delta bases join
   the live set, and a pack holding any of them, or a live duplicate the index no longer locates in a kept
   pack, is dropped from the plan (left for the next gc), as is a pack holding the base of a delta that
   stays. No save is in flight during this phase (each holds its shared lock from its first dedup decision
   to its manifest), so the chunks saves claim are exactly those of the manifests present: no committed
   checkpoint loses a chunk and no in-flight save fails at commit. The phase reads only new manifests, the
   tables of packs published since the mark and a few index records, so saves wait little. (A writer
   claims only a chunk it can restore: a delta whose base is indexed too.)

Crash safety: every step publishes new objects before it removes old ones, so a crash leaves at worst
duplicate chunks or unindexed packs, which the index refresh and the next gc clean up.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from .backend import LocalFiles, UnfinishedUploads
from .lock import DEFAULT_WAIT_S, EXCLUSIVE, SHARED, STALE_AFTER_S
from ..errors import CorruptChunkError, DeltackptError, DiskFullError, ManifestFormatError, MissingChunkError
from . import commitlog, idset
from .crashpoints import crash_point
from .index import GC_EPOCH_KEY, read_gc_epoch
from .manifest import is_checkpoint_name
from .mark import concat, delta_bases, live_chunk_ids, manifest_ids, mark_live, read_tables, with_chain_bases
from .pack import (
    FOOTER_SIZE,
    HEADER_SIZE,
    PACK_MAGIC,
    ROW_SIZE,
    PackEntry,
    PackTable,
    decode_header,
    list_packs,
    pack_key,
    pack_stamps,
)
from .progress import Progress, phase
from .repack import log_repacks, repack_packs
from .source import ChunkSource

log = logging.getLogger("deltackpt.store")

DEFAULT_GRACE_S = 3600.0
# Small packs (one per rank and save, say) are merged into packs of the target size once they hold this
# share of it together (so a merged pack is not small again), or once there are this many of them.
SMALL_PACK_SHARE = 1 / 8
MAX_SMALL_PACKS = 256


@dataclass
class GcPlan:
    """What gc would do. ``execute()`` does it (under the exclusive lock)."""

    store: object
    live_chunks: int
    max_unused: float = 0.1
    grace_s: float = DEFAULT_GRACE_S
    merge_small: bool = True
    delete_packs: dict[str, int] = field(default_factory=dict)  # name -> size
    repack: dict[str, list[PackEntry]] = field(default_factory=dict)  # name -> live entries to keep
    repack_sizes: dict[str, int] = field(default_factory=dict)
    temp_files: list[str] = field(default_factory=list)
    kept_young: int = 0  # packs skipped because younger than the grace period
    merge: set[str] = field(default_factory=set)  # those of ``repack`` planned only because they are small
    # What the plan was made from, to re-check it under the exclusive lock.
    live: np.ndarray | None = field(default=None, repr=False)
    manifests: dict[str, tuple] = field(default_factory=dict, repr=False)  # name -> (size, mtime, version)
    pack_entries: dict[str, PackTable] = field(default_factory=dict, repr=False)  # planned packs' tables
    packs: set[str] = field(default_factory=set, repr=False)  # every pack listed
    epoch: bytes = field(default=b"", repr=False)  # the gc epoch when the store was listed

    @property
    def moved_bytes(self) -> int:
        """Bytes of the live entries repacked and merged (headers and table rows included)."""
        return sum(HEADER_SIZE + e.stored_len + ROW_SIZE for es in self.repack.values() for e in es)

    @property
    def reclaim_bytes(self) -> int:
        moved = self.moved_bytes + self.new_packs * (len(PACK_MAGIC) + FOOTER_SIZE)
        return sum(self.delete_packs.values()) + sum(self.repack_sizes.values()) - moved

    @property
    def new_packs(self) -> int:
        """About how many packs the repacked and merged entries make (they share packs of the target size)."""
        return -(-self.moved_bytes // self.store.config.pack_target_bytes) if self.repack else 0

    def as_dict(self) -> dict:
        return {"live_chunks": self.live_chunks, "delete_packs": sorted(self.delete_packs),
                "repack_packs": sorted(set(self.repack) - self.merge), "merge_packs": sorted(self.merge),
                "new_packs": self.new_packs, "temp_files": self.temp_files,
                "kept_young_packs": self.kept_young, "reclaim_bytes": self.reclaim_bytes}

    def execute(self, *, wait_s: float = DEFAULT_WAIT_S, progress: Progress | None = None) -> "GcResult":
        """Take the exclusive lock (waiting up to ``wait_s`` for running saves to finish), re-check this plan
        against the store as it is now (saves may have committed since it was made), and carry out what
        still holds. ``progress`` hears of each pack deleted or repacked."""
        store = self.store
        t0 = time.monotonic()
        with store.lock(EXCLUSIVE, wait_s=wait_s) as lock:
            plan = self.revalidate()
            # A new epoch before any pack goes: a process whose index cache is its own (another host) sees
            # it at its next save and refreshes, instead of deduplicating against a deleted pack.
            epoch = uuid.uuid4().hex.encode() if plan.delete_packs or plan.repack else None
            epoch_written = epoch is None or _put_epoch(store, epoch, may_fail=bool(plan.delete_packs))
            later = _bases_of_repacked(plan)
            with phase(progress, "gc", len(plan.delete_packs) + len(plan.repack), "pack") as bar:
                def delete_dead(names) -> None:
                    for name in sorted(names):
                        crash_point("gc:before-delete")
                        lock.check_in_a_while()  # a lock gone stale may be a save's now: stop
                        store.backend.delete(pack_key(name))
                        crash_point("gc:after-delete")
                        bar.advance(1)

                # Dead packs first: on a full disk their space is what lets the epoch and the repacks be written.
                # But not one holding a base of a delta in a pack still to be repacked: a gc cut short there
                # would leave that (dead) delta without its base, a copy that no longer decodes.
                delete_dead(set(plan.delete_packs) - later)
                if not epoch_written:
                    _put_epoch(store, epoch, may_fail=False)
                written: dict[str, tuple[int, list[PackEntry]]] = {}
                moved, published, damaged = repack_packs(store, plan.repack, bar, written, check=True)
                kept = later & _bases_of_repacked(plan, damaged)  # bases of what a damaged pack still holds
                # A repack can reproduce a dead pack byte for byte, so under its name (the duplicate of a chunk
                # that a gc killed after its repack left): never delete what was just published.
                kept |= later & published
                delete_dead(later - kept)
            # A repack can reproduce a pack byte for byte (same name): never delete what was just published.
            old_repacked = set(plan.repack) - published - damaged
            for name in sorted(old_repacked):
                lock.check_in_a_while()
                store.backend.delete(pack_key(name))
            deleted = set(plan.delete_packs) - kept - published
            gone = deleted | old_repacked
            if epoch is not None:
                # Another epoch once every pack is gone: a cache that caught up half way through (a read
                # that found a pack gone) took the first one for seen, and would take a pack deleted after
                # that for damage.
                done = uuid.uuid4().hex.encode()
                if _put_epoch(store, done, may_fail=True):
                    epoch = done
                else:
                    log.warning("gc: the store's gc-epoch was not updated after the deletes (disk full)")
            store.index.remove_packs(gone, concat([plan.pack_entries[n].chunk_ids for n in gone]))
            if epoch is not None:
                store.index.set_meta(b"gc_epoch", epoch)  # this process's cache already knows
            for path in plan.temp_files:
                if isinstance(store.backend, UnfinishedUploads):
                    try:
                        store.backend.abort_unfinished(path)
                    except (DeltackptError, OSError) as e:  # the packs are done; this is housekeeping
                        log.warning("gc: unfinished upload %s not aborted (%s)", path, e)
                else:
                    store.backend.delete_temp(path)
            if written:
                log_repacks(store, epoch, written)
            _drop_orphan_records(store, (set(plan.packs) - gone) | published)
        # What was done, not what was planned: a damaged pack stays, and a pack a repack wrote again under its
        # own name (or a dead one's) neither went nor came.
        before = plan.delete_packs.keys() | plan.repack_sizes.keys()
        reclaimed = (sum(plan.delete_packs[n] for n in deleted) + sum(plan.repack_sizes[n] for n in old_repacked)
                     - sum(size for n, (size, _entries) in written.items() if n not in before))
        return GcResult(deleted_packs=len(deleted),
                        repacked_packs=len(set(plan.repack) - plan.merge - damaged),
                        merged_packs=len(plan.merge - damaged), new_packs=len(published), moved_chunks=moved,
                        reclaimed_bytes=reclaimed, removed_temp_files=len(plan.temp_files),
                        duration_s=time.monotonic() - t0, damaged_packs=sorted(damaged))

    def revalidate(self) -> "GcPlan":
        """This plan less what no longer holds (call it under the exclusive lock): packs gone since, packs
        holding a chunk that a manifest new or changed since the mark references (or the delta base of
        one), packs whose live duplicate the index no longer locates in a kept pack; and temp files gone or
        too young."""
        store = self.store
        if self.live is None:  # not made by plan_gc: plan from scratch
            return _plan(store, max_unused=self.max_unused, grace_s=self.grace_s, merge_small=self.merge_small)
        manifests = _list_manifests(store)
        listed = list_packs(store.backend)
        store.refresh_index(pack_stamps(listed))
        present = set(listed)
        planned = set(self.temp_files)
        if manifests == self.manifests and present == self.packs and read_gc_epoch(store.backend) == self.epoch:
            # Nothing committed, published or collected since the mark: the plan holds as it is.
            self.temp_files = [p for p in _removable_temp_files(store, self.grace_s) if p in planned]
            return self
        changed = [n for n, seen in manifests.items() if self.manifests.get(n) != seen]
        live = idset.union(self.live, live_chunk_ids(store, changed)) if changed else self.live
        # Packs published since the mark keep their deltas' bases (an aborted save's deltas stay restorable).
        live = with_chain_bases(store, live, delta_bases(store, {n: listed[n] for n in present - self.packs}))
        kept = {name: idset.unique(idset.from_ids([e.chunk_id for e in keep]))
                for name, keep in self.repack.items()}
        index = store.index

        def still_dead(name: str, dropped: np.ndarray) -> bool:
            """Whether removing the entries ``dropped`` (V16 ids) of pack ``name`` loses no live chunk."""
            if name not in present:
                return False
            for cid in (c.tobytes() for c in dropped[idset.isin(live, dropped)]):
                where = index.lookup(cid)  # a live duplicate: its indexed copy must stay
                if (where is None or where.pack == name or where.pack not in present
                        or where.pack in self.delete_packs
                        or (where.pack in kept and not idset.contains(kept[where.pack], cid))):
                    return False
            return True

        def dropped_by_repack(name: str) -> np.ndarray:
            ids = self.pack_entries[name].chunk_ids
            return ids[~idset.isin(kept[name], ids)]

        while True:
            delete = [n for n in self.delete_packs if still_dead(n, self.pack_entries[n].chunk_ids)]
            repack = [n for n in self.repack if still_dead(n, dropped_by_repack(n))]
            # A pack dropped from the plan keeps its dead deltas as they are: their bases must stay too.
            dropped = (set(self.delete_packs) - set(delete)) | (set(self.repack) - set(repack))
            bases = concat([self.pack_entries[n].base_ids[self.pack_entries[n].has_base] for n in dropped])
            pins = bases[~idset.isin(live, bases)]
            if not pins.size:
                break
            live = with_chain_bases(store, live, pins)
        plan = GcPlan(store=store, live_chunks=int(live.size), max_unused=self.max_unused, grace_s=self.grace_s,
                      merge_small=self.merge_small, kept_young=self.kept_young, live=live, manifests=manifests,
                      packs=present, epoch=read_gc_epoch(store.backend))
        for name in delete:
            plan.delete_packs[name] = self.delete_packs[name]
            plan.pack_entries[name] = self.pack_entries[name]
        plan.merge = self.merge & set(repack)
        for name in repack:
            plan.repack[name] = self.repack[name]
            plan.repack_sizes[name] = self.repack_sizes[name]
            plan.pack_entries[name] = self.pack_entries[name]
        plan.temp_files = [p for p in _removable_temp_files(store, self.grace_s) if p in planned]
        return plan


@dataclass
class GcResult:
    deleted_packs: int
    repacked_packs: int  # for their dead bytes
    merged_packs: int  # small packs merged into packs of the target size
    new_packs: int  # written by the repacks and merges together
    moved_chunks: int
    reclaimed_bytes: int
    removed_temp_files: int
    duration_s: float
    # Packs planned for a repack that no longer hash to their names: left as they are (marked damaged) for
    # verify and repair; the CLI exits 1 (problems found).
    damaged_packs: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _drop_orphan_records(store, present: set[str]) -> None:
    """Delete the commit records (:mod:`.commitlog`) of forgotten checkpoints once none of their packs is
    left (``present``: the packs there are now): until then they hold those packs' tables for an empty cache.
    Under the exclusive lock: no commit is between its manifest and its record."""
    names = set(store.checkpoint_names())
    for name in (n for n in commitlog.record_names(store.backend) if n not in names):
        key = commitlog.PREFIX + name
        try:
            data = bytes(store.backend.get(key))
        except (OSError, DeltackptError):  # gone meanwhile, or not read this time: the next gc looks again
            continue
        record = commitlog.decode_commit_record(data, name, store.config.store_id)
        if record is None or not present.intersection(record.packs):  # not a record, or no pack of it left
            store.backend.delete(key)


def _list_manifests(store) -> dict[str, tuple[int, float, str]]:
    """Checkpoint name -> (manifest size, mtime, version): what tells a manifest written since apart, also one
    written again under its name within the mtime's resolution (S3: a second) with the same size."""
    out = {}
    for info in store.backend.list("manifests/"):
        name = info.key[len("manifests/"):]
        if is_checkpoint_name(name):  # another file there is no checkpoint
            out[name] = (info.size_bytes, info.mtime_s, info.version)
    return out


def _removable_temp_files(store, grace_s: float) -> list[str]:
    """Stray temp files gc may remove: older than ``grace_s``, and under ``locks/`` older than a lock can
    stay fresh (a younger one may be a lock being taken by a save right now). On object storage: the
    unfinished multipart uploads older than ``grace_s`` (a killed upload's parts, billed until aborted)."""
    if isinstance(store.backend, UnfinishedUploads):
        now = time.time()
        try:
            listed = store.backend.list_unfinished()
        except (DeltackptError, OSError) as e:  # e.g. a policy without s3:ListBucketMultipartUploads
            log.warning("gc: unfinished uploads not listed (%s); a bucket lifecycle rule can abort them", e)
            return []
        return sorted(t for t, started in listed if now - started >= grace_s)
    if not isinstance(store.backend, LocalFiles):
        return []
    now = time.time()
    return [p for p, mtime in store.backend.list_temp()
            if now - mtime >= (max(grace_s, STALE_AFTER_S) if p.replace(os.sep, "/").startswith("locks/")
                               else grace_s)]


def _indexed_copy_is_valid(store, where: PackEntry, present: set[str], source=None) -> bool:
    """Whether the index's location of a chunk really holds it (the cache could be wrong), and, with
    ``source`` (a ChunkSource), whether its bytes decode to the chunk (a damaged copy another host found
    and wrote again elsewhere: its damage marks are in that host's cache only)."""
    if where.pack not in present:
        return False
    try:
        head = store.backend.get_range(pack_key(where.pack), where.offset, HEADER_SIZE)
        if decode_header(head, f"pack {where.pack}")[0] != where.chunk_id:
            return False
        if source is not None:
            source.decode_entry(where)  # decoded and hashed (with its chain): raises on damage
        return True
    except (ManifestFormatError, FileNotFoundError, CorruptChunkError, MissingChunkError):
        return False


def plan_gc(store, *, max_unused: float = 0.1, grace_s: float = DEFAULT_GRACE_S, merge_small: bool = True,
            wait_s: float = DEFAULT_WAIT_S, progress: Progress | None = None) -> GcPlan:
    """Plan a gc, under a shared lock (saves go on meanwhile; a running gc's delete phase is waited for,
    up to ``wait_s``). ``max_unused``: repack a pack once more than this fraction of its bytes is dead.
    ``merge_small``: merge packs under ``SMALL_PACK_SHARE`` of the target size into packs of the target
    size, once they hold that share together or number ``MAX_SMALL_PACKS``. ``progress`` hears of each
    pack table read."""
    if not (0.0 <= max_unused <= 1.0):
        raise ValueError("max_unused must be a fraction in [0, 1]")
    with store.lock(SHARED, wait_s=wait_s):
        return _plan(store, max_unused=max_unused, grace_s=grace_s, merge_small=merge_small, progress=progress)


def _plan(store, *, max_unused: float, grace_s: float, merge_small: bool, progress: Progress | None = None) -> GcPlan:
    store.refresh_config()  # the chain limit as it is now (marking follows every chain regardless)
    now = time.time()
    epoch = read_gc_epoch(store.backend)  # before the listings: a gc that runs meanwhile changes it
    manifests = _list_manifests(store)  # before the manifests are read: one written after counts as new
    # One listing of the packs, after the manifests' (a checkpoint's packs are published before its manifest,
    # so the tables read, or the index refreshed from the listing, hold every chunk a listed manifest
    # references); a pack published since is new to revalidate().
    listed = list_packs(store.backend)
    store.refresh_index(pack_stamps(listed))
    live = manifest_ids(store, list(manifests))
    young = {n for n, i in listed.items() if now - i.mtime_s < grace_s}
    tables = read_tables(store, listed, progress)
    names = [n for n in tables if n not in young]  # the packs gc may act on; young ones' tables come after
    every = names + [n for n in tables if n in young]
    ids = concat([tables[n].chunk_ids for n in every])
    bases = concat([tables[n].base_ids for n in every])
    has_base = concat([tables[n].has_base for n in every], bool)
    counts = np.array([len(tables[n]) for n in names], dtype=np.int64)
    num_old = int(counts.sum())
    # A young pack may be an in-flight save's: the bases of its deltas stay, whether or not it commits.
    live, pos = mark_live(store, live, bases[num_old:][has_base[num_old:]], ids, bases, has_base)
    if len(tables) < len(listed):  # a table not read: the index's view of each live chunk counts too
        live = with_chain_bases(store, live)
        pos = idset.find(live, ids)
    plan = GcPlan(store=store, live_chunks=int(live.size), max_unused=max_unused, grace_s=grace_s,
                  merge_small=merge_small, live=live, manifests=manifests, packs=set(listed), epoch=epoch)
    plan.kept_young = len(young)
    sizes = np.array([listed[n].size_bytes for n in names], dtype=np.int64)
    owner = np.repeat(np.arange(len(names)), counts)
    first = np.cumsum(counts) - counts  # position of each pack's first entry
    keep = _live_entries(store, plan, [tables[n] for n in names], owner, first, live.size, pos, num_old)
    del ids, pos
    # The pack's fixed overhead (magic, table rows, footer) belongs to its live entries too.
    cost = concat([tables[n].stored_lens for n in names], np.uint64).astype(np.int64) + HEADER_SIZE + ROW_SIZE
    live_bytes = np.bincount(owner[keep], weights=cost[keep], minlength=len(names)) + len(PACK_MAGIC) + FOOTER_SIZE
    num_kept = np.bincount(owner[keep], minlength=len(names))
    # A dead delta whose base is deleted could not be restored: its pack is repacked, never kept as is.
    with_base = np.flatnonzero(has_base[:num_old])
    orphaned = np.bincount(owner[with_base[~idset.isin(live, bases[with_base])]], minlength=len(names)) > 0
    del bases, has_base
    small = []
    for i, name in enumerate(names):
        if not num_kept[i]:
            plan.delete_packs[name] = int(sizes[i])
            plan.pack_entries[name] = tables[name]
        elif orphaned[i] or 1.0 - live_bytes[i] / sizes[i] > max_unused:
            _plan_repack(plan, tables[name], keep[first[i]:first[i] + counts[i]], int(sizes[i]))
        elif sizes[i] < SMALL_PACK_SHARE * store.config.pack_target_bytes:
            small.append(i)
    if merge_small and (len(small) >= MAX_SMALL_PACKS
                        or live_bytes[small].sum() >= SMALL_PACK_SHARE * store.config.pack_target_bytes):
        for i in small:
            _plan_repack(plan, tables[names[i]], keep[first[i]:first[i] + counts[i]], int(sizes[i]))
            plan.merge.add(names[i])
    plan.temp_files = _removable_temp_files(store, grace_s)
    return plan


def _plan_repack(plan: GcPlan, table: PackTable, keep: np.ndarray, size: int) -> None:
    """Plan to copy the entries of ``table`` that ``keep`` (a bool per entry) says into new packs."""
    plan.repack[table.name] = table.entries(np.flatnonzero(keep))
    plan.repack_sizes[table.name] = size
    plan.pack_entries[table.name] = table


def _live_entries(store, plan: GcPlan, tables: list[PackTable], owner: np.ndarray, first: np.ndarray,
                  num_live: int, pos: np.ndarray, num_old: int) -> np.ndarray:
    """A bool per entry of ``tables`` (entry ``j`` is row ``j - first[owner[j]]`` of ``tables[owner[j]]``, and
    ``pos[j]`` its chunk's position in the live set of ``num_live``, -1 when dead; ``pos`` goes on past
    ``num_old`` with the young packs' entries): whether gc keeps it. An entry is kept if its chunk is live
    and no other entry holds that chunk. Of a live chunk with copies in several packs (left by an
    interrupted repack, or by two saves writing it at once) the copy the index locates is kept, or, when the
    index locates none that holds it, the first one, and the index is pointed at it; the index is read only
    for these."""
    copies = np.bincount(pos[pos >= 0], minlength=num_live + 1)  # [-1]: entries of dead chunks, never read
    pos = pos[:num_old]
    keep = pos >= 0
    shared = np.flatnonzero(keep & (copies[pos] > 1))
    del pos, copies
    index, fixed, sound = store.index, {}, {}
    source = ChunkSource(store) if len(shared) else None

    def located_is_sound(located: PackEntry) -> bool:  # read and hashed once per chunk (copies are rare)
        key = (located.chunk_id, located.pack, located.offset)
        if key not in sound:
            sound[key] = _indexed_copy_is_valid(store, located, plan.packs, source)
        return sound[key]

    for j in shared.tolist():
        e = tables[owner[j]].entry(j - first[owner[j]])
        if e.chunk_id in fixed:
            keep[j] = False  # a second copy of a chunk whose first copy is kept
            continue
        located = index.lookup(e.chunk_id)
        if located is not None and (located.pack, located.offset) == (e.pack, e.offset):
            continue  # the copy the index locates (kept, even if damaged: deleting it would gain nothing)
        if located is None or not located_is_sound(located):
            fixed[e.chunk_id] = e  # the only trustworthy copy: keep it, and point the index at it
        else:
            keep[j] = False  # a duplicate of a chunk that lives elsewhere (e.g. left by an interrupted repack)
    if fixed:
        index.relocate(list(fixed.values()), {})
    return keep


def _bases_of_repacked(plan: "GcPlan", only=None) -> set[str]:
    """The dead packs of ``plan`` that hold a delta base of some entry of a pack it repacks (of ``only``
    of them)."""
    names = plan.repack if only is None else [n for n in plan.repack if n in only]
    if not names or not plan.delete_packs:
        return set()
    bases = idset.unique(concat([plan.pack_entries[n].base_ids[plan.pack_entries[n].has_base]
                                 for n in names if n in plan.pack_entries]))
    if not bases.size:
        return set()
    return {n for n in plan.delete_packs
            if n in plan.pack_entries and idset.isin(bases, plan.pack_entries[n].chunk_ids).any()}


def _put_epoch(store, epoch: bytes, *, may_fail: bool) -> bool:
    """Publish gc's epoch; on a full disk with dead packs still to delete, report False (write it after)."""
    try:
        store.backend.put(GC_EPOCH_KEY, epoch)
        return True
    except DiskFullError:
        if not may_fail:
            raise
        return False



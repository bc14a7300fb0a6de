"""The chunk index: an LMDB cache of what the packs say.

Packs are the truth. The index maps chunk id -> (pack, offset, lengths, codec, element size, base) so that
dedup and reads need no pack scan, and records which packs it has seen. It is a cache: ``refresh`` indexes
packs it has not seen (a crash between pack upload and index update leaves such packs) and rebuilds from
scratch when a pack it knows has disappeared, when the cache is unreadable, or when it belongs to another
store. ``deltackpt index rebuild`` forces a rebuild. Refresh and rebuild live in :mod:`.reindex`, verify's
reconcile in :mod:`.reconcile` (mix-ins of :class:`ChunkIndex`); look-ups, writes and meta live here.

A fault of the cache never makes the store unusable (each kind is logged once, as a warning):

- a cache location this user cannot write (a read-only store, another user's) is passed over for the next
  candidate (the per-user cache directory); when none can be written the index lives in memory;
- any LMDB error, or a malformed record, means the cache is damaged: it is dropped and rebuilt from the
  pack tables, and the operation retried; a reader that finds a well-formed record wrong calls
  :meth:`ChunkIndex.distrust` for the same;
- a cache write that fails for want of space (or I/O) moves the index into memory, rebuilt from the pack
  tables, except for records that are only nice to have (checkpoint summaries, verification times),
  which are skipped.

How the LMDB environment is opened, shared in the process, and repaired lives in :mod:`.lmdbenv`.
"""

from __future__ import annotations

import logging
import struct
import time
from functools import partial
from itertools import compress, islice
from pathlib import Path

import numpy as np

from . import lmdbenv
from .commitlog import Commit
from . import idset
from .lmdbenv import LmdbCache, close_env, guarded
from .pack import PackEntry, is_pack_name, pack_key
from .reconcile import Reconciling
from .records import (RECORD_DTYPE, RECORD_SIZE, Located, decode_record, encode_record, locate_in, locate_walk,
                      malformed, records_in)
from .reindex import DAMAGED_PACKS_KEY, Reindexing, pack_names, pack_names_bytes

log = logging.getLogger("deltackpt.store")

_MAP_SIZE = 1 << 36  # virtual; the file grows as needed
INDEX_VERSION = b"2"
_CHECK_RECORDS = 256  # records checked at once by check_records (~50 KiB of objects)

# Written by gc before it deletes packs; a cache that saw another epoch is refreshed before it is trusted.
GC_EPOCH_KEY = "gc-epoch"
LAST_COMMIT_KEY = b"last_commit"  # meta: the checkpoint whose commit this cache indexed last (Store.index_as_of)
LAST_COMMIT_NS_KEY = b"last_commit_ns"  # meta: that commit's created_ns (decimal), empty when not known
_envs, _close_env = lmdbenv._envs, close_env  # the registry, under the names the tests close it by


def read_gc_epoch(backend) -> bytes:
    """The store's gc epoch (empty when no gc has deleted a pack)."""
    try:
        return bytes(backend.get(GC_EPOCH_KEY))
    except FileNotFoundError:
        return b""


class ChunkIndex(Reindexing, Reconciling, LmdbCache):
    """Chunk id -> PackEntry, cached in LMDB under the first of ``cache_dir``, ``*fallback_dirs`` that this
    process can write, else in memory."""

    def __init__(self, backend, cache_dir: Path, store_id: str, fallback_dirs=()) -> None:
        super().__init__([Path(d) / "index.lmdb" for d in (cache_dir, *fallback_dirs)])
        self.backend = backend
        self.store_id = store_id.encode()
        self._refreshes_begun = 0  # refreshes from a listing of their own, counted as they list
        self._refreshed_upto = 0  # the highest of those numbers whose refresh finished

    def __getstate__(self):
        raise TypeError("ChunkIndex holds an LMDB environment and is not picklable; reopen the store")

    @property
    def in_memory(self) -> bool:
        return self.path is None

    @property
    def generation(self) -> int:
        """Changes whenever the index is repaired or rebuilt (see :meth:`distrust`)."""
        return self._gen

    @property
    def refreshes(self) -> int:
        """How many refreshes from a listing of their own (:meth:`refresh`) this object began."""
        return self._refreshes_begun

    def refreshed_since(self, refreshes: int) -> bool:
        """Whether a refresh that listed the packs after :attr:`refreshes` read ``refreshes`` has finished:
        a chunk whose pack was published before then is indexed, if the packs hold it."""
        return self._refreshed_upto > refreshes

    def distrust(self, gen: int) -> bool:
        """A caller found a record of the index wrong (its pack is missing, its bytes are not that chunk):
        rebuild the index from the packs unless this process already did. ``gen`` is :attr:`generation`
        when the caller looked the record up. True when the caller should look again."""
        with self._repair_lock:
            if gen != self._gen:
                return True  # rebuilt since the caller looked
            epoch = read_gc_epoch(self.backend)  # before the listing: a gc after it is not taken for seen
            if self._trusted:
                if epoch == (self.get_meta(b"gc_epoch") or b""):
                    return False  # the index says what the packs said, and no gc ran since: the damage is real
                # A gc since moved chunks (another host's: a cache on each node sees its gc only through the
                # epoch, and reads do not sync as saves do): catch up, look again.
                self.refresh()
            else:
                self._warn("distrust", f"index cache {self.path} disagrees with the packs; rebuilding it from "
                                       "the pack tables")
                self.rebuild()
            self.set_meta(b"gc_epoch", epoch)
            self._gen += 1
            return True

    def _dbs(self):
        self.env
        return self._db[b"chunks"], self._db[b"packs"], self._db[b"meta"]

    # -- verification times (which packs verify checked last, so partial runs rotate) -------------------------
    @guarded()
    def last_verified(self, pack: str) -> float:
        self.env
        with self.env.begin(db=self._db[b"verified"]) as txn:
            raw = txn.get(bytes.fromhex(pack))
        return struct.unpack("<d", raw)[0] if raw is not None and len(raw) == 8 else 0.0

    @guarded(best_effort=True)
    def mark_verified(self, packs, when: float | None = None) -> None:
        """Record ``packs`` (a name or names) as verified at ``when`` (default now), in one transaction."""
        value = struct.pack("<d", time.time() if when is None else when)
        self.env
        with self.env.begin(write=True, db=self._db[b"verified"]) as txn:
            for pack in [packs] if isinstance(packs, str) else packs:
                txn.put(bytes.fromhex(pack), value)

    # -- checkpoint summaries (a cache of what ``ls`` needs, keyed by manifest name) ------------------------
    @guarded()
    def get_summaries(self) -> dict[str, bytes]:
        if self._is_foreign():  # read before any refresh (ls): another store's summaries are not ours
            return {}
        with self.env.begin(db=self._db[b"ckpts"]) as txn:
            # (A damaged key, not UTF-8, names no manifest: left out as any stale summary is.)
            return {bytes(k).decode("utf-8", "replace"): bytes(v) for k, v in txn.cursor()}

    @guarded(best_effort=True)
    def put_summaries(self, summaries: dict[str, bytes], drop=(), meta: dict[bytes, bytes] | None = None) -> None:
        """Store checkpoint summaries (and ``meta`` keys, in the same transaction: one disk sync, not two)."""
        _, _, meta_db = self._dbs()
        with self.env.begin(write=True, db=self._db[b"ckpts"]) as txn:
            for name in drop:
                txn.delete(name.encode())
            for name, value in summaries.items():
                txn.put(name.encode(), value)
            for key, value in (meta or {}).items():
                txn.put(key, value, db=meta_db)

    # -- reads -------------------------------------------------------------------------------------------
    @guarded()
    def lookup(self, chunk_id: bytes) -> PackEntry | None:
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            rec = txn.get(chunk_id)
        return None if rec is None else decode_record(chunk_id, rec)

    @guarded()
    def lookup_many(self, chunk_ids) -> dict[bytes, PackEntry]:
        chunks, _, _ = self._dbs()
        out = {}
        with self.env.begin(db=chunks) as txn:
            for cid in chunk_ids:
                rec = txn.get(cid)
                if rec is not None:
                    out[cid] = decode_record(cid, rec)
        return out

    def lookup_records(self, chunk_ids) -> tuple[list[bytes], np.ndarray]:
        """The indexed ones of ``chunk_ids`` and their records (RECORD_DTYPE), decoded in bulk: a save looks
        up every chunk it reuses, so a PackEntry each (1.5 us) was most of a 1 % save."""
        chunk_ids = list(chunk_ids)
        recs, found = self.records(chunk_ids)
        return list(compress(chunk_ids, found)), recs[found]

    @guarded()
    def locate(self, ids: np.ndarray) -> Located:
        """The pack and delta base of each of ``ids`` (an array of 16-byte ids), in one read transaction;
        only the fields a structure check needs are read, no PackEntry is built."""
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            return locate_in(txn.get, ids)

    @guarded()
    def locate_each(self, ids: np.ndarray, fn, block: int = 1 << 16) -> list:
        """``fn(start, Located)`` for each block of ``ids`` (``ids[start:start + n]``, ``n <= block``, in
        order), all in one read transaction (sorted ids that are most of the cache: by walking it): what a
        caller keeps of each block is its own choice, so memory need not hold the bases of every id at once.
        Returns ``fn``'s results; after a fault of the cache is repaired it is called again from the first
        block, so it should write into its own arrays by position only."""
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            if ids.size > _WALK_ABOVE and 2 * ids.size >= txn.stat(chunks)["entries"] and idset.is_sorted_unique(ids):
                return locate_walk(txn, ids, fn, block)  # most of the cache, in its order: walked, not looked up
            return [fn(start, locate_in(txn.get, ids[start:start + block])) for start in range(0, ids.size, block)]

    @guarded()
    def records(self, chunk_ids) -> tuple[np.ndarray, np.ndarray]:
        """(records, found) of ``chunk_ids`` (a list of 16-byte ids) in one read transaction: a RECORD_DTYPE
        array (all zeros where not indexed) and a bool array of which are indexed, checked as decode_record
        checks one but in arrays (1.1 us a chunk where lookup_many, a PackEntry each, took 3.8)."""
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            return records_in(txn.get, chunk_ids)

    @guarded()
    def check_records(self) -> int:
        """Number of malformed records in the cache (a damaged cache is rebuilt, never trusted)."""
        chunks, _, _ = self._dbs()
        bad = 0
        with self.env.begin(db=chunks) as txn:
            items = txn.cursor().iternext(keys=True, values=True)
            while batch := list(islice(items, _CHECK_RECORDS)):  # memory O(1): a batch at a time, the loops in C
                keys, values = zip(*batch)
                sound = set(map(len, keys)) == {16} and set(map(len, values)) == {RECORD_SIZE}
                if not sound:  # a key or a record of the wrong size: counted one by one, the rest checked
                    fits = [len(k) == 16 and len(v) == RECORD_SIZE for k, v in batch]
                    bad += fits.count(False)
                    values = list(compress(values, fits))
                bad += int(malformed(np.frombuffer(b"".join(values), dtype=RECORD_DTYPE)).sum())
        return bad

    @guarded()
    def write_token(self):
        """A value that changes whenever the cache is written, by any process (LMDB's last transaction id);
        None for a cache in memory, which has none (a caller then assumes it changed)."""
        self.env
        return None if self.in_memory else self.env.info()["last_txnid"]

    @guarded()
    def known_packs(self) -> set[str]:
        return self._known_packs()

    @guarded()
    def indexes_packs(self, names) -> bool:
        """Whether every pack of ``names`` is indexed (one get each, not a pass over every pack)."""
        _, packs, _ = self._dbs()
        with self.env.begin(db=packs) as txn:
            return all(txn.get(bytes.fromhex(p)) is not None for p in names)

    def _known_packs(self) -> set[str]:
        _, packs, _ = self._dbs()
        with self.env.begin(db=packs) as txn:
            return {bytes(k).hex() for k, _ in txn.cursor()}

    @guarded()
    def num_chunks(self) -> int:
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            return txn.stat(chunks)["entries"]

    @guarded()
    def iter_entries(self):
        """Every indexed entry (read at once, so a repair never leaves a half-consumed iterator)."""
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            return iter([decode_record(bytes(k), bytes(v)) for k, v in txn.cursor()])

    # -- writes ------------------------------------------------------------------------------------------
    @guarded()
    def add(self, entries, packs: dict[str, int], *, if_present: bool = False) -> list[PackEntry]:
        """Record ``entries`` and mark ``packs`` (name -> size) as indexed, in one transaction.

        An id already indexed keeps its first location, so repeated chunks never move, unless the new copy is
        a keyframe and the indexed one a delta (:func:`_take_if_better`): the entries not located are
        returned. ``if_present``: skip the packs (and their entries) that no longer exist, checked inside
        the transaction.
        """
        return self._add(list(entries), packs, if_present=if_present)

    def _add(self, entries, packs: dict[str, int], if_present: bool = False,
             rank: dict[str, int] | None = None) -> list[PackEntry]:
        """:meth:`add`'s work; ``rank``: the packs' order of precedence (0 first) when they are not indexed in
        that order, so that of a chunk in several packs the copy of the first pack is located."""
        chunks, packs_db, meta = self._dbs()
        with self.env.begin(write=True) as txn:
            gone = {n for n in packs if not self.backend.exists(pack_key(n))} if if_present else ()
            if gone:
                entries = [e for e in entries if e.pack not in gone]
                packs = {n: size for n, size in packs.items() if n not in gone}
            if txn.get(b"store_id", db=meta) != self.store_id:
                txn.put(b"store_id", self.store_id, db=meta)
                txn.put(b"version", INDEX_VERSION, db=meta)
            kept = [e for e in entries if not txn.put(e.chunk_id, encode_record(e), db=chunks, overwrite=False)]
            if kept:  # the marks as stored now: another process may have marked a pack since this one read
                damaged = pack_names(txn.get(DAMAGED_PACKS_KEY, db=meta))
                kept = [e for e in kept if not _take_if_better(txn, chunks, e, rank, damaged)]
            for name, size in packs.items():
                txn.put(bytes.fromhex(name), struct.pack("<Q", size), db=packs_db)
        return kept

    @guarded()
    def relocate(self, entries, packs: dict[str, int]) -> None:
        """Point ``entries``' chunks at their new location (repack), in one transaction."""
        chunks, packs_db, _ = self._dbs()
        with self.env.begin(write=True) as txn:
            for e in entries:
                txn.put(e.chunk_id, encode_record(e), db=chunks)
            for name, size in packs.items():
                txn.put(bytes.fromhex(name), struct.pack("<Q", size), db=packs_db)

    @guarded()
    def remove_packs(self, names, ids: np.ndarray | None = None) -> None:
        """Forget ``names`` and every chunk located in them (used by gc after deleting packs), in one
        transaction: one pass over the records, holding only the ids it removes; with ``ids`` (the chunk ids
        of those packs' tables), a look-up of each instead, which touches only what is removed."""
        raw_names = {bytes.fromhex(n) for n in names}
        if not raw_names:
            return
        chunks, packs_db, _ = self._dbs()
        with self.env.begin(write=True) as txn:
            if ids is None:
                doomed = [bytes(k) for k, v in txn.cursor(db=chunks) if bytes(v[:16]) in raw_names]
            else:
                keys = idset.unique(ids).tolist()  # in key order: the B-tree's pages in turn
                doomed = [k for k, v in zip(keys, map(partial(txn.get, db=chunks), keys))
                          if v is not None and bytes(v[:16]) in raw_names]
            for k in doomed:
                txn.delete(k, db=chunks)
            for rn in raw_names:
                txn.delete(rn, db=packs_db)
        self.clear_damaged(names)  # gone: nothing left to distrust

    @guarded()
    def get_meta(self, key: bytes) -> bytes | None:
        _, _, meta = self._dbs()
        with self.env.begin(db=meta) as txn:
            value = txn.get(key)
        return None if value is None else bytes(value)

    # -- packs found damaged ----------------------------------------------------------------------------------
    def damaged_packs(self, refresh: bool = False) -> frozenset[str]:
        """Packs a read or verify (of any process on this cache) found a chunk damaged in. A writer reuses
        nothing from them and codes no delta against their chunks, so the next save writes such a chunk again
        from memory, and the index then locates the new copy (:func:`_take_if_better`): without this, every
        later save deduplicated against the damaged chunk, unrestorable. ``refresh``: read the cache again
        (a writer does, at its start: a ``verify`` in another process may have marked one since)."""
        cached = getattr(self, "_damaged", None)
        if cached is None or refresh:
            cached = self._damaged = pack_names(self.get_meta(DAMAGED_PACKS_KEY))
        return cached

    def mark_damaged(self, packs) -> None:
        """Add ``packs`` (names) to :meth:`damaged_packs` (kept in the cache, across rebuilds)."""
        self._update_damaged(lambda now: now | {p for p in packs if p and is_pack_name(p)})

    def clear_damaged(self, packs) -> None:
        """Drop ``packs`` from :meth:`damaged_packs`: written again, whole, by a save (a pack is named by the hash
        of its bytes, so a save that writes the same chunks again can publish the very pack it replaces), or
        deleted."""
        drop = set(packs)
        if drop & self.damaged_packs(refresh=True):
            self._update_damaged(lambda now: now - drop)

    @guarded(best_effort=True)
    def _update_damaged(self, change) -> None:
        """Read, change and write the stored set in one write transaction (another process may mark too)."""
        _, _, meta = self._dbs()
        with self.env.begin(write=True, db=meta) as txn:
            now = pack_names(txn.get(DAMAGED_PACKS_KEY))
            new = frozenset(change(now))
            if new != now:
                txn.put(DAMAGED_PACKS_KEY, pack_names_bytes(new))
        self._damaged = new

    @guarded(best_effort=True)
    def set_meta(self, key: bytes, value: bytes) -> None:
        _, _, meta = self._dbs()
        with self.env.begin(write=True, db=meta) as txn:
            txn.put(key, value)

    @guarded()
    def has_seen(self, commit: str | None, created_ns: int | None = None) -> bool:
        """Whether this cache is this store's and indexed ``commit``'s commit itself (None: a store without
        checkpoints, nothing to have seen): then it holds every pack that commit's checkpoint relies on. A
        cache of another store (a cache directory a new store was given again) has seen nothing of this one.
        ``created_ns``, when given, must match too: a checkpoint saved again under that name is another commit."""
        if commit is None:
            return not self._is_foreign()
        seen = self._last_commit()  # (None for another store's cache)
        if seen is None or seen.name != commit:
            return False
        return created_ns is None or seen.created_ns is None or seen.created_ns == created_ns

    @guarded()
    def last_commit(self) -> Commit | None:
        """The commit this cache indexed last (:meth:`has_seen`), or None (none, or a cache of another store)."""
        return self._last_commit()

    def _last_commit(self) -> Commit | None:
        if self._is_foreign():
            return None
        _, _, meta = self._dbs()
        with self.env.begin(db=meta) as txn:
            name, ns = txn.get(LAST_COMMIT_KEY), txn.get(LAST_COMMIT_NS_KEY)
        if name is None:
            return None
        ns = bytes(ns or b"")
        return Commit(bytes(name).decode("utf-8", "replace"), int(ns) if ns.isdigit() else None)

    @staticmethod
    def commit_meta(commit: Commit) -> dict[bytes, bytes]:
        """The meta keys that say this cache indexed ``commit`` (for :meth:`put_summaries`)."""
        ns = b"" if commit.created_ns is None else str(commit.created_ns).encode()
        return {LAST_COMMIT_KEY: commit.name.encode(), LAST_COMMIT_NS_KEY: ns}

    def set_last_commit(self, commit: Commit) -> None:
        self.put_summaries({}, meta=self.commit_meta(commit))

    def sync(self) -> None:
        """Refresh this cache if a gc deleted packs since it last looked (call holding a shared store lock,
        so no gc deletes while the caller relies on it). One small read when nothing changed."""
        epoch = read_gc_epoch(self.backend)
        if epoch != (self.get_meta(b"gc_epoch") or b""):
            self.refresh()
            self.set_meta(b"gc_epoch", epoch)

    def _is_foreign(self) -> bool:
        _, _, meta = self._dbs()
        with self.env.begin(db=meta) as txn:
            sid = txn.get(b"store_id")
            ver = txn.get(b"version")
        return (sid is not None and sid != self.store_id) or (ver is not None and ver != INDEX_VERSION)


_WALK_ABOVE = 1 << 17  # ids past which locating most of the cache walks it (fewer: a look-up each)


def _take_if_better(txn, db, entry: PackEntry, rank: dict[str, int] | None, damaged=frozenset()) -> bool:
    """Point ``entry``'s chunk at ``entry`` when it is the better copy of the indexed one; whether it did.

    A copy outside the ``damaged`` packs beats one inside (a save wrote the chunk again). A keyframe beats a
    delta: writers whose caches missed each other's copy may store a chunk twice, coded
    differently, and a delta built on it was checked against the copy its writer knew, whose chain is never
    shorter than a keyframe's (a delta located instead could make the chain longer than its readers follow;
    gc keeps the located copy). Between copies of one kind, the first pack in ``rank`` (a pack ``rank`` lacks
    comes last); without ``rank``, the copy indexed first stays."""
    indexed = decode_record(entry.chunk_id, txn.get(entry.chunk_id, db=db))
    if (entry.pack in damaged) != (indexed.pack in damaged):
        better = indexed.pack in damaged
    elif (entry.base_id is None) != (indexed.base_id is None):
        better = entry.base_id is None
    else:
        better = rank is not None and rank.get(entry.pack, len(rank)) < rank.get(indexed.pack, len(rank))
    if better:
        txn.put(entry.chunk_id, encode_record(entry), db=db)
    return better

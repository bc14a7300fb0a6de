"""Reconciling the chunk index with the pack tables: verify's check of the cache (``ChunkIndex.reconcile``).

- Unlike a rebuild it keeps the checkpoint summaries and writes only the records that differ (a cache that was
  right is not written at all).
- The cache is read whole, in key order, and compared with the tables' entries as arrays.
- It can leave a :class:`~.records.RecordSnapshot` of the records as written, for verify to locate by.
"""

from __future__ import annotations

import struct

import lmdb
import numpy as np

from . import idset
from .lmdbenv import guarded
from .pack import pack_key
from .progress import Progress, phase
from .records import RECORD_DTYPE, RECORD_SIZE, RecordSnapshot, cache_blocks, is_delta_codec, records_of
from .reindex import read_table


class Reconciling:
    """ChunkIndex's reconcile (a mix-in of :class:`~.index.ChunkIndex`, whose transactions, ``_listed``,
    ``_rebuild`` and ``locate`` it uses)."""

    @guarded()
    def reconcile(self, progress: Progress | None = None, moved: dict[bytes, str] | None = None,
                  snapshot: list | None = None) -> int:
        """Make the cache say what the pack tables say, in one transaction that writes only what differs.

        verify's check of the cache: unlike :meth:`rebuild` it keeps the checkpoint summaries, and a cache
        that was right is not written at all (a rebuild rewrites every record, and LMDB cannot reuse the
        pages it frees at once, so the file grows). A record that matches a copy in some table stays; a
        chunk none of whose copies matches gets the newest copy. Returns the records written or deleted;
        ``moved`` gets the pack each of those chunks was indexed in before (chunk id -> pack name);
        ``snapshot`` a :class:`~.records.RecordSnapshot` of the records of every chunk the tables hold, as
        written (none when the cache was rebuilt instead)."""
        if moved is not None:
            moved.clear()  # filled again from the start when a fault of the cache is repaired and this retried
        if snapshot is not None:
            snapshot.clear()
        if self._is_foreign():
            return self._rebuild(progress=progress)[0]
        with self._repair_lock:
            present = self._listed()
            tables, sizes = [], {}
            with phase(progress, "index check", len(present), "pack") as bar:
                for name in sorted(present, key=lambda n: (-present[n][1], n)):  # newest first
                    table = read_table(self.backend, name, present[name][0])
                    bar.advance(1)
                    if table is not None:
                        sizes[bytes.fromhex(name)] = struct.pack("<Q", present[name][0])
                        tables.append(table)
            ids = np.concatenate([t.chunk_ids for t in tables] + [idset.from_ids(b"")])
            recs = np.concatenate([records_of(t) for t in tables] + [np.empty(0, dtype=RECORD_DTYPE)])
            names = [t.name for t in tables]
            owner = np.repeat(np.arange(len(tables), dtype=np.int32), [len(t) for t in tables])
            del tables
            changed = self._reconcile(ids, recs, sizes, {} if moved is None else moved,
                                      None if snapshot is None else (snapshot, names, owner))
            self._trusted = True
            self._gen += 1 if changed else 0
            return changed

    def _reconcile(self, ids: np.ndarray, recs: np.ndarray, sizes: dict[bytes, bytes], moved: dict,
                   snapshot: tuple | None = None) -> int:
        """reconcile's work on the tables' entries (``ids``, ``recs``: newest pack first); ``snapshot``: (a list
        to append the RecordSnapshot to, the tables' pack names, the number of each entry's pack). The cache
        is read whole, in key order (a cursor's walk: 1.2M records in ~0.4 s, where a look-up of each table
        entry, sorted first, took 0.9 s), and compared with the entries as arrays."""
        chunks, packs_db, _ = self._dbs()
        with self.env.begin(write=True, db=chunks) as txn:
            keys, have, doomed = _cache_arrays(txn)  # 16-byte keys in order, their records
            pos = idset.find(keys, ids)
            inside = pos >= 0
            match = np.zeros(ids.size, dtype=bool)
            rec_bytes, have_bytes = _as_bytes(recs), _as_bytes(have)
            for start in range(0, ids.size, _MATCH_BLOCK):  # a block at a time: no gather of every record
                at = start + np.flatnonzero(inside[start:start + _MATCH_BLOCK])
                match[at] = (have_bytes[pos[at]] == rec_bytes[at]).all(axis=1)
            settled = np.zeros(keys.size, dtype=bool)
            settled[pos[match]] = True
            # The entries to write: of each chunk no copy of which the cache holds, the newest (the first).
            # (an empty cache: no key to look at; every entry is absent)
            stale = np.flatnonzero(inside & ~settled[np.maximum(pos, 0)]) if keys.size else np.flatnonzero(inside)
            stale = stale[np.unique(pos[stale], return_index=True)[1]]
            absent = np.flatnonzero(~inside)
            absent = absent[np.unique(ids[absent], return_index=True)[1]] if absent.size else absent
            changed = 0
            for k in np.concatenate([stale, absent]).tolist():
                key, rec = ids[k].tobytes(), recs[k].tobytes()
                old = txn.get(key)
                if old is not None:
                    moved[key] = bytes(old[:16]).hex()
                txn.put(key, rec)
                changed += 1
            held = np.zeros(keys.size, dtype=bool)  # the keys some table entry holds
            held[pos[inside]] = True
            if snapshot is not None:  # the fields verify locates by, of each record as it now is
                out, names, owner = snapshot
                pack_of = np.full(keys.size, -1, dtype=np.int32)
                pack_of[pos[match]] = owner[match]  # a matching copy's pack is the one its record names
                base, delta = have["base"].copy(), is_delta_codec(have["codec"])
                raw_len = have["raw_len"].astype(np.uint32)
                at = pos[stale]
                base[at], delta[at] = recs["base"][stale], is_delta_codec(recs["codec"][stale])
                raw_len[at] = recs["raw_len"][stale]
                pack_of[at] = owner[stale]
                snap_ids = keys
                if not held.all():
                    snap_ids, base, delta, pack_of = keys[held], base[held], delta[held], pack_of[held]
                    raw_len = raw_len[held]
                if absent.size:  # chunks the cache lacked, now written: merged in, in order
                    snap_ids = np.concatenate([snap_ids, ids[absent]])
                    order = idset.argsort(snap_ids)
                    snap_ids = snap_ids[order]
                    base = np.concatenate([base, recs["base"][absent]])[order]
                    delta = np.concatenate([delta, is_delta_codec(recs["codec"][absent])])[order]
                    pack_of = np.concatenate([pack_of, owner[absent]])[order]
                    raw_len = np.concatenate([raw_len, recs["raw_len"][absent].astype(np.uint32)])[order]
                out.append(RecordSnapshot(snap_ids, base, delta, names, pack_of, self.locate, raw_len))
            del pos, inside, match, settled
            # A record of a chunk in no table read is wrong, unless its pack was published since the listing.
            known = {bytes(k): bytes(v) for k, v in txn.cursor(db=packs_db)}
            alive = set(sizes) | {p for p in known if p not in sizes and self.backend.exists(pack_key(p.hex()))}
            for k in np.flatnonzero(~held).tolist():
                key = keys[k].tobytes()
                pack = bytes(txn.get(key)[:16])
                if pack in sizes or pack not in alive:
                    doomed.append(key)
                    moved[key] = pack.hex()
            for key in doomed:
                txn.delete(key)
            changed += len(doomed)
            for p, value in sizes.items():
                if known.get(p) != value:
                    txn.put(p, value, db=packs_db)
            for p in known.keys() - alive:
                txn.delete(p, db=packs_db)
            verified = self._db[b"verified"]  # verification times of packs gone (a cache that only grew)
            for p in [bytes(p) for p, _ in txn.cursor(db=verified) if bytes(p) not in alive]:
                txn.delete(p, db=verified)
        return changed

_MATCH_BLOCK = 1 << 16  # records compared per pass, and keys and values read from the cache per block


def _as_bytes(recs: np.ndarray) -> np.ndarray:
    """RECORD_DTYPE records as rows of bytes (a view)."""
    return np.ascontiguousarray(recs).view(np.uint8).reshape(-1, RECORD_SIZE)


def _cache_arrays(txn) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """The chunk records of the cache, walked in key order: (the 16-byte keys, sorted V16; the record of each;
    the other keys, none of which is a chunk's). A record of the wrong size raises lmdb.CorruptedError.
    Read a block at a time (:func:`~.records.cache_blocks`)."""
    parts, other = [], []
    for ks, vs, odd in cache_blocks(txn, _MATCH_BLOCK):
        other += odd
        if set(map(len, vs)) - {RECORD_SIZE}:
            # Never written so: the file is damaged, and LMDB has no checksums to say where else (a put next
            # to such a record spoiled its neighbours). The cache is rebuilt (see lmdbenv.guarded).
            bad = next(k for k, v in zip(ks, vs) if len(v) != RECORD_SIZE)
            raise lmdb.CorruptedError(f"index record of chunk {bytes(bad).hex()} has the wrong size")
        parts.append((idset.from_ids(b"".join(ks)), np.frombuffer(b"".join(vs), dtype=RECORD_DTYPE)))
    keys = np.concatenate([k for k, _ in parts] + [idset.from_ids(b"")])
    if not idset.is_sorted_unique(keys):  # a B-tree's walk is in key order, unless a page is damaged
        raise lmdb.CorruptedError("index cache keys out of order")
    recs = np.concatenate([r for _, r in parts] + [np.empty(0, dtype=RECORD_DTYPE)])
    return keys, recs, other

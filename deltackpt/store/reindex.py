"""Filling the chunk index from the pack tables: the refresh and rebuild of :class:`~.index.ChunkIndex`.

- ``refresh``: index the packs a listing shows that the cache has not seen; rebuild when a pack it knows is
  gone or the cache is another store's.
- ``rebuild``: drop the cache and index every pack, newest first (a chunk keeps the first location found).
- ``add_packs``: index the packs a caller names (a catch-up's), from the table rows it gives where they check out.
- indexing packs: a transaction per batch of entries, tables read several at once; an empty cache on object
  storage takes the tables the commit log holds first (:func:`~.commitlog.logged_tables`).
- :func:`read_table`, :func:`read_entries`: a pack's table, or its intact entries when the table is damaged.
"""

from __future__ import annotations

import shutil

from ..errors import ManifestFormatError
from .backend import local_root
from .commitlog import logged_tables
from .lmdbenv import guarded, in_use
from .pack import PackEntry, PackTable, entries_from_rows, list_packs, pack_key, pack_stamps, read_pack_entries, \
    read_pack_table, walk_entries
from .progress import Progress, phase
from .threads import ordered_map, table_read_threads

DAMAGED_PACKS_KEY = b"damaged_packs"  # meta: 16-byte names of packs a read found a damaged chunk in


def pack_names(raw) -> frozenset[str]:
    """The pack names of a DAMAGED_PACKS_KEY value (16 bytes each)."""
    raw = bytes(raw or b"")
    return frozenset(raw[k:k + 16].hex() for k in range(0, len(raw) - 15, 16))


def pack_names_bytes(names) -> bytes:
    """A DAMAGED_PACKS_KEY value: ``names``' 16 bytes each, sorted."""
    return b"".join(bytes.fromhex(p) for p in sorted(names))

_BATCH_ENTRIES = 1 << 16  # entries indexed per LMDB transaction: few commits, bounded memory
LOGGED_TABLES_ABOVE = 64  # pack tables to read past which the commit log's copies are read first (remote)
LOG_READ_THREADS = 4  # commit records read at once (a record holds up to 192 MiB of tables)


class Reindexing:
    """ChunkIndex's refresh and rebuild from the pack tables (a mix-in of :class:`~.index.ChunkIndex`, whose
    transactions, ``_add``, ``_known_packs``, ``_last_commit`` and ``_is_foreign`` it uses)."""

    def _listed(self) -> dict[str, tuple[int, float]]:
        return pack_stamps(list_packs(self.backend))

    @guarded()
    def refresh(self, listed: dict[str, tuple[int, float]] | None = None) -> tuple[int, int]:
        """Bring the cache in line with the packs in the backend (``listed``: a listing the caller just made,
        name -> (size, mtime), instead of a new one). Returns (packs added, packs removed)."""
        # Known before listed: a pack a concurrent commit indexes in between must not look gone (a rebuild).
        number = None
        if listed is None:  # a listing of our own, from now: it covers every pack published before this
            number = self._refreshes_begun = self._refreshes_begun + 1
        # Under the repair lock: a rebuild (another read thread's distrust) drops the tables before it refills
        # them, and a refresh in between would see no pack known, take the commit log's tables, and leave their
        # rows in a cache the rebuild then marks trusted (a lying row is then reported as damage).
        with self._repair_lock:
            known = self._known_packs()
            present = self._listed() if listed is None else listed
            gone = known - present.keys()
            if gone and listed is not None:  # listed before known: a pack indexed since looks gone; list again
                present = self._listed()
                gone = known - present.keys()
            if gone or self._is_foreign():
                out = self._rebuild(present, from_log=True)
            else:
                new = [n for n in present if n not in known]
                if self._index_packs([(n, present[n][0]) for n in new], every=not known):
                    self._trusted = False  # tables from the commit log: a wrong read rebuilds from the packs
                out = len(new), 0
        if number is not None:
            self._refreshed_upto = max(self._refreshed_upto, number)
        return out

    @guarded()
    def rebuild(self, present: dict[str, tuple[int, float]] | None = None,
                progress: Progress | None = None) -> tuple[int, int]:
        """Drop the cache and index every pack again. Returns (packs indexed, packs dropped).

        Packs are indexed newest first and a chunk keeps the first location found, so where a chunk has
        several copies (an interrupted repack) the newest is used and older packs become gc's orphans; but a
        keyframe copy is located over a delta copy wherever it is (``index._take_if_better``).
        ``progress`` hears of each pack table read.
        """
        if self._env is None:
            # Never opened here: delete the files unread (LMDB has no page checksums, and a damaged page
            # pointer can crash the process before any error is raised).
            for path in self._candidates:
                if not in_use(path):  # one this process (or its parent, before a fork) has open is readable
                    shutil.rmtree(path, ignore_errors=True)
        return self._rebuild(present, progress)

    def _rebuild(self, present: dict[str, tuple[int, float]] | None = None,
                 progress: Progress | None = None, from_log: bool = False) -> tuple[int, int]:
        """:meth:`rebuild`'s work; ``from_log``: the tables the commit log holds may stand in for the packs'
        (never when the cache was found wrong: a record that lied would be believed again)."""
        # Under the repair lock, then a new generation: a thread that missed a record meanwhile looks again.
        with self._repair_lock:
            if present is None:
                present = self._listed()
            before = len(self._known_packs())
            chunks, packs_db, meta = self._dbs()
            # A cache refilled from every pack still holds what the commit it recorded indexed (not so another
            # store's): a failed commit's refresh must not make the next save list every pack again.
            last_commit = self._last_commit()
            with self.env.begin(write=True) as txn:
                # Kept: a rebuild must not trust them again (read here: another process may have marked one).
                damaged = pack_names(txn.get(DAMAGED_PACKS_KEY, db=meta)) & present.keys()
                txn.drop(chunks, delete=False)
                txn.drop(packs_db, delete=False)
                txn.drop(meta, delete=False)
                txn.drop(self._db[b"ckpts"], delete=False)
                if damaged:  # in the same transaction: a crash mid-rebuild must not forget them
                    txn.put(DAMAGED_PACKS_KEY, pack_names_bytes(damaged), db=meta)
            with phase(progress, "index rebuild", len(present), "pack") as bar:
                newest_first = sorted(present, key=lambda n: (-present[n][1], n))
                logged = self._index_packs([(n, present[n][0]) for n in newest_first], bar, every=from_log)
            # Record the owner even for an empty store, so a foreign cache is never mistaken for ours.
            self._add([], {})
            if last_commit is not None:  # only once every pack is indexed: an interrupted rebuild claims nothing
                with self.env.begin(write=True, db=meta) as txn:
                    for key, value in self.commit_meta(last_commit).items():
                        txn.put(key, value)
            self._damaged = frozenset(damaged)
            self._trusted = not logged  # tables the commit log gave are not the packs' word: a wrong read rebuilds
            self._gen += 1
            return len(present), max(0, before - len(present))

    @guarded()
    def add_packs(self, packs: dict[str, int], tables: dict[str, bytes] | None = None) -> int:
        """Index those of ``packs`` (name -> size, in the order a chunk's location is taken: first found) this
        cache has not, from the table rows in ``tables`` where given and they check out (else from the packs'
        tables); a pack gone is skipped, as a listing would not show it. Returns how many were new."""
        _, known, _ = self._dbs()
        with self._repair_lock:  # not into a rebuild's dropped tables (see refresh)
            with self.env.begin(db=known) as txn:
                new = [(p, size) for p, size in packs.items() if txn.get(bytes.fromhex(p)) is None]
            if self._index_packs(new, given=tables or {}):
                self._trusted = False  # tables from the commit log: a wrong read rebuilds from the packs
        return len(new)

    def _index_packs(self, packs: list[tuple[str, int]], bar=None, given: dict[str, bytes] | None = None,
                     every: bool = False) -> int:
        """Index ``packs`` ((name, size), in order: a chunk keeps the first location found), one transaction
        per batch of entries (a commit per pack made a refresh of many small packs slow); a pack whose table
        rows ``given`` holds (from the commit log) is not read, when they check out. ``every``: these are all
        the store's packs (an empty cache, a rebuild), so on object storage the commit log's tables are read
        first, record by record as they arrive (the rows, 64 bytes a chunk, are never all held at once). Returns
        how many packs were indexed from ``given`` or the log."""
        # Only a local store's writers delete their packs (ChunkWriter.abort): elsewhere no stat per pack.
        if_present = local_root(self.backend) is not None
        threads = table_read_threads(self.backend)
        given = given or {}
        logged, rank = 0, None
        if every and not if_present and len(packs) - len(given) >= LOGGED_TABLES_ABOVE:
            # Every table to read: those the commit log holds cost a request per commit, not per pack. Indexed
            # out of order, so a chunk's copy is placed by the packs' order (the first found, as elsewhere).
            self._trusted = False  # tables from the commit log: a wrong read rebuilds from the packs
            rank = {name: i for i, (name, _) in enumerate(packs)}
            done = self._index_logged({name: size for name, size in packs if name not in given}, bar, if_present,
                                      rank)
            packs = [pack for pack in packs if pack[0] not in done]
            logged = len(done)

        def entries_of(pack: tuple[str, int]) -> tuple[list[PackEntry] | None, bool]:
            name, size = pack
            if name in given:
                try:
                    return entries_from_rows(given[name], size, name), True
                except ManifestFormatError:
                    pass  # not this pack's table: its own is read
            return read_entries(self.backend, name, size), False

        def found():
            nonlocal logged
            for (name, size), (entries, from_log) in zip(packs, ordered_map(entries_of, packs, threads)):
                logged += from_log
                yield name, size, entries

        self._add_batched(found(), bar, if_present, rank)
        return logged

    def _index_logged(self, todo: dict[str, int], bar, if_present: bool, rank: dict[str, int]) -> set[str]:
        """Index those of ``todo`` (name -> size) whose tables the commit log holds, as the records are read
        (a chunk in several packs located in the first by ``rank``); returns their names (a pack whose logged
        rows do not check out is left to its own table)."""
        done = set()

        def found():
            for name, rows in logged_tables(self.backend, self.store_id.decode(), todo, LOG_READ_THREADS):
                try:
                    entries = entries_from_rows(rows, todo[name], name)
                except ManifestFormatError:
                    continue  # not this pack's table: its own is read
                done.add(name)
                yield name, todo[name], entries

        self._add_batched(found(), bar, if_present, rank)
        return done

    def _add_batched(self, found, bar, if_present: bool, rank: dict[str, int] | None) -> None:
        """Index ``found`` ((pack name, size, its entries or None when it is gone), in order), a transaction per
        _BATCH_ENTRIES entries; ``bar`` advances a pack at a time."""
        entries, sizes = [], {}
        for name, size, pack_entries in found:
            if pack_entries is not None:  # a pack gone since it was listed (or recorded) is not known: never "gone"
                entries += pack_entries
                sizes[name] = size
            if bar is not None:
                bar.advance(1)
            if len(entries) >= _BATCH_ENTRIES:
                self._add(entries, sizes, if_present=if_present, rank=rank)
                entries, sizes = [], {}
        if sizes:
            self._add(entries, sizes, if_present=if_present, rank=rank)


def read_table(backend, name: str, size: int) -> PackTable | None:
    """:func:`read_entries` as arrays."""
    try:
        return read_pack_table(backend, name, size)
    except FileNotFoundError:
        return None
    except ManifestFormatError:
        entries = read_entries(backend, name, size)
        return None if entries is None else PackTable.from_entries(name, entries)


def read_entries(backend, name: str, size: int) -> list[PackEntry] | None:
    """The entries of pack ``name``: its table, or when that is damaged (e.g. a truncated pack) the intact
    entries found from their headers (verify still reports the pack); None when the pack is gone."""
    try:
        return read_pack_entries(backend, name, size)
    except FileNotFoundError:
        return None
    except ManifestFormatError:
        try:
            return walk_entries(backend.get(pack_key(name)), name)
        except FileNotFoundError:
            return None

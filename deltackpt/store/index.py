"""The chunk index: an LMDB cache of what the packs say.

Packs are the truth. The index maps chunk id -> (pack, offset, lengths, codec, element size, base) so that
dedup and reads need no pack scan, and records which packs it has seen. It is a cache: ``refresh`` indexes
packs it has not seen (a crash between pack upload and index update leaves such packs) and rebuilds from
scratch when a pack it knows has disappeared, when the cache is unreadable, or when it belongs to another
store. ``deltackpt index rebuild`` forces a rebuild.

A fault of the cache never makes the store unusable (each kind is logged once, as a warning):

- a cache location this user cannot write (a read-only store, another user's) is passed over for the next
  candidate (the per-user cache directory); when none can be written the index lives in memory;
- any LMDB error, or a malformed record, means the cache is damaged: it is dropped and rebuilt from the
  pack tables, and the operation retried; a reader that finds a well-formed record wrong calls
  :meth:`ChunkIndex.distrust` for the same;
- a cache write that fails for want of space (or I/O) moves the index into memory, rebuilt from the pack
  tables, except for records that are only nice to have (checkpoint summaries, verification times),
  which are skipped.

LMDB allows one open environment per path per process, so environments are shared through a small
process-level registry and never pickled or inherited across ``fork``.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import lmdb
import numpy as np

from .backend import local_root
from ..errors import ManifestFormatError
from .codec import DELTA
from .memenv import MemoryEnv
from .pack import PackEntry, _check_fields, pack_key, pack_name_from_key, read_pack_entries, walk_entries
from .progress import Progress, phase

log = logging.getLogger("deltackpt.store")

_RECORD = struct.Struct("<16sQQQBB16sH")
_NO_BASE = bytes(16)
# _RECORD's layout, to decode many records in one pass (see decode_records)
RECORD_DTYPE = np.dtype([("pack", "V16"), ("offset", "<u8"), ("stored_len", "<u8"), ("raw_len", "<u8"),
                         ("codec", "u1"), ("elem_size", "u1"), ("base", "V16"), ("age", "<u2")])
NO_BASE_VOID = np.void(_NO_BASE)
_MAP_SIZE = 1 << 36  # virtual; the file grows as needed
INDEX_VERSION = b"2"

# LMDB maps its lock file: touching a page of it on a full disk is SIGBUS, not an error Python can catch.
_MIN_FREE_BYTES = 1 << 20
# Written by gc before it deletes packs; a cache that saw another epoch is refreshed before it is trusted.
GC_EPOCH_KEY = "gc-epoch"
_DB_NAMES = (b"chunks", b"packs", b"meta", b"ckpts", b"verified")
_envs: dict[str, tuple] = {}
_envs_lock = threading.Lock()

# Errors that say the cache cannot be written at this place (permissions, space, I/O), not that it is damaged.
_CANNOT_WRITE = (lmdb.ReadonlyError, lmdb.DiskError, lmdb.MapFullError, lmdb.MemoryError, lmdb.LockError,
                 lmdb.ReadersFullError, lmdb.TlsFullError)
_CANNOT_WRITE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO,
                        errno.ENOMEM}


def _cannot_write(exc: BaseException) -> bool:
    return (isinstance(exc, (OSError, *_CANNOT_WRITE))
            or (isinstance(exc, lmdb.Error) and getattr(exc, "code", None) in _CANNOT_WRITE_ERRNOS))


def _open_env(path: Path) -> tuple[lmdb.Environment, dict[bytes, object]]:
    """The process's environment for ``path`` and its named databases, opened once."""
    key = str(path.resolve())
    with _envs_lock:
        hit = _envs.get(key)
        if hit is not None and hit[0] == os.getpid():
            return hit[1], hit[2]
        path.mkdir(parents=True, exist_ok=True)
        free = os.statvfs(path)
        if free.f_bavail * free.f_frsize < _MIN_FREE_BYTES:
            raise OSError(errno.ENOSPC, "too little free space to open an LMDB cache", str(path))
        env = lmdb.open(str(path), map_size=_MAP_SIZE, max_dbs=8, subdir=True, lock=True, readahead=False)
        try:
            _check_not_truncated(env, path)
            dbs = {name: env.open_db(name) for name in _DB_NAMES}
        except lmdb.Error:
            env.close()
            raise
        _envs[key] = (os.getpid(), env, dbs)
        return env, dbs


def _check_not_truncated(env: lmdb.Environment, path: Path) -> None:
    """A data file shorter than the pages its meta page says it has (a copy cut short, a full disk) would
    crash the process with SIGBUS on the first read past its end: refuse it as a damaged cache instead."""
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(path / "data.mdb")
    if size < used:
        raise lmdb.CorruptedError(f"{path / 'data.mdb'} has {size} bytes, its pages need {used}")


def _close_env(path: Path) -> None:
    key = str(path.resolve())
    with _envs_lock:
        hit = _envs.pop(key, None)
    if hit is not None and hit[0] == os.getpid():
        hit[1].close()


def encode_record(e: PackEntry) -> bytes:
    return _RECORD.pack(bytes.fromhex(e.pack), e.offset, e.stored_len, e.raw_len, e.codec, e.elem_size,
                        e.base_id or _NO_BASE, e.age)


def decode_record(chunk_id: bytes, rec: bytes) -> PackEntry:
    if len(rec) != _RECORD.size:
        raise ManifestFormatError(f"index record for chunk {chunk_id.hex()} has {len(rec)} bytes")
    pack, off, slen, rlen, codec, es, base, age = _RECORD.unpack(rec)
    _check_fields(codec, es, rlen, slen, f"index record for chunk {chunk_id.hex()} is malformed")
    if (codec == DELTA) != (base != _NO_BASE):
        raise ManifestFormatError(f"index record for chunk {chunk_id.hex()} is malformed")
    return PackEntry(chunk_id, pack.hex(), off, slen, rlen, codec, es, None if base == _NO_BASE else base, age)


def decode_records(chunk_ids: list[bytes], recs: list[bytes]) -> np.ndarray:
    """The records of ``chunk_ids`` as one RECORD_DTYPE array, held to decode_record's rules: each distinct
    (codec, element size) pair is checked once with the longest lengths, a malformed record is named."""
    try:
        if set(map(len, recs)) - {_RECORD.size}:
            raise ManifestFormatError("an index record has the wrong size")
        arr = np.frombuffer(b"".join(recs), RECORD_DTYPE)
        if len(arr):
            raw, stored = int(arr["raw_len"].max()), int(arr["stored_len"].max())
            for kind in np.unique(arr["codec"].astype(np.uint16) << 8 | arr["elem_size"]).tolist():
                _check_fields(kind >> 8, kind & 0xFF, raw, stored, "index record")
            if ((arr["codec"] == DELTA) != (arr["base"] != NO_BASE_VOID)).any():
                raise ManifestFormatError("a delta without a base or a base without a delta")
    except ManifestFormatError:
        for cid, rec in zip(chunk_ids, recs):
            decode_record(cid, rec)  # raises, naming the first malformed record
        raise
    return arr


def _guarded(best_effort: bool = False):
    """Run an index operation so that a fault of the cache is repaired and the operation retried.

    ``best_effort``: the operation only caches what can be had again (summaries, verification times), so
    when the cache cannot be written it is skipped rather than moving the index into memory.
    """

    def wrap(op):
        @functools.wraps(op)
        def run(self, *args, **kwargs):
            for attempt in range(3):
                gen = self._gen
                try:
                    return op(self, *args, **kwargs)
                except (lmdb.Error, ManifestFormatError) as exc:
                    # A malformed record in a cache this process rebuilt from the packs is not the cache's fault.
                    if attempt == 2 or (isinstance(exc, ManifestFormatError) and self._trusted):
                        raise
                    if best_effort and _cannot_write(exc):
                        self._warn("skip", f"index cache {self.path} cannot be written ({exc}); not caching")
                        return None
                    self._recover(exc, gen)
            raise AssertionError("unreachable")

        return run

    return wrap


class ChunkIndex:
    """Chunk id -> PackEntry, cached in LMDB under the first of ``cache_dir``, ``*fallback_dirs`` that this
    process can write, else in memory."""

    def __init__(self, backend, cache_dir: Path, store_id: str, fallback_dirs=()) -> None:
        self.backend = backend
        self._candidates = [Path(d) / "index.lmdb" for d in (cache_dir, *fallback_dirs)]
        self.path: Path | None = self._candidates[0]  # the LMDB in use; None while the index is in memory
        self.store_id = store_id.encode()
        self._env = None
        self._db: dict[bytes, object] = {}
        self._pid = None
        self._gen = 0  # bumped by every repair: an operation that failed before it just retries
        self._trusted = False  # rebuilt from the packs by this process (or in memory)
        self._repair_lock = threading.RLock()
        self._warned: set[str] = set()

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
    def env(self):
        if self._env is None or (self.path is not None and self._pid != os.getpid()):
            with self._repair_lock:
                if self._env is None or (self.path is not None and self._pid != os.getpid()):
                    self._open()
        return self._env

    def _open(self) -> None:
        """Open the first candidate location this process can write; else keep the index in memory."""
        for path in self._candidates:
            opened = self._open_at(path)
            if opened is not None:
                self._env, self._db = opened
                self.path, self._pid = path, os.getpid()
                return
        self._use_memory(f"no index cache location is writable ({', '.join(map(str, self._candidates))})")

    def _open_at(self, path: Path):
        try:
            return _open_env(path)
        except (lmdb.Error, OSError) as exc:
            if _cannot_write(exc):
                log.debug("index cache %s is not usable (%s); trying the next location", path, exc)
                return None
            # An unreadable cache is rebuilt, never trusted.
            self._warn("damaged", f"index cache {path} is damaged ({exc}); rebuilding it from the pack tables")
            _close_env(path)
            shutil.rmtree(path, ignore_errors=True)
            try:
                return _open_env(path)
            except (lmdb.Error, OSError):
                return None

    def _use_memory(self, why: str) -> None:
        self._warn("memory", f"{why}; keeping the chunk index in memory (rebuilt from the pack tables)")
        self._env = MemoryEnv(_DB_NAMES)
        self._db = self._env.dbs
        self.path = None

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)

    def _recover(self, exc: BaseException, gen: int) -> None:
        """Make the index usable again after ``exc`` (seen by an operation started at generation ``gen``)."""
        with self._repair_lock:
            if gen != self._gen:
                return  # another thread repaired it meanwhile
            self._gen += 1
            path = self.path
            if path is not None:
                hit = _envs.get(str(path.resolve()))
                if hit is not None and hit[0] == os.getpid() and hit[1] is not self._env:
                    self._env, self._db = hit[1], hit[2]  # another index of this process already reopened it
                    return
            if path is not None and not _cannot_write(exc):
                self._warn("damaged", f"index cache {path} is damaged ({exc}); rebuilding it from the pack tables")
                _close_env(path)
                shutil.rmtree(path, ignore_errors=True)
                try:
                    self._env, self._db = _open_env(path)
                    self._pid = os.getpid()
                    self._rebuild()
                    return
                except (lmdb.Error, OSError) as again:
                    exc = again
            if path is not None:
                _close_env(path)
            self._use_memory(f"index cache {path} cannot be written ({exc})")
            self._rebuild()

    def distrust(self, gen: int) -> bool:
        """A caller found a record of the index wrong (its pack is missing, its bytes are not that chunk):
        rebuild the index from the packs unless this process already did. ``gen`` is :attr:`generation`
        when the caller looked the record up. True when the caller should look again."""
        with self._repair_lock:
            if gen != self._gen:
                return True  # rebuilt since the caller looked
            if self._trusted:
                return False  # the index says what the packs say: the damage is real
            self._warn("distrust", f"index cache {self.path} disagrees with the packs; rebuilding it from the "
                                   "pack tables")
            self.rebuild()
            return True

    def _dbs(self):
        self.env
        return self._db[b"chunks"], self._db[b"packs"], self._db[b"meta"]

    # -- verification times (which packs verify checked last, so partial runs rotate) -------------------------
    @_guarded()
    def last_verified(self, pack: str) -> float:
        self.env
        with self.env.begin(db=self._db[b"verified"]) as txn:
            raw = txn.get(bytes.fromhex(pack))
        return struct.unpack("<d", raw)[0] if raw is not None and len(raw) == 8 else 0.0

    @_guarded(best_effort=True)
    def mark_verified(self, pack: str, when: float | None = None) -> None:
        self.env
        with self.env.begin(write=True, db=self._db[b"verified"]) as txn:
            txn.put(bytes.fromhex(pack), struct.pack("<d", time.time() if when is None else when))

    # -- checkpoint summaries (a cache of what ``ls`` needs, keyed by manifest name) ------------------------
    @_guarded()
    def get_summaries(self) -> dict[str, bytes]:
        self.env
        with self.env.begin(db=self._db[b"ckpts"]) as txn:
            return {bytes(k).decode(): bytes(v) for k, v in txn.cursor()}

    @_guarded(best_effort=True)
    def put_summaries(self, summaries: dict[str, bytes], drop=()) -> None:
        self.env
        with self.env.begin(write=True, db=self._db[b"ckpts"]) as txn:
            for name in drop:
                txn.delete(name.encode())
            for name, value in summaries.items():
                txn.put(name.encode(), value)

    # -- reads -------------------------------------------------------------------------------------------
    @_guarded()
    def lookup(self, chunk_id: bytes) -> PackEntry | None:
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            rec = txn.get(chunk_id)
        return None if rec is None else decode_record(chunk_id, rec)

    @_guarded()
    def lookup_many(self, chunk_ids) -> dict[bytes, PackEntry]:
        chunks, _, _ = self._dbs()
        out = {}
        with self.env.begin(db=chunks) as txn:
            for cid in chunk_ids:
                rec = txn.get(cid)
                if rec is not None:
                    out[cid] = decode_record(cid, rec)
        return out

    @_guarded()
    def lookup_records(self, chunk_ids) -> tuple[list[bytes], np.ndarray]:
        """The indexed ones of ``chunk_ids`` and their records (RECORD_DTYPE), decoded in bulk: a save looks
        up every chunk it reuses, so a PackEntry each (1.5 us) was most of a 1 % save."""
        chunks, _, _ = self._dbs()
        chunk_ids = list(chunk_ids)
        with self.env.begin(db=chunks) as txn:
            get = txn.get
            recs = [get(cid) for cid in chunk_ids]
        found = [cid for cid, rec in zip(chunk_ids, recs) if rec is not None]
        recs = [rec for rec in recs if rec is not None]
        return found, decode_records(found, recs)

    @_guarded()
    def check_records(self) -> int:
        """Number of malformed records in the cache (a damaged cache is rebuilt, never trusted)."""
        chunks, _, _ = self._dbs()
        bad = 0
        with self.env.begin(db=chunks) as txn:
            for k, v in txn.cursor():
                try:
                    if len(k) != 16:
                        raise ManifestFormatError("bad key")
                    decode_record(bytes(k), bytes(v))
                except ManifestFormatError:
                    bad += 1
        return bad

    @_guarded()
    def known_packs(self) -> set[str]:
        return self._known_packs()

    def _known_packs(self) -> set[str]:
        _, packs, _ = self._dbs()
        with self.env.begin(db=packs) as txn:
            return {bytes(k).hex() for k, _ in txn.cursor()}

    @_guarded()
    def num_chunks(self) -> int:
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            return txn.stat(chunks)["entries"]

    @_guarded()
    def iter_entries(self):
        """Every indexed entry (read at once, so a repair never leaves a half-consumed iterator)."""
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            return iter([decode_record(bytes(k), bytes(v)) for k, v in txn.cursor()])

    # -- writes ------------------------------------------------------------------------------------------
    @_guarded()
    def add(self, entries, packs: dict[str, int], *, if_present: bool = False) -> None:
        """Record ``entries`` and mark ``packs`` (name -> size) as indexed, in one transaction.

        An id already indexed keeps its first location, so repeated chunks never move. ``if_present``: record
        nothing unless every pack still exists (checked inside the transaction, see delete_unindexed_packs).
        """
        self._add(list(entries), packs, if_present=if_present)

    def _add(self, entries, packs: dict[str, int], if_present: bool = False) -> None:
        chunks, packs_db, meta = self._dbs()
        with self.env.begin(write=True) as txn:
            if if_present and not all(self.backend.exists(pack_key(name)) for name in packs):
                return
            if txn.get(b"store_id", db=meta) != self.store_id:
                txn.put(b"store_id", self.store_id, db=meta)
                txn.put(b"version", INDEX_VERSION, db=meta)
            for e in entries:
                txn.put(e.chunk_id, encode_record(e), db=chunks, overwrite=False)
            for name, size in packs.items():
                txn.put(bytes.fromhex(name), struct.pack("<Q", size), db=packs_db)

    @_guarded()
    def relocate(self, entries, packs: dict[str, int]) -> None:
        """Point ``entries``' chunks at their new location (repack), in one transaction."""
        chunks, packs_db, _ = self._dbs()
        with self.env.begin(write=True) as txn:
            for e in entries:
                txn.put(e.chunk_id, encode_record(e), db=chunks)
            for name, size in packs.items():
                txn.put(bytes.fromhex(name), struct.pack("<Q", size), db=packs_db)

    @_guarded()
    def remove_packs(self, names) -> None:
        """Forget ``names`` and every chunk located in them (used by gc after deleting packs)."""
        names = set(names)
        raw_names = {bytes.fromhex(n) for n in names}
        chunks, packs_db, _ = self._dbs()
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=chunks)
            for k, v in list(cur):
                if bytes(v[:16]) in raw_names:
                    txn.delete(k, db=chunks)
            for rn in raw_names:
                txn.delete(rn, db=packs_db)

    def delete_unindexed_packs(self, names, delete) -> list[str]:
        """Call ``delete(name)`` for each of ``names`` this index has not recorded; returns those names.

        For a failed save's own packs: a pack no index knows cannot have been deduplicated against.
        """
        _, packs_db, _ = self._dbs()
        # A write transaction shuts out every other index writer (refresh, commit) between the check and the
        # delete; a refresh that read a pack's table just before finds the pack gone in its own transaction.
        txn = self.env.begin(write=True)
        try:
            unknown = [n for n in sorted(names) if txn.get(bytes.fromhex(n), db=packs_db) is None]
            for name in unknown:
                delete(name)
            return unknown
        finally:
            txn.abort()  # nothing to write (and on a full disk a commit could fail)

    @_guarded()
    def get_meta(self, key: bytes) -> bytes | None:
        _, _, meta = self._dbs()
        with self.env.begin(db=meta) as txn:
            value = txn.get(key)
        return None if value is None else bytes(value)

    @_guarded(best_effort=True)
    def set_meta(self, key: bytes, value: bytes) -> None:
        _, _, meta = self._dbs()
        with self.env.begin(write=True, db=meta) as txn:
            txn.put(key, value)

    def sync(self) -> None:
        """Refresh this cache if a gc deleted packs since it last looked (call holding a shared store lock,
        so no gc deletes while the caller relies on it). One small read when nothing changed."""
        try:
            epoch = bytes(self.backend.get(GC_EPOCH_KEY))
        except FileNotFoundError:
            epoch = b""
        if epoch != (self.get_meta(b"gc_epoch") or b""):
            self.refresh()
            self.set_meta(b"gc_epoch", epoch)

    def _is_foreign(self) -> bool:
        _, _, meta = self._dbs()
        with self.env.begin(db=meta) as txn:
            sid = txn.get(b"store_id")
            ver = txn.get(b"version")
        return (sid is not None and sid != self.store_id) or (ver is not None and ver != INDEX_VERSION)

    def _listed(self) -> dict[str, tuple[int, float]]:
        out = {}
        for info in self.backend.list("packs/"):
            name = pack_name_from_key(info.key)
            if name is not None:
                out[name] = (info.size_bytes, info.mtime_s)
        return out

    @_guarded()
    def refresh(self) -> tuple[int, int]:
        """Bring the cache in line with the packs in the backend. Returns (packs added, packs removed)."""
        # Known before listed: a pack a concurrent commit indexes in between must not look gone (a rebuild).
        known = self._known_packs()
        present = self._listed()
        gone = known - present.keys()
        if gone or self._is_foreign():
            return self._rebuild(present)
        new = [n for n in present if n not in known]
        for name in new:
            self._index_pack(name, present[name][0])
        return len(new), 0

    @_guarded()
    def rebuild(self, present: dict[str, tuple[int, float]] | None = None,
                progress: Progress | None = None) -> tuple[int, int]:
        """Drop the cache and index every pack again. Returns (packs indexed, packs dropped).

        Packs are indexed newest first and a chunk keeps the first location found, so where a chunk has
        several copies (an interrupted repack) the newest is used and older packs become gc's orphans.
        ``progress`` hears of each pack table read.
        """
        if self._env is None:
            # Never opened here: delete the files unread (LMDB has no page checksums, and a damaged page
            # pointer can crash the process before any error is raised).
            for path in self._candidates:
                hit = _envs.get(str(path.resolve()))
                if hit is None or hit[0] != os.getpid():  # one this process has open is readable
                    shutil.rmtree(path, ignore_errors=True)
        return self._rebuild(present, progress)

    def _rebuild(self, present: dict[str, tuple[int, float]] | None = None,
                 progress: Progress | None = None) -> tuple[int, int]:
        # Under the repair lock, then a new generation: a thread that missed a record meanwhile looks again.
        with self._repair_lock:
            if present is None:
                present = self._listed()
            before = len(self._known_packs())
            chunks, packs_db, meta = self._dbs()
            with self.env.begin(write=True) as txn:
                txn.drop(chunks, delete=False)
                txn.drop(packs_db, delete=False)
                txn.drop(meta, delete=False)
                txn.drop(self._db[b"ckpts"], delete=False)
            with phase(progress, "index rebuild", len(present), "pack") as bar:
                for name in sorted(present, key=lambda n: (-present[n][1], n)):
                    self._index_pack(name, present[name][0])
                    bar.advance(1)
            # Record the owner even for an empty store, so a foreign cache is never mistaken for ours.
            self._add([], {})
            self._trusted = True
            self._gen += 1
            return len(present), max(0, before - len(present))

    def _index_pack(self, name: str, size: int) -> None:
        try:
            entries = read_pack_entries(self.backend, name, size)
        except FileNotFoundError:
            entries = []
        except ManifestFormatError:
            # Damaged table (e.g. a truncated pack): recover the intact entries from their headers.
            # verify still reports the pack; its intact chunks stay readable meanwhile.
            try:
                entries = walk_entries(self.backend.get(pack_key(name)), name)
            except FileNotFoundError:
                entries = []
        # Only a local store's writers delete their packs (ChunkWriter.abort): elsewhere no stat per pack.
        self._add(entries, {name: size}, if_present=local_root(self.backend) is not None)

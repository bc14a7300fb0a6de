"""The chunk index: an LMDB cache of what the packs say.

Packs are the truth. The index maps chunk id -> (pack, offset, lengths, codec, element size, base) so that
dedup and reads need no pack scan, and records which packs it has seen. It is a cache: ``refresh`` indexes
packs it has not seen (a crash between pack upload and index update leaves such packs) and rebuilds from
scratch when a pack it knows has disappeared, when the cache is unreadable, or when it belongs to another
store. ``deltackpt index rebuild`` forces a rebuild.

LMDB allows one open environment per path per process, so environments are shared through a small
process-level registry and never pickled or inherited across ``fork``.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
import time
from pathlib import Path

import lmdb

from ..errors import ManifestFormatError
from .codec import CODEC_NAMES, DELTA, VALID_ELEM_SIZES
from .pack import PackEntry, pack_key, pack_name_from_key, read_pack_entries, walk_entries

_RECORD = struct.Struct("<16sQQQBB16sH")
_NO_BASE = bytes(16)
_MAP_SIZE = 1 << 36  # virtual; the file grows as needed
INDEX_VERSION = b"2"

_DB_NAMES = (b"chunks", b"packs", b"meta", b"ckpts", b"verified")
_envs: dict[str, tuple] = {}
_envs_lock = threading.Lock()


def _open_env(path: Path) -> tuple[lmdb.Environment, dict[bytes, object]]:
    """The process's environment for ``path`` and its named databases, opened once."""
    key = str(path.resolve())
    with _envs_lock:
        hit = _envs.get(key)
        if hit is not None and hit[0] == os.getpid():
            return hit[1], hit[2]
        path.mkdir(parents=True, exist_ok=True)
        env = lmdb.open(str(path), map_size=_MAP_SIZE, max_dbs=8, subdir=True, lock=True, readahead=False)
        try:
            dbs = {name: env.open_db(name) for name in _DB_NAMES}
        except lmdb.Error:
            env.close()
            raise
        _envs[key] = (os.getpid(), env, dbs)
        return env, dbs


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
    if codec not in CODEC_NAMES or es not in VALID_ELEM_SIZES or (codec == DELTA) != (base != _NO_BASE):
        raise ManifestFormatError(f"index record for chunk {chunk_id.hex()} is malformed")
    return PackEntry(chunk_id, pack.hex(), off, slen, rlen, codec, es, None if base == _NO_BASE else base, age)


class ChunkIndex:
    """Chunk id -> PackEntry, cached in LMDB under ``cache_dir``."""

    def __init__(self, backend, cache_dir: Path, store_id: str) -> None:
        self.backend = backend
        self.path = Path(cache_dir) / "index.lmdb"
        self.store_id = store_id.encode()
        self._env: lmdb.Environment | None = None
        self._db: dict[bytes, object] = {}
        self._pid = None

    def __getstate__(self):
        raise TypeError("ChunkIndex holds an LMDB environment and is not picklable; reopen the store")

    @property
    def env(self) -> lmdb.Environment:
        if self._env is None or self._pid != os.getpid():
            try:
                self._env, self._db = _open_env(self.path)
            except lmdb.Error:
                # An unreadable cache is rebuilt, never trusted.
                _close_env(self.path)
                shutil.rmtree(self.path, ignore_errors=True)
                self._env, self._db = _open_env(self.path)
            self._pid = os.getpid()
        return self._env

    def _dbs(self):
        self.env
        return self._db[b"chunks"], self._db[b"packs"], self._db[b"meta"]

    # -- verification times (which packs verify checked last, so partial runs rotate) -------------------------
    def last_verified(self, pack: str) -> float:
        self.env
        with self.env.begin(db=self._db[b"verified"]) as txn:
            raw = txn.get(bytes.fromhex(pack))
        return struct.unpack("<d", raw)[0] if raw is not None and len(raw) == 8 else 0.0

    def mark_verified(self, pack: str, when: float | None = None) -> None:
        self.env
        with self.env.begin(write=True, db=self._db[b"verified"]) as txn:
            txn.put(bytes.fromhex(pack), struct.pack("<d", time.time() if when is None else when))

    # -- checkpoint summaries (a cache of what ``ls`` needs, keyed by manifest name) ------------------------
    def get_summaries(self) -> dict[str, bytes]:
        self.env
        with self.env.begin(db=self._db[b"ckpts"]) as txn:
            return {bytes(k).decode(): bytes(v) for k, v in txn.cursor()}

    def put_summaries(self, summaries: dict[str, bytes], drop=()) -> None:
        self.env
        with self.env.begin(write=True, db=self._db[b"ckpts"]) as txn:
            for name in drop:
                txn.delete(name.encode())
            for name, value in summaries.items():
                txn.put(name.encode(), value)

    # -- reads -------------------------------------------------------------------------------------------
    def lookup(self, chunk_id: bytes) -> PackEntry | None:
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            rec = txn.get(chunk_id)
        return None if rec is None else decode_record(chunk_id, rec)

    def lookup_many(self, chunk_ids) -> dict[bytes, PackEntry]:
        chunks, _, _ = self._dbs()
        out = {}
        with self.env.begin(db=chunks) as txn:
            for cid in chunk_ids:
                rec = txn.get(cid)
                if rec is not None:
                    out[cid] = decode_record(cid, rec)
        return out

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

    def known_packs(self) -> set[str]:
        _, packs, _ = self._dbs()
        with self.env.begin(db=packs) as txn:
            return {k.hex() for k in txn.cursor().iternext(keys=True, values=False)}

    def num_chunks(self) -> int:
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            return txn.stat(chunks)["entries"]

    def iter_entries(self):
        chunks, _, _ = self._dbs()
        with self.env.begin(db=chunks) as txn:
            for k, v in txn.cursor():
                yield decode_record(bytes(k), bytes(v))

    # -- writes ------------------------------------------------------------------------------------------
    def add(self, entries, packs: dict[str, int]) -> None:
        """Record ``entries`` and mark ``packs`` (name -> size) as indexed, in one transaction.

        An id already indexed keeps its first location, so repeated chunks never move.
        """
        chunks, packs_db, meta = self._dbs()
        with self.env.begin(write=True) as txn:
            if txn.get(b"store_id", db=meta) != self.store_id:
                txn.put(b"store_id", self.store_id, db=meta)
                txn.put(b"version", INDEX_VERSION, db=meta)
            for e in entries:
                txn.put(e.chunk_id, encode_record(e), db=chunks, overwrite=False)
            for name, size in packs.items():
                txn.put(bytes.fromhex(name), struct.pack("<Q", size), db=packs_db)

    def relocate(self, entries, packs: dict[str, int]) -> None:
        """Point ``entries``' chunks at their new location (repack), in one transaction."""
        chunks, packs_db, _ = self._dbs()
        with self.env.begin(write=True) as txn:
            for e in entries:
                txn.put(e.chunk_id, encode_record(e), db=chunks)
            for name, size in packs.items():
                txn.put(bytes.fromhex(name), struct.pack("<Q", size), db=packs_db)

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

    def refresh(self) -> tuple[int, int]:
        """Bring the cache in line with the packs in the backend. Returns (packs added, packs removed)."""
        # Known before listed: a pack a concurrent commit indexes in between must not look gone (a rebuild).
        known = self.known_packs()
        present = self._listed()
        gone = known - present.keys()
        if gone or self._is_foreign():
            return self.rebuild(present)
        new = [n for n in present if n not in known]
        for name in new:
            self._index_pack(name, present[name][0])
        return len(new), 0

    def rebuild(self, present: dict[str, tuple[int, float]] | None = None) -> tuple[int, int]:
        """Drop the cache and index every pack again. Returns (packs indexed, packs dropped).

        Packs are indexed newest first and a chunk keeps the first location found, so where a chunk has
        several copies (an interrupted repack) the newest is used and older packs become gc's orphans.
        """
        if present is None:
            present = self._listed()
        before = len(self.known_packs()) if self.path.exists() else 0
        chunks, packs_db, meta = self._dbs()
        with self.env.begin(write=True) as txn:
            txn.drop(chunks, delete=False)
            txn.drop(packs_db, delete=False)
            txn.drop(meta, delete=False)
            txn.drop(self._db[b"ckpts"], delete=False)
        for name in sorted(present, key=lambda n: (-present[n][1], n)):
            self._index_pack(name, present[name][0])
        # Record the owner even for an empty store, so a foreign cache is never mistaken for ours.
        self.add([], {})
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
        self.add(entries, {name: size})

"""The Store: opening a store, committing checkpoints, finding and reading them.

Commit protocol (why it is crash-safe): a save first writes packs, each an immutable object published by an
atomic put; then the committing process records the new chunks in the index cache; then it checks that
every chunk the manifest references is indexed; only then it puts the manifest, the single commit point.
A crash before the manifest put leaves orphan packs (found and removed by ``gc``) and never a half
checkpoint; a crash after it leaves a complete checkpoint. The index cache is refreshed from the packs when
it is missing or stale, so a crash between pack upload and index update loses nothing.
"""

from __future__ import annotations

import difflib
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import msgspec
import numpy as np

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidNameError,
    ManifestFormatError,
    MissingChunkError,
    StoreExistsError,
    StoreNotFoundError,
)
from .backend import Backend, LocalBackend
from .config import CONFIG_KEY, StoreConfig, decode_config, encode_config, new_config
from .index import ChunkIndex
from .manifest import LATEST, Item, Manifest, Stats, decode_manifest, encode_manifest, manifest_key, validate_name
from .faults import crash_point
from .lock import DEFAULT_WAIT_S, SHARED, StoreLock
from .pack import PackEntry, pack_key, read_pack_entries
from .reader import CheckpointReader
from .writer import ChunkWriter, WriteSummary


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

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else float("inf")


@dataclass(frozen=True)
class StoreUsage:
    num_checkpoints: int
    logical_bytes: int  # sum over checkpoints of their items' bytes
    physical_bytes: int  # packs + manifests + config as stored
    pack_bytes: int
    manifest_bytes: int
    num_packs: int
    num_chunks: int

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.physical_bytes if self.physical_bytes else 0.0


def _as_backend(location) -> Backend:
    if isinstance(location, Backend):
        return location
    if isinstance(location, (str, os.PathLike)):
        return LocalBackend(location)
    raise TypeError(f"store location must be a path or a Backend, got {type(location).__name__}")


def _default_cache_dir(backend: Backend, store_id: str) -> Path:
    env = os.environ.get("DELTACKPT_CACHE_DIR")
    if env:
        return Path(env) / store_id
    local = backend.local_path()
    if local is not None:
        return local / "cache"
    return Path(tempfile.gettempdir()) / "deltackpt-cache" / store_id


class Store:
    """A deltackpt store. Create with :meth:`init`, open with :meth:`open`."""

    def __init__(self, backend: Backend, config: StoreConfig, cache_dir: Path | None = None) -> None:
        self.backend = backend
        self.config = config
        self.cache_dir = Path(cache_dir) if cache_dir else _default_cache_dir(backend, config.store_id)
        self._index: ChunkIndex | None = None
        self._index_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({self.backend!r}, store_id={self.config.store_id[:8]})"

    def __getstate__(self):
        # The LMDB environment is per process; it is reopened lazily after unpickling.
        state = self.__dict__.copy()
        state["_index"] = None
        del state["_index_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._index_lock = threading.Lock()

    # -- opening -----------------------------------------------------------------------------------------
    @classmethod
    def init(cls, location, *, cache_dir=None, exist_ok: bool = False, **config) -> "Store":
        """Create a store at ``location`` (a directory path or a Backend). ``config`` overrides defaults."""
        backend = _as_backend(location)
        if backend.exists(CONFIG_KEY):
            if exist_ok:
                return cls.open(backend, cache_dir=cache_dir)
            raise StoreExistsError(f"{_describe(backend)} already holds a deltackpt store")
        local = backend.local_path()
        if local is not None and local.exists() and any(p.name != "cache" for p in local.iterdir()):
            raise StoreExistsError(f"{local} is not empty; a new store needs an empty or missing directory")
        cfg = new_config(**config)
        try:
            backend.put_new(CONFIG_KEY, encode_config(cfg))  # two racing inits: exactly one wins
        except FileExistsError:
            if exist_ok:
                return cls.open(backend, cache_dir=cache_dir)
            raise StoreExistsError(f"{_describe(backend)} already holds a deltackpt store") from None
        return cls(backend, cfg, cache_dir)

    @classmethod
    def open(cls, location, *, cache_dir=None) -> "Store":
        """Open an existing store; ``StoreNotFoundError`` if there is none at ``location``."""
        backend = _as_backend(location)
        try:
            data = backend.get(CONFIG_KEY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise StoreNotFoundError(
                f"{_describe(backend)} is not a deltackpt store (no config); create one with `deltackpt init`"
            ) from None
        return cls(backend, decode_config(data), cache_dir)

    @classmethod
    def open_or_init(cls, location, *, cache_dir=None, **config) -> "Store":
        """Open the store at ``location``, creating it if there is none (safe when many ranks race)."""
        backend = _as_backend(location)
        for attempt in range(50):
            if backend.exists(CONFIG_KEY):
                return cls.open(backend, cache_dir=cache_dir)
            try:
                return cls.init(backend, cache_dir=cache_dir, exist_ok=True, **config)
            except StoreExistsError:
                # Another process is creating it (its temp file is there, its config not yet): wait.
                if attempt == 49:
                    raise
                time.sleep(0.1)
        raise AssertionError("unreachable")

    # -- index ---------------------------------------------------------------------------------------------
    @property
    def index(self) -> ChunkIndex:
        if self._index is None:
            with self._index_lock:
                if self._index is None:
                    index = ChunkIndex(self.backend, self.cache_dir, self.config.store_id)
                    index.refresh()
                    self._index = index
        return self._index

    def refresh_index(self) -> tuple[int, int]:
        return self.index.refresh()

    def rebuild_index(self) -> tuple[int, int]:
        """Drop the index cache and re-read every pack table. Returns (packs indexed, packs dropped)."""
        if self._index is None:
            self._index = ChunkIndex(self.backend, self.cache_dir, self.config.store_id)
        return self._index.rebuild()

    # -- checkpoints -----------------------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        names = []
        for info in self.backend.list("manifests/"):
            name = info.key[len("manifests/"):]
            if "/" not in name:
                names.append(name)
        return names

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        listed = {info.key[len("manifests/"):]: info.size_bytes for info in self.backend.list("manifests/")}
        cached = self.index.get_summaries()
        out, fresh = [], {}
        for name, size in listed.items():
            info = None
            raw = cached.get(name)
            if raw is not None:
                try:
                    info = msgspec.msgpack.decode(raw, type=CheckpointInfo)
                except (msgspec.ValidationError, msgspec.DecodeError):
                    info = None
                if info is not None and info.manifest_bytes != size:
                    info = None
            if info is None:
                try:
                    m = self.read_manifest(name)
                except (ManifestFormatError, CheckpointNotFoundError, InvalidNameError):
                    continue  # stray or unreadable manifests are verify's business, not ls's
                info = _summarize(m, size)
                fresh[name] = msgspec.msgpack.encode(info)
            out.append(info)
        stale = [n for n in cached if n not in listed]
        if fresh or stale:
            self.index.put_summaries(fresh, drop=stale)
        out.sort(key=lambda i: (i.created_ns, i.name))
        return out

    def resolve(self, name: str) -> str:
        """The concrete checkpoint name for ``name`` (``latest`` = newest); CheckpointNotFoundError if none."""
        if name == LATEST:
            infos = self.list_checkpoints()
            if not infos:
                raise CheckpointNotFoundError(LATEST)
            return infos[-1].name
        validate_name(name)
        if not self.backend.exists(manifest_key(name)):
            names = self.checkpoint_names()
            nearby = difflib.get_close_matches(name, names, n=5, cutoff=0.5) or sorted(names)[-5:]
            raise CheckpointNotFoundError(name, nearby)
        return name

    def read_manifest(self, name: str) -> Manifest:
        name = self.resolve(name) if name == LATEST else validate_name(name)
        try:
            data = self.backend.get(manifest_key(name))
        except FileNotFoundError:
            self.resolve(name)  # raises CheckpointNotFoundError with nearby names
            raise CheckpointNotFoundError(name) from None
        m = decode_manifest(data, f"manifest {name!r}")
        if m.name != name:
            raise ManifestFormatError(f"manifest {name!r} says its name is {m.name!r}")
        return m

    def latest_manifest(self) -> Manifest | None:
        """The newest checkpoint's manifest, or None in an empty store."""
        infos = self.list_checkpoints()
        return self.read_manifest(infos[-1].name) if infos else None

    def exists(self, name: str) -> bool:
        return self.backend.exists(manifest_key(name))

    # -- writing -------------------------------------------------------------------------------------------
    def writer(self, **kwargs) -> ChunkWriter:
        return ChunkWriter(self, **kwargs)

    def commit(
        self,
        name: str,
        items: list[Item],
        *,
        entries: Iterable[PackEntry] | None = None,
        packs: Mapping[str, int] | None = None,
        metadata: Mapping[str, Any] | None = None,
        layer_data: Mapping[str, Any] | None = None,
        parent: str | None = None,
        overwrite: bool = False,
        lock: StoreLock | None = None,
    ) -> Manifest:
        """Publish a checkpoint whose chunks are already in packs; the manifest put is the commit point.

        ``packs`` (name -> size) are the packs this save wrote; their entries are indexed first (read from
        the packs' tables unless ``entries`` already lists them). Every referenced chunk must be indexed,
        else MissingChunkError and nothing is committed.
        """
        validate_name(name)
        if not overwrite and self.exists(name):
            raise CheckpointExistsError(f"checkpoint {name!r} already exists; pass overwrite=True to replace it")
        keys = [it.key for it in items]
        if len(set(keys)) != len(keys):
            raise ValueError("item keys must be unique within a checkpoint")
        packs = dict(packs or {})
        if entries is None:
            entries = [e for p, size in packs.items() for e in read_pack_entries(self.backend, p, size)]
        entries = list(entries)
        crash_point("commit:before-index")
        self.index.add(entries, packs)
        self._index_rewritten_chunks(entries)
        crash_point("commit:after-index")
        wanted = {ref.id for it in items for ref in it.chunks}
        missing = self._missing_chunks(wanted)
        if missing:
            # Another process may be rebuilding the index cache (it drops it first): re-index, look again.
            self.index.refresh()
            self.index.add(entries, packs)
            missing = self._missing_chunks(wanted)
        if missing:
            cid = next(iter(missing))
            owner = next((it.key for it in items if any(r.id == cid for r in it.chunks)), None)
            raise MissingChunkError(cid.hex(), checkpoint=name, item=owner)
        if parent is None:
            latest = self.list_checkpoints()
            parent = latest[-1].name if latest else None
        stats = Stats(
            logical_bytes=sum(it.nbytes for it in items),
            stored_bytes=sum(packs.values()),
            num_chunks=sum(len(it.chunks) for it in items),
            new_chunks=len(entries),
        )
        manifest = Manifest(
            name=name,
            store_id=self.config.store_id,
            created_ns=time.time_ns(),
            parent=parent if parent != name else None,
            items=items,
            stats=stats,
            metadata=dict(metadata or {}),
            layer_data=dict(layer_data or {}),
        )
        data = encode_manifest(manifest)
        if lock is not None:
            lock.check()  # a writer whose lock went stale must not commit: gc may have run
        crash_point("commit:before-manifest")
        self.backend.put(manifest_key(name), data)
        crash_point("commit:after-manifest")
        self.index.put_summaries({name: msgspec.msgpack.encode(_summarize(manifest, len(data)))})
        return manifest

    def _missing_chunks(self, wanted: set[bytes]) -> set[bytes]:
        """Which of ``wanted`` or their delta bases are not indexed in an existing pack."""
        found = self.index.lookup_many(wanted)
        # Delta bases must survive too; and every pack we point into must still exist (gc elsewhere).
        bases = {e.base_id for e in found.values() if e.base_id is not None} - found.keys()
        found.update(self.index.lookup_many(bases))
        missing = (wanted | bases) - found.keys()
        if not missing:
            # Only the packs this checkpoint points into (a stat each): listing every pack of a long run's
            # store took 53 ms at 10,000 packs, on the coordinator's commit of every save.
            gone = {p for p in {e.pack for e in found.values()} if not self.backend.exists(pack_key(p))}
            missing = {cid for cid, e in found.items() if e.pack in gone}
        return missing

    def _index_rewritten_chunks(self, entries: list[PackEntry]) -> None:
        """Point the index at this save's copy of a chunk whose indexed copy cannot be restored: the writer
        wrote it again because it was a delta whose base is gone."""
        indexed = self.index.lookup_many({e.chunk_id for e in entries})
        bases = self.index.lookup_many({e.base_id for e in indexed.values() if e.base_id is not None})
        own = [e for e in entries if (old := indexed.get(e.chunk_id)) is not None and old != e
               and old.base_id is not None and old.base_id not in bases]
        if own:
            self.index.relocate(own, {})

    def save(self, name: str, items: Mapping[str, Any], *, metadata=None, overwrite: bool = False,
             lock_wait_s: float = DEFAULT_WAIT_S, **writer_kwargs) -> Manifest:
        """Save a dict of numpy arrays / bytes as checkpoint ``name`` in one call (single process).

        A running gc's delete phase is waited for (up to ``lock_wait_s``, logged), never a reason to fail."""
        validate_name(name)
        if not overwrite and self.exists(name):
            raise CheckpointExistsError(f"checkpoint {name!r} already exists; pass overwrite=True to replace it")
        # Held from before the first dedup decision until the manifest is written: gc spares our claims.
        with self.lock(SHARED, wait_s=lock_wait_s) as lock:
            return self._save_locked(name, items, metadata, overwrite, lock, writer_kwargs)

    def _save_locked(self, name, items, metadata, overwrite, lock, writer_kwargs) -> Manifest:
        parent = self.latest_manifest()
        w = self.writer(parent=parent, **writer_kwargs)
        try:
            for key, value in items.items():
                if isinstance(value, np.generic):
                    value = np.asarray(value)
                if isinstance(value, np.ndarray):
                    arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)
                    w.add_array(key, arr, dtype=arr.dtype.str, elem_size=_elem_size(arr), shape=value.shape)
                elif isinstance(value, (bytes, bytearray, memoryview)):
                    w.add_bytes(key, value)
                else:
                    raise TypeError(f"item {key!r}: expected a numpy array or bytes, got {type(value).__name__}")
        except BaseException:
            w.abort()
            raise
        summary: WriteSummary = w.finish()
        crash_point("save:after-packs")
        return self.commit(name, summary.items, entries=summary.entries, packs=summary.packs,
                           metadata=metadata, overwrite=overwrite, lock=lock)

    def lock(self, kind: str = SHARED, **kwargs) -> StoreLock:
        """A store lock to use as a context manager: SHARED for saves, EXCLUSIVE for gc."""
        return StoreLock(self.backend, kind, **kwargs)

    def forget(self, names) -> list[str]:
        """Remove checkpoints (their manifests only; ``gc`` reclaims the chunks). Returns the names removed."""
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            validate_name(name)
        removed = []
        for name in names:
            if self.exists(name):
                crash_point("forget:before-delete")
                self.backend.delete(manifest_key(name))
                removed.append(name)
        self.index.put_summaries({}, drop=removed)
        return removed

    # -- reading -------------------------------------------------------------------------------------------
    def open_checkpoint(self, name: str = LATEST, **kwargs) -> CheckpointReader:
        return CheckpointReader(self, self.read_manifest(self.resolve(name)), **kwargs)

    def load(self, name: str = LATEST) -> dict[str, Any]:
        """Every item of a checkpoint: arrays with their dtype and shape, byte items as bytes."""
        out = {}
        with self.open_checkpoint(name) as r:
            for key, item in r.items.items():
                buf = r.read(key)
                if item.kind == "bytes":
                    out[key] = buf.tobytes()
                else:
                    try:
                        out[key] = buf.view(np.dtype(item.dtype)).reshape(item.shape)
                    except TypeError:
                        out[key] = buf  # a dtype numpy does not know (e.g. bfloat16): raw bytes
        return out

    # -- accounting ------------------------------------------------------------------------------------------
    def usage(self) -> StoreUsage:
        infos = self.list_checkpoints()
        packs = [i for i in self.backend.list("packs/")]
        manifests = [i for i in self.backend.list("manifests/")]
        pack_bytes = sum(i.size_bytes for i in packs)
        manifest_bytes = sum(i.size_bytes for i in manifests)
        config_bytes = self.backend.size(CONFIG_KEY)
        return StoreUsage(
            num_checkpoints=len(infos),
            logical_bytes=sum(i.logical_bytes for i in infos),
            physical_bytes=pack_bytes + manifest_bytes + config_bytes,
            pack_bytes=pack_bytes,
            manifest_bytes=manifest_bytes,
            num_packs=len(packs),
            num_chunks=self.index.num_chunks(),
        )


def _elem_size(arr: np.ndarray) -> int:
    size = arr.dtype.itemsize
    return size if size in (1, 2, 4, 8) else 1


def _summarize(m: Manifest, manifest_bytes: int) -> CheckpointInfo:
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
    )


def _describe(backend: Backend) -> str:
    local = backend.local_path()
    return str(local) if local is not None else repr(backend)

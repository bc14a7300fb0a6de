"""The Store: opening a store, keeping its index current, committing, saving, forgetting and loading checkpoints.

Its parts elsewhere: the config at a location (:mod:`.location`), listing, resolving and reading checkpoints
(:mod:`.catalog`), catching the index up to a commit (:mod:`.catchup`), the commit's record (:mod:`.commitlog`).

Commit protocol (why it is crash-safe): a save first writes packs, each an immutable object published by an
atomic put; then the committing process records the new chunks in the index cache; then it checks that
every chunk the manifest references is indexed in a pack that exists (:mod:`.commit`); only then it puts the
manifest, the single commit point.
A crash before the manifest put leaves orphan packs (found and removed by ``gc``) and never a half
checkpoint; a crash after it leaves a complete checkpoint. The index cache is refreshed from the packs when
it is missing or stale, so a crash between pack upload and index update loses nothing.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import msgspec
import numpy as np

from .. import settings
from ..errors import CheckpointExistsError, CorruptManifestError, ManifestFormatError, StoreNotFoundError
from .backend import Backend
from .basecache import BaseCache
from .cachedir import default_cache_dir, user_cache_dirs
from .catalog import Catalog
from .catchup import catch_up
from .commit import build_manifest, check_chunks, index_new_packs
from .location import create_store_config, describe, open_backend, read_store_config
from .config import CONFIG_KEY, StoreConfig, decode_config, encode_config, writer_features
from .commitlog import Commit, record_commit
from .index import GC_EPOCH_KEY, ChunkIndex
from .manifest import LATEST, Item, Manifest, encode_manifest, manifest_key, validate_name
from .crashpoints import crash_point
from .lock import DEFAULT_WAIT_S, SHARED, StoreLock
from .pack import PackEntry
from .pausegc import paused_gc
from .progress import Progress
from .reader import CheckpointReader
from .summary import CheckpointInfo, StoreUsage, summarize_manifest
from .writer import ChunkWriter, WriteSummary

_RECEIVED_CACHES: dict[str, BaseCache] = {}  # store id -> the cache of Stores unpickled in this process
_RECEIVED_LOCK = threading.Lock()


class Store(Catalog):
    """A deltackpt store. Create with :meth:`init`, open with :meth:`open`."""

    def __init__(self, backend: Backend, config: StoreConfig, cache_dir: Path | None = None) -> None:
        self.backend = backend
        self.config = config
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir(backend, config.store_id)
        # A chosen cache directory is used or else the index is kept in memory; the default one falls back.
        self._fallback_cache_dirs = [] if cache_dir or settings.cache_dir() else \
            user_cache_dirs(config.store_id)
        self._index: ChunkIndex | None = None
        self._index_current = False  # refreshed, or brought up to a commit by index_as_of, in this process
        self._index_lock = threading.Lock()
        self.base_cache = BaseCache.from_settings()  # keyframes this object's saves keep for its next save
        # (name, created_ns, manifest size, mtime, packs) of this object's last commit: the packs that held
        # all its chunks, for its next save when that checkpoint is still the newest (ChunkWriter parent_packs).
        self._last_commit: tuple[str, int, int, float, str, frozenset[str]] | None = None

    def __repr__(self) -> str:
        return f"Store({self.backend!r}, store_id={self.config.store_id[:8]})"

    def __getstate__(self):
        # The LMDB environment is per process; it is reopened lazily after unpickling.
        state = self.__dict__.copy()
        state["_index"] = None
        state["_index_current"] = False
        del state["_index_lock"]
        cache = state.pop("base_cache")  # per process, like the index; its cap travels
        state["_base_cache_cap"] = (cache.cap_bytes, cache.fixed)
        return state

    def __setstate__(self, state):
        cap, fixed = state.pop("_base_cache_cap")
        self.__dict__.update(state)
        self._index_lock = threading.Lock()
        # A Store sent to a worker process once per save (DCP's process-based async save) shares that
        # process's cache for the store, so the worker's next save still finds its bases in memory.
        with _RECEIVED_LOCK:
            self.base_cache = _RECEIVED_CACHES.setdefault(self.config.store_id, BaseCache.from_settings())
        self.base_cache.limit(cap) if fixed else self.base_cache.reserve(cap)

    # -- opening -----------------------------------------------------------------------------------------
    @classmethod
    def init(cls, location, *, cache_dir=None, exist_ok: bool = False, storage_options: dict | None = None,
             **config) -> "Store":
        """Create a store at ``location`` (a directory, a URL such as ``s3://bucket/prefix``, or a Backend).

        ``storage_options`` go to the fsspec filesystem of a URL; ``config`` overrides the store's defaults.
        A directory may hold other files: the store only uses its own ``config``, ``packs/``, ``manifests/``,
        ``locks/``, ``tags/``, ``commits/`` and ``cache/``. Packs or manifests without a config (a damaged
        store) are refused.
        """
        backend = open_backend(location, storage_options)
        cfg = create_store_config(backend, exist_ok, config)
        return cls.open(backend, cache_dir=cache_dir) if cfg is None else cls(backend, cfg, cache_dir)

    @classmethod
    def open(cls, location, *, cache_dir=None, storage_options: dict | None = None) -> "Store":
        """Open an existing store (a directory, a URL or a Backend); ``StoreNotFoundError`` if there is none.

        A store whose config is missing or damaged is refused with a message naming ``deltackpt repair``."""
        backend = open_backend(location, storage_options)
        return cls(backend, read_store_config(backend), cache_dir)

    @classmethod
    def open_or_init(cls, location, *, cache_dir=None, storage_options: dict | None = None, **config) -> "Store":
        """Open the store at ``location``, creating it if there is none (safe when many ranks race: the config
        is published create-if-absent, so exactly one init wins and the others open its store). A store whose
        config was lost is refused (naming ``deltackpt repair``), never replaced by a new one."""
        backend = open_backend(location, storage_options)
        try:  # the common case (a store that exists) in one read
            return cls.open(backend, cache_dir=cache_dir)
        except StoreNotFoundError:
            pass
        return cls.init(backend, cache_dir=cache_dir, exist_ok=True, **config)

    def refresh_config(self) -> None:
        """Read the config again: another process may have added a feature since this Store was opened (a
        copy from a chained store adds ``delta-chains``; features are only ever added). A Store that walked
        chains by its config at open cut them short: loads and verify called intact chains damaged, and gc
        deleted live bases. Maintenance, copies and saves call this first; a read when a chain runs past the
        limit it knows."""
        current = read_store_config(self.backend)  # the format gate: a feature this code lacks is refused
        if current.store_id != self.config.store_id:
            raise ManifestFormatError(f"{describe(self.backend)}: store config changed its store_id while open")
        self.config = current

    def ensure_features(self, names=None) -> None:
        """Record ``names`` (default: what this code's writer may produce under the store's config) in the
        store's config before data that needs them is written (the format gate).

        A store written by an older deltackpt gains the features (and format version 2) on its first write by
        this code, so from then on a reader that lacks one refuses the store instead of misreading its data.
        """
        if names is None:
            names = writer_features(self.config)
        if set(names) <= set(self.config.features):
            return
        for _ in range(100):
            current = decode_config(self.backend.get(CONFIG_KEY))
            if current.store_id != self.config.store_id:
                raise ManifestFormatError(f"{describe(self.backend)}: store config changed its store_id while open")
            updated = current.with_features(names)
            if updated is current:
                break
            self.backend.put(CONFIG_KEY, encode_config(updated))
            # No compare-and-swap: another process's read-modify-write may have put its own features over
            # ours. Read again until the stored config lists them (features are only ever added).
            time.sleep(random.uniform(0.001, 0.01))
        else:
            raise ManifestFormatError(f"{describe(self.backend)}: could not record features {sorted(names)}")
        self.config = updated

    # -- index ---------------------------------------------------------------------------------------------
    @property
    def index(self) -> ChunkIndex:
        """The index, refreshed from a listing of every pack on first use (unless :meth:`index_as_of` brought
        it up to a commit first)."""
        index = self._cache_index()
        if not self._index_current:
            with self._index_lock:
                if not self._index_current:
                    index.refresh()
                    self._index_current = True
        return index

    def _cache_index(self) -> ChunkIndex:
        """The index as its cache holds it, not refreshed: for what the cache keeps beside the chunks (the
        checkpoint summaries), which a listing of every pack does not change."""
        if self._index is None:
            with self._index_lock:
                if self._index is None:
                    self._index_current = False
                    self._index = self._new_index()
        return self._index

    def index_as_of(self, head: str | None, head_ns: int | None = None) -> ChunkIndex:
        """The index, brought up to the commit of ``head`` (the store's newest checkpoint when a save began,
        None when it had none) when its cache has not seen that commit: from the records of the commits it
        missed (:mod:`.commitlog`), else from a listing of every pack. Packs written since (other ranks' of the
        same save) are never needed to deduplicate against.
        A DCP rank names the head its coordinator sent: a cache the coordinator commits into is current
        without a listing per rank (O(ranks x packs) per save, and on a first save each rank listed the
        packs the ranks before it had written), and a cache on another host, or of another process, catches
        up before every save (else it re-stores what it lacks). ``head_ns``: the head's creation time, when known:
        a checkpoint of that name saved again elsewhere since is another commit, not one this cache has seen."""
        index = self._cache_index()
        if not index.has_seen(head, head_ns):
            # One process per cache catches up: the ranks of a host that share its node-local cache each
            # listed every pack and read every new pack's table, all at once, when it missed a commit.
            with index.one_at_a_time():
                if not index.has_seen(head, head_ns):
                    catch_up(index, self.backend, self.config.store_id, head)
        self._index_current = True
        return index

    def refresh_index(self, listed: dict[str, tuple[int, float]] | None = None, *,
                      since: int | None = None) -> tuple[int, int]:
        """Bring the index in line with the packs (``listed``: the caller's fresh listing of them, name ->
        (size, mtime)); one listing, not the first use's and then this one's. ``since``: the index's
        :attr:`~ChunkIndex.refreshes` before the caller looked a chunk up and missed it; when a refresh that
        listed after that has finished meanwhile, nothing is listed again (the threads of a read that all
        missed listed once each)."""
        index = self._cache_index()
        with self._index_lock:
            if since is not None and index.refreshed_since(since):
                return 0, 0
            out = index.refresh(listed)
            self._index_current = True
        return out

    def rebuild_index(self, progress: Progress | None = None) -> tuple[int, int]:
        """Drop the index cache and re-read every pack table. Returns (packs indexed, packs dropped)."""
        out = self._cache_index().rebuild(progress=progress)
        self._index_current = True
        return out

    def _new_index(self) -> ChunkIndex:
        return ChunkIndex(self.backend, self.cache_dir, self.config.store_id, self._fallback_cache_dirs)

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
        created_ns: int | None = None,
        checked_packs: Iterable[str] | None = None,
        after_ns: int | None = None,
    ) -> Manifest:
        """Publish a checkpoint whose chunks are already in packs; the manifest put is the commit point.

        ``packs`` (name -> size) are the packs this save wrote; their entries are indexed first (read from
        the packs' tables unless ``entries`` already lists them). Every referenced chunk must be indexed,
        else MissingChunkError and nothing is committed. ``checked_packs``: the ``reused_packs`` of the
        ChunkWriter(s) that wrote ``items`` under the store lock, which looked their chunks up already; then
        only those packs' existence is checked (see :mod:`.commit`). ``after_ns``: the creation time of the newest
        checkpoint the save saw; this one is made after it whatever this host's clock says (the order of a
        store's checkpoints, which resume and retention follow, must not depend on which node's clock is ahead).
        """
        validate_name(name)
        keys = [it.key for it in items]
        if len(set(keys)) != len(keys):
            raise ValueError("item keys must be unique within a checkpoint")
        packs = dict(packs or {})
        self._last_commit = None  # a failed commit (a pack lost) must not be trusted by the next save
        entries = index_new_packs(self, entries, packs)
        holding = check_chunks(self, name, items, entries, packs, checked_packs)
        if parent is None:
            latest = self.list_checkpoints()
            parent = latest[-1].name if latest else None
        manifest = build_manifest(self, name, items, entries=entries, packs=packs, parent=parent,
                                  metadata=metadata, layer_data=layer_data, created_ns=created_ns, after_ns=after_ns)
        data = encode_manifest(manifest)
        if lock is not None:
            lock.check()  # a writer whose lock went stale must not commit: gc may have run
        crash_point("commit:before-manifest")
        if overwrite:
            self.backend.put(manifest_key(name), data)
        else:
            # create-if-absent: two saves of one name cannot both commit (atomic on local disk, in memory and on
            # S3; on other fsspec filesystems a look then a put, see FsspecBackend.put_new)
            try:
                self.backend.put_new(manifest_key(name), data)
            except FileExistsError:
                raise CheckpointExistsError(name) from None
        crash_point("commit:after-manifest")
        # Its record in the commit log: how other caches catch up without a listing (a hint: never raises).
        record_commit(self.backend, self._cache_index(), self.config.store_id, manifest, packs, entries)
        obj = self._manifest_object(name)
        mtime_s, version = (obj.mtime_s, self._content_version(obj)) if obj else (0.0, "")
        if holding is not None and obj is not None:
            self._last_commit = (name, manifest.created_ns, len(data), mtime_s, version, frozenset(holding))
        # The last commit: this cache holds every pack up to this commit.
        self.index.put_summaries({name: msgspec.msgpack.encode(summarize_manifest(manifest, len(data), mtime_s,
                                                                                  version))},
                                 meta=ChunkIndex.commit_meta(Commit(name, manifest.created_ns)))
        return manifest

    def save(self, name: str, items: Mapping[str, Any], *, metadata=None, overwrite: bool = False,
             lock_wait_s: float = DEFAULT_WAIT_S, **writer_kwargs) -> Manifest:
        """Save a dict of numpy arrays / bytes as checkpoint ``name`` in one call (single process).

        A running gc's delete phase is waited for (up to ``lock_wait_s``, logged), never a reason to fail."""
        validate_name(name)
        if not overwrite and self.exists(name):
            raise CheckpointExistsError(name)
        # Held from before the first dedup decision until the manifest is written: gc spares our claims.
        # The collector is paused as on the DCP path: a 100k-item manifest decoded in 0.75 s instead of 0.23.
        with self.lock(SHARED, wait_s=lock_wait_s) as lock, paused_gc():
            return self._save_locked(name, items, metadata, overwrite, lock, writer_kwargs)

    def _save_locked(self, name, items, metadata, overwrite, lock, writer_kwargs) -> Manifest:
        newest = self._newest(fallback=True)
        parent = newest[1] if newest is not None else None
        # Under the lock: caught up with the commits other processes made since this cache's last one (a
        # stale cache costs only dedup: it re-stores what it lacks), and with a gc that may have deleted packs.
        self.index_as_of(parent.name if parent is not None else None,
                         parent.created_ns if parent is not None else None).sync()
        w = self.writer(parent=parent, parent_packs=self._own_packs(newest), **writer_kwargs)
        try:
            for key, value in items.items():
                if isinstance(value, np.generic):
                    value = np.asarray(value)
                if isinstance(value, np.ndarray):
                    _check_plain_dtype(key, value.dtype)
                    arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)
                    data = arr.reshape(-1).view(np.uint8)  # the buffer protocol refuses some dtypes (datetime64)
                    w.add_array(key, data, dtype=arr.dtype.str, elem_size=_elem_size(arr), shape=value.shape)
                elif isinstance(value, (bytes, bytearray, memoryview)):
                    w.add_bytes(key, value)
                else:
                    raise TypeError(f"item {key!r}: expected a numpy array or bytes, got {type(value).__name__}")
            summary: WriteSummary = w.finish()
            crash_point("save:after-packs")
            return self.commit(name, summary.items, entries=summary.entries, packs=summary.packs,
                               metadata=metadata, overwrite=overwrite, lock=lock,
                               parent=parent.name if parent is not None else None,
                               checked_packs=summary.reused_packs,
                               after_ns=newest[0].created_ns if newest is not None else None)
        except BaseException:
            w.abort()  # its spool files (its published packs are left to gc)
            raise

    def _own_packs(self, newest: tuple[CheckpointInfo, Manifest] | None) -> frozenset[str] | None:
        """The packs that held every chunk of the newest checkpoint when this object committed it, if it is
        that checkpoint still (same name, creation time, manifest size, mtime and version: not rewritten
        since)."""
        last = self._last_commit
        if newest is None or last is None:
            return None
        info, m = newest
        same = (m.name, m.created_ns, info.manifest_bytes, info.manifest_mtime_s, info.manifest_version) == last[:5]
        return last[5] if same else None

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
                self.backend.delete(manifest_key(name))  # its commit record stays while its packs do (gc)
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
            bufs = r.read_many(r.items)
            for key, item in r.items.items():
                buf = bufs.pop(key)
                if item.kind == "bytes":
                    out[key] = buf.tobytes()
                else:
                    try:
                        dtype = np.dtype(item.dtype)
                    except TypeError:
                        out[key] = buf  # a dtype numpy does not know (e.g. bfloat16): raw bytes
                        continue
                    except ValueError as e:  # e.g. "(99999999999,9)i4": a sub-array numpy cannot make
                        raise CorruptManifestError(f"item {key!r}: invalid dtype {item.dtype!r} ({e})",
                                                   checkpoint=r.name) from None
                    try:
                        if dtype.hasobject:  # never saved (save refuses object arrays): bytes are not pointers
                            raise ValueError("a dtype of Python objects")
                        out[key] = buf.view(dtype).reshape(item.shape)
                    except (ValueError, TypeError) as e:  # a shape or dtype that does not fit the item's bytes
                        raise CorruptManifestError(f"item {key!r}: its bytes are not an array of shape "
                                                   f"{item.shape} and dtype {item.dtype} ({e})",
                                                   checkpoint=r.name) from None
        return out

    # -- accounting ------------------------------------------------------------------------------------------
    def usage(self) -> StoreUsage:
        from .tier import TIER_KEY

        infos = self.list_checkpoints()
        packs = [i for i in self.backend.list("packs/")]
        manifests = [i for i in self.backend.list("manifests/")]
        pack_bytes = sum(i.size_bytes for i in packs)
        manifest_bytes = sum(i.size_bytes for i in manifests)
        config_bytes = self.backend.size(CONFIG_KEY)
        # The store's other objects: commit records, tags, a tier's record, the gc epoch (locks and temp files
        # come and go; a local store's index cache, its cache/ folder, is a cache, not the store's).
        other_bytes = sum(i.size_bytes for prefix in ("commits/", "tags/") for i in self.backend.list(prefix))
        for key in (TIER_KEY, GC_EPOCH_KEY):
            try:
                other_bytes += self.backend.size(key)
            except FileNotFoundError:
                pass  # not a tiered store, never gc'd
        return StoreUsage(
            num_checkpoints=len(infos),
            logical_bytes=sum(i.logical_bytes for i in infos),
            physical_bytes=pack_bytes + manifest_bytes + config_bytes,
            other_bytes=other_bytes,
            pack_bytes=pack_bytes,
            manifest_bytes=manifest_bytes,
            num_packs=len(packs),
            num_chunks=self.index.num_chunks(),
        )


def _check_plain_dtype(key: str, dtype: np.dtype) -> None:
    """Only plain data round-trips: object arrays hold pointers, and a structured dtype's fields are lost."""
    if dtype.hasobject:
        raise TypeError(f"item {key!r}: dtype {dtype} holds Python objects, which cannot be stored as bytes; "
                        "convert it to a numeric or fixed-width string dtype, or save bytes you serialized")
    if dtype.names is not None:
        raise TypeError(f"item {key!r}: structured dtype {dtype} is not supported; save each field as its own "
                        "item, or a .view(np.uint8) of the array")


def _elem_size(arr: np.ndarray) -> int:
    size = arr.dtype.itemsize
    return size if size in (1, 2, 4, 8) else 1

"""DeltaStorageReader: DCP's StorageReader on a deltackpt store.

``read_data`` serves each ReadItem (a box inside one saved chunk, as DCP's resharding planner computes it)
by reading only the store chunks that overlap it, re-hashing them, and copying into the planner's
destination tensor. When the box is one contiguous byte range and the destination is a contiguous CPU
tensor, bytes are decoded straight into it.
"""

from __future__ import annotations

import io
import math
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CorruptManifestError, ManifestFormatError
from ..store import LATEST, CheckpointReader, Manifest, Store, default_read_threads
from .metadata_schema import decode_metadata
from .names import LAYER_KEY, checkpoint_name
from ..store import paused_gc

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class DeltaStorageReader(StorageReader):
    """Load any committed checkpoint of a deltackpt store through ``dcp.load``, resharded as needed.

    ``checkpoint_id`` is a checkpoint name or ``"latest"``; it is resolved and its manifest read when given
    (here or via ``dcp.load(..., checkpoint_id=...)``), so a missing name raises CheckpointNotFoundError and a
    damaged manifest CorruptManifestError on every rank before any collective starts. ``fallback``:
    ``latest`` skips a newest checkpoint whose manifest is damaged.
    """

    def __init__(self, store, checkpoint_id: str | os.PathLike | None = LATEST, *,
                 num_threads: int | None = None, fallback: bool = False,
                 storage_options: dict | None = None) -> None:
        super().__init__()
        self._store_spec = store
        self._storage_options = storage_options
        self._store: Store | None = store if isinstance(store, Store) else None
        self.num_threads = num_threads  # None: chosen per load (default_read_threads)
        self.fallback = fallback
        self.checkpoint_id: str | None = None
        self.load_id = None
        self._opened: tuple[Manifest, Metadata] | None = None  # reset's manifest and its checked DCP metadata
        self._reader: CheckpointReader | None = None
        self.metadata: Metadata | None = None
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_store"] = None
        state["_reader"] = None
        state["_opened"] = None
        return state

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = (self._store_spec if isinstance(self._store_spec, Store)
                           else Store.open(self._store_spec, storage_options=self._storage_options))
        return self._store

    # -- StorageReader contract ------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            name = checkpoint_name(checkpoint_id) if checkpoint_id != LATEST else LATEST
            self.checkpoint_id = self.store.resolve(name, fallback=self.fallback)
            # Read and checked here, not in read_metadata: DCP logs that method's errors and replaces them.
            self._opened = _dcp_manifest(self.store, self.checkpoint_id)
        self._reader = None
        self.metadata = None
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            return checkpoint_id == LATEST or bool(checkpoint_name(checkpoint_id))
        except ValueError:
            return False

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with paused_gc():
            return self._read_metadata()

    def _read_metadata(self) -> Metadata:
        if self.checkpoint_id is None:
            self.reset(LATEST)
        (manifest, md), self._opened = self._opened or _dcp_manifest(self.store, self.checkpoint_id), None
        if md.storage_meta is None:
            md.storage_meta = StorageMeta(checkpoint_id=manifest.name)
        md.storage_meta.load_id = self.load_id
        self._reader = CheckpointReader(self.store, manifest, num_threads=self.num_threads)
        self.metadata = md
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan.storage_data = self.checkpoint_id
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        names = {p.storage_data for p in plans}
        if len(names) > 1:
            raise RuntimeError(f"ranks resolved different checkpoints {sorted(names)} (a save committed while "
                               "loading 'latest'?); load by explicit name")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with paused_gc():
            self._read_data(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        if self._reader is None:
            self._read_metadata()
        reader = self._reader
        keys = self.metadata.storage_data
        tensor_jobs = []
        for req in plan.items:
            key = keys[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(reader.read(key).tobytes()))
                continue
            target = planner.resolve_tensor(req).detach()
            tensor_jobs.append((req, key, target))
        # Every tensor becomes chunk jobs (a box that is not one byte range: one read-and-copy job); small
        # jobs are batched so that a model's many small tensors do not cost a pool hand-off each, and the
        # batches run largest first on one pool (a large tensor's chunks in parallel, no nested pools).
        work = []
        for req, key, target in tensor_jobs:
            work.extend(self._tensor_jobs(reader, req, key, target))
        chunk_jobs = [job[2] for job in work if job[1] == reader.run_job]
        threads = self.num_threads
        if threads is None:  # one per core, twice that when the chunks are not in the page cache, more remote
            threads = default_read_threads(reader.looks_cold(chunk_jobs), remote=reader.remote)
        # Chunks of one pack, of every tensor, read together: a pack opened once, one read per stretch.
        work = [job for job in work if job[1] != reader.run_job]
        work += [(job[-1], reader.run_job, job) for job in reader.coalesce(chunk_jobs)]
        batches = _batches(work, BATCH_BYTES)
        if len(batches) > 1 and threads > 1:
            with ThreadPoolExecutor(min(threads, len(batches)), thread_name_prefix="deltackpt-load") as pool:
                for fut in [pool.submit(_run_batch, b) for b in batches]:
                    fut.result()
        else:
            for b in batches:
                _run_batch(b)
        for req, _key, target in tensor_jobs:
            planner.commit_tensor(req, target)

    # -- internals -------------------------------------------------------------------------------------------
    def _tensor_jobs(self, reader: CheckpointReader, req: ReadItem, key: str, target: torch.Tensor) -> list:
        """(bytes, function, argument) jobs that fill ``target`` with the box ``req`` names."""
        item = reader.item(key)
        md = self.metadata.state_dict_metadata[req.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        dtype = _DTYPES.get(item.dtype, md.properties.dtype)
        shape = list(item.shape)
        lengths = list(req.lengths)
        offsets = list(req.storage_offsets)
        if list(target.shape) != lengths:
            raise RuntimeError(f"destination for {req.storage_index.fqn} has shape {list(target.shape)}, "
                               f"expected {lengths}")
        esize = dtype.itemsize
        if math.prod(lengths) == 0:
            return []
        # The box [offsets, offsets + lengths) of the saved chunk; its first and last elements bound the
        # contiguous byte range that holds it.
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        first = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
        nbytes = (last - first + 1) * esize
        contiguous = nbytes == math.prod(lengths) * esize
        # (A conjugate or negative view's memory does not hold its values: its bits go through copy_.)
        if (contiguous and target.is_contiguous() and target.device.type == "cpu" and target.dtype == dtype
                and not target.is_conj() and not target.is_neg()):
            dst = target.reshape(-1).view(torch.uint8).numpy()
            return [(job[-1], reader.run_job, job) for job in reader.chunk_jobs(key, dst, first * esize)]
        box = (reader, key, first * esize, nbytes, dtype, contiguous, lengths, strides, shape, target)
        return [(nbytes, _copy_box, box)]


def _dcp_manifest(store: Store, name: str) -> tuple[Manifest, Metadata]:
    """Checkpoint ``name``'s manifest and its DCP metadata, decoded and checked against the manifest's items."""
    manifest = store.read_manifest(name)
    if LAYER_KEY not in manifest.layer_data:
        raise ManifestFormatError(f"checkpoint {name!r} was not written through DCP (no DCP metadata); "
                                  "read it with deltackpt.store.Store.load")
    md = decode_metadata(manifest.layer_data[LAYER_KEY])
    _check_layout(md, manifest)
    return manifest, md


def _check_layout(md: Metadata, manifest: Manifest) -> None:
    """CorruptManifestError unless each saved value and tensor chunk of ``md`` has a storage_data entry naming
    an item of ``manifest`` that holds exactly it (a bytes item; an array of the chunk's sizes and bytes): a
    load then never meets a key that names no item, nor a box outside its item, nor a size nothing holds."""
    items, keys = manifest.item_map(), md.storage_data

    def bad(what: str) -> CorruptManifestError:
        return CorruptManifestError(f"manifest {manifest.name!r}: DCP metadata: {what}", checkpoint=manifest.name)

    if not isinstance(keys, dict):
        raise bad("no storage_data")
    at: dict[tuple, str] = {}  # (fqn, offsets) -> item key: one pass, no MetadataIndex made per chunk
    for index, key in keys.items():
        if type(key) is not str or key not in items:
            raise bad(f"storage_data of {index.fqn!r} names no item ({key!r:.80})")
        at[index.fqn, index.offset] = key
    for fqn, smd in md.state_dict_metadata.items():
        if not isinstance(smd, TensorStorageMetadata):
            key = at.get((fqn, None))
            if key is None or items[key].kind != "bytes":
                raise bad(f"value {fqn!r} has no bytes item")
            continue
        for c in smd.chunks:
            item = items.get(at.get((fqn, c.offsets)))
            if item is None:
                raise bad(f"chunk {list(c.offsets)} of {fqn!r} has no item")
            esize = _DTYPES.get(item.dtype, smd.properties.dtype).itemsize
            if item.kind != "array" or tuple(item.shape) != c.sizes or item.nbytes != math.prod(c.sizes) * esize:
                raise bad(f"item {item.key!r} does not hold chunk {list(c.offsets)} of {fqn!r} (shape "
                          f"{list(item.shape)}, {item.nbytes} bytes; the chunk's sizes {list(c.sizes)})")


BATCH_BYTES = 1 << 20  # jobs smaller than this are run in batches of about this many bytes


def _batches(work: list, min_bytes: int) -> list[list]:
    """Consecutive jobs grouped until each group holds ``min_bytes`` (a large job is a group of its own),
    largest groups first."""
    batches, cur, size = [], [], 0
    for job in work:
        if job[0] >= min_bytes:
            batches.append((job[0], [job]))
            continue
        cur.append(job)
        size += job[0]
        if size >= min_bytes:
            batches.append((size, cur))
            cur, size = [], 0
    if cur:
        batches.append((size, cur))
    batches.sort(key=lambda b: -b[0])
    return [b for _, b in batches]


def _run_batch(batch: list) -> None:
    for _n, fn, arg in batch:
        fn(arg)


def _copy_box(box: tuple) -> None:
    """Read the byte range holding a box of a saved chunk and copy the box into the destination."""
    reader, key, offset, nbytes, dtype, contiguous, lengths, strides, shape, target = box
    buf = torch.from_numpy(reader.read(key, offset, nbytes, parallel=False)).view(dtype)
    if contiguous:
        src = buf.view(lengths)
    else:
        # View the range as the saved chunk's trailing box and narrow it to the request.
        src = torch.as_strided(buf, lengths, strides) if shape else buf.view(lengths)
    target.copy_(src)

"""DeltaStorageWriter: DCP's StorageWriter on a deltackpt store.

Every rank writes the chunks of its own write items into its own packs (no tensor data passes through
rank 0); its first WriteResult carries only its items' chunk refs (one list), the names of the packs it
wrote and of those its reused chunks are in. The coordinator reads the parent checkpoint's manifest once,
while planning, and sends each rank the parent's chunk refs its items overlap in its SavePlan: a rank's cost
is that of its own items whatever the number of ranks (a one-rank save keeps the whole map in the process).
The coordinator's ``finish`` indexes the new packs and writes the manifest, which holds DCP's Metadata under a
strict schema. If any rank fails, DCP never calls ``finish``, so no manifest appears and earlier checkpoints
are untouched; every rank's published packs (the failing rank's too, indexed so that a retry reuses them) are
orphans for ``gc``, and only spool files are removed.

The writer is picklable (``dcp.async_save`` with PROCESS pickles it per request): the store is opened
lazily in whichever process runs the save.

The writer is DCP's ``AsyncStager`` too: ``dcp.async_save`` stages the state into the writer's
:class:`StagingBuffers` (reused while the same writer, or the same buffers passed to several writers, serve
save after save), and the background save writes straight from them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
import uuid
import weakref
from collections import Counter
from typing import Any

import msgspec
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import (CheckpointExistsError, CheckpointNotFoundError, CorruptManifestError,
                      SilentDataCorruptionError)
from ..store import (AUTO_CAP_BYTES, SHARED, CheckpointInfo, Item, Manifest, ParentMap, Store, StoreLock,
                     WriteSummary, decode_entries, default_write_threads, encode_entries, paused_gc, remove_lock)
from .names import LAYER_KEY, checkpoint_name
from .metadata_schema import metadata_to_record
from .placement import Shard, add_prepared, bytes_in_place, item_key, prepare_shard, shard_placement
from .staging import StagingBuffers

log = logging.getLogger("deltackpt.dcp")


def open_store(store, storage_options: dict | None = None) -> Store:
    """A Store from a path or URL (created if absent), a Backend, or a Store."""
    if isinstance(store, Store):
        return store
    return Store.open_or_init(store, storage_options=storage_options)


REPLICA_CHECKS = ("raise", "warn", "off")


def check_replica_mode(mode: str) -> None:
    """ValueError unless ``mode`` is one of REPLICA_CHECKS (what a save does when replicas differ)."""
    if mode not in REPLICA_CHECKS:
        raise ValueError(f"replica_check must be 'raise', 'warn' or 'off', got {mode!r}")


class DeltaStorageWriter(StorageWriter, AsyncStager):
    """Save DCP checkpoints into a deltackpt store; each ``checkpoint_id`` becomes one named checkpoint.

    ``store``: a directory or a URL such as ``s3://bucket/run`` (a new store is created there if there is none),
    a Backend, or a Store; ``storage_options`` go to the fsspec filesystem of a URL.
    ``checkpoint_id``: the checkpoint name; may instead come from ``dcp.save(..., checkpoint_id=...)``.
    ``overwrite``: replace an existing checkpoint of the same name instead of failing.
    ``metadata``: JSON-able user metadata stored in the manifest (e.g. ``{"step": 500}``).
    ``replica_check``: what to do when replicas of a tensor differ across ranks ("raise", "warn", "off");
    needs ``planner=DeltaSavePlanner()`` (``deltackpt.save`` and CheckpointManager use it by default).
    ``staging``: the buffers ``dcp.async_save`` stages into (default: the writer's own, made on first use);
    share one :class:`StagingBuffers` between writers to reuse it, and ``close()`` it (or the writer) at the end.
    A writer reused for several ``dcp.async_save`` calls (like ``FileSystemWriter(cache_staged_state_dict=True)``)
    must see each save's future done before the next call: the next stage overwrites the buffers.
    """

    _synchronize_after_execute = False  # stage() returns with its copies complete

    def __init__(self, store, checkpoint_id: str | os.PathLike | None = None, *, overwrite: bool = False,
                 metadata: dict[str, Any] | None = None, num_threads: int | None = None,
                 replica_check: str = "raise", storage_options: dict | None = None,
                 staging: StagingBuffers | None = None) -> None:
        check_replica_mode(replica_check)
        super().__init__()
        self._store_spec = store
        self._storage_options = storage_options
        self._store: Store | None = store if isinstance(store, Store) else None
        self.checkpoint_id = checkpoint_name(checkpoint_id) if checkpoint_id is not None else None
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        self.num_threads = num_threads
        self.is_coordinator = False
        self.rank = 0
        self.replica_check = replica_check
        self.save_id = uuid.uuid4().hex
        self._parent_name: str | None = None
        self._after_ns: int | None = None  # the newest checkpoint's creation time when this save was planned
        self._parent_map: ParentMap | None = None  # the parent's whole map, when this process is the only rank
        self._local_summary: WriteSummary | None = None  # this rank's summary, when it is the only rank
        self._lock: StoreLock | None = None
        # The id of the coordinator's store lock, chosen here: a copy of this writer that runs the save in
        # another process (DCP's PROCESS mode) takes its lock under this id, which abort() can then remove.
        self._lock_id = uuid.uuid4().hex[:16]
        self._sent = False  # pickled: a copy may hold the lock elsewhere
        self._staging = staging

    def __getstate__(self):
        self._sent = True  # (the copy may take the store lock in another process)
        state = self.__dict__.copy()
        state["_sent"] = False
        state["_store"] = None  # reopened lazily where the save runs
        state["_lock"] = None
        state["_parent_map"] = None
        state["_local_summary"] = None
        state["_staging"] = None  # the staged state travels as the state dict, not with the writer
        return state

    # -- AsyncStager contract (dcp.async_save) ---------------------------------------------------------------
    def stage(self, state_dict):
        """Copy ``state_dict`` into the staging buffers; the background save reads that copy."""
        if self._staging is None:
            self._staging = StagingBuffers()
        self._lock_id, self._sent = uuid.uuid4().hex[:16], False  # each save's lock its own id
        return self._staging.stage(state_dict)

    def synchronize_staging(self) -> None:
        if self._staging is not None:
            self._staging.synchronize()

    def close(self) -> None:
        """Free the staging buffers (a later async save makes them again)."""
        if self._staging is not None:
            self._staging.close()

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self._store_spec, self._storage_options)
        return self._store

    # -- StorageWriter contract ------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_name(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._parent_name = None
        self._after_ns = None  # the newest checkpoint's creation time when this save was planned
        self._parent_map = None
        self._local_summary = None
        self.abort()  # a previous save that never reached its commit

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            checkpoint_name(checkpoint_id)
            return True
        except ValueError:
            return False

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if self.checkpoint_id is None:
            raise ValueError("DeltaStorageWriter needs a checkpoint name: pass checkpoint_id to the writer or to "
                             "dcp.save(..., checkpoint_id=...)")
        if not self.overwrite and self.store.exists(self.checkpoint_id):
            raise CheckpointExistsError(self.checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # With DeltaSavePlanner every rank reports digests of its replicas, which the coordinator compares.
        # The host name lets the coordinator tell each rank how many ranks share its machine's cores.
        digests = plan.storage_data.get("replica_digests", {}) if isinstance(plan.storage_data, dict) else {}
        return dataclasses.replace(plan, storage_data={"replica_digests": digests, "host": socket.gethostname()})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        t0 = time.perf_counter()
        # The shared lock is taken before any rank's write_data dedups against the store: a gc delete phase
        # between a rank's dedup and the commit could otherwise sweep a chunk the checkpoint references.
        store = self.store
        self._acquire_lock(store)
        try:
            return self._global_plan(store, plans, t0)
        except BaseException:
            self.abort()  # e.g. replicas that differ: nothing is saved, so nothing may hold off a gc
            raise

    def _global_plan(self, store: Store, plans: list[SavePlan], t0: float) -> list[SavePlan]:
        if any(not isinstance(p.storage_data, dict) or not p.usable for p in plans):
            # A planner's enable_plan_caching sends empty plans from the second save on, and each rank would
            # reuse the first save's final plan: its parent, head and creation-time floor.
            raise ValueError("DeltaStorageWriter needs every rank's full plan at every save (each carries that "
                             "save's parent checkpoint): turn off the planner's enable_plan_caching")
        if self.replica_check != "off":
            check_replicas([p.storage_data.get("replica_digests", {}) for p in plans], self.replica_check)
        hosts = Counter(p.storage_data.get("host") for p in plans)
        with paused_gc():  # the parent's manifest and map: a few objects per chunk of every rank
            parent, newest = self._read_parent(store)
            head = newest.name if newest is not None else None
            self._parent_name = parent.name if parent is not None else None
            self._after_ns = newest.created_ns if newest is not None else None
            pmap = ParentMap(parent)
            # One rank is this process: it keeps the whole map (its groups' extents made when asked for)
            # rather than the part its items overlap, encoded and decoded again (3-4 ms of 357 tensors).
            self._parent_map = pmap if len(plans) == 1 else None
            out = [dataclasses.replace(p, storage_data={
                "agreed_parent": self._parent_name, "head": head, "after_ns": self._after_ns,
                "ranks": len(plans),
                "host_ranks": hosts[p.storage_data.get("host")],
                "parent_refs": pmap.encode_part(_item_ranges(p)) if pmap and len(plans) > 1 else None,
                "parent_local": len(plans) == 1}) for p in plans]
        log.debug("save %s: plan %.3f s (%d ranks, parent %s)", self.checkpoint_id, time.perf_counter() - t0,
                  len(plans), self._parent_name)
        return out

    def _read_parent(self, store: Store) -> tuple[Manifest | None, CheckpointInfo | None]:
        """The newest readable checkpoint other than the one being saved (read under the lock: one
        forgotten since cannot be chosen), the save's parent; and the newest checkpoint (None in a store
        without one): the commit every rank's index catches up to, and the time this one is made after."""
        infos = store.list_checkpoints()
        head = infos[-1] if infos else None
        for info in reversed(infos):
            if info.name == self.checkpoint_id:
                continue
            try:
                return store.read_manifest(info.name), head
            except CheckpointNotFoundError:
                continue  # forgotten meanwhile
            except CorruptManifestError as e:
                log.warning("save %s: not diffing against damaged checkpoint %s (%s)", self.checkpoint_id,
                            info.name, e)
        return None, head

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t0 = time.perf_counter()
        store = self.store
        if self.is_coordinator:
            self._acquire_lock(store)
        try:
            with paused_gc():
                fut = self._write_data(store, plan, planner)
            log.debug("save %s: rank %d write %.3f s (%d items)", self.checkpoint_id, self.rank,
                      time.perf_counter() - t0, len(plan.items))
            return fut
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Release the store lock of a save that failed before its commit. DCP calls no storage writer method
        when another rank's write fails: the coordinator's lock would stay (refreshed) until this writer is
        collected, and hold off every gc, which in turn holds off new saves. deltackpt's save functions and
        CheckpointManager call this on failure; a caller of ``dcp.save`` itself may too (harmless after a
        commit)."""
        lock, self._lock = self._lock, None
        try:
            if lock is not None:
                lock.release()
            elif self._sent:
                # A copy of this writer ran the save elsewhere (DCP's checkpoint process), maybe as the
                # coordinator, whose lock there nothing releases when another rank failed: remove it by its id.
                remove_lock(self.store.backend, SHARED, self._lock_id)
        except Exception as e:  # noqa: BLE001 - the save's own error (raised by the caller) matters more
            log.warning("save %s: could not release the store lock (%s); it goes stale on its own",
                        self.checkpoint_id, e)

    def _acquire_lock(self, store: Store) -> None:
        """The coordinator's shared store lock, held until the commit; released if this writer is dropped
        after another rank failed."""
        if self._lock is None:
            self._lock = store.lock(SHARED, lock_id=self._lock_id).acquire()
            weakref.finalize(self, self._lock.release)

    def _write_data(self, store: Store, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        host_ranks = ranks = 1
        local = False  # the only rank, its coordinator this very writer: its summary needs no encoding
        parent = ParentMap(None)
        index = None  # a plan not from this writer's prepare_global_plan: refreshed on first use
        if isinstance(plan.storage_data, dict) and "agreed_parent" in plan.storage_data:
            data = plan.storage_data
            self._parent_name, host_ranks, ranks = data["agreed_parent"], data["host_ranks"], data["ranks"]
            self._after_ns = data.get("after_ns")
            local = bool(data.get("parent_local")) and self.is_coordinator
            if data.get("parent_refs"):
                parent = ParentMap.decode_part(self._parent_name, data["parent_refs"])
            elif data.get("parent_local") and self._parent_name is not None:
                pmap = self._parent_map
                # (Another writer object planned this one-rank save: it reads the parent itself.)
                parent = pmap if pmap is not None and pmap.name == self._parent_name else ParentMap(
                    store.read_manifest(self._parent_name))
            # Caught up to exactly the commit the coordinator saw newest: no listing of every pack when this
            # cache indexed it itself, none in a store without checkpoints (the packs other ranks are writing
            # meanwhile are never needed to deduplicate against).
            index = store.index_as_of(data.get("head", self._parent_name), data.get("after_ns"))
        # The coordinator holds the lock: a gc elsewhere may have deleted packs before it (sync).
        (store.index if index is None else index).sync()
        if ranks > 1:
            # A multi-rank save is a training job's: keep this save's keyframes for the next one from the
            # first save on, else the second save after every (re)start reads all its bases back. (A single
            # process keeps them from its second use of the store: a one-off save holds no extra memory.)
            store.base_cache.reserve(AUTO_CAP_BYTES)
        # Ranks on one machine share its cores: each codes with its share (more threads only contend).
        writer = store.writer(parent=parent, num_threads=self.num_threads or default_write_threads(host_ranks))
        keys = []
        try:
            # The shards whose bytes are views of CPU tensors are hashed on another core first
            # (ChunkWriter.hash_ahead), while this thread places, looks up and codes the chunks. Other items are
            # resolved as they are added: a GPU tensor's copy (or a planner's) lives only until it is written.
            # Only a planner that resolves a tensor as DCP's default does (the state dict's own tensor, no copy)
            # is asked first: another one's copies would all be alive at once, or made twice.
            resolved = {}  # item -> its prepared Shard (bytes in place), or its data (resolved once)
            for n, item in enumerate(plan.items if _resolves_in_place(planner) else ()):
                if item.type != WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item)
                    td = item.tensor_data
                    resolved[n] = prepare_shard(item_key(item.index), item.index.fqn, data, td.chunk.offsets,
                                                td.chunk.sizes, td.size) if bytes_in_place(data) else data
            writer.hash_ahead([(s.raw, s.offset) for s in resolved.values() if isinstance(s, Shard)])
            for n, item in enumerate(plan.items):
                key = item_key(item.index)
                keys.append((item, key))
                data = resolved.pop(n) if n in resolved else planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    writer.add_bytes(key, data.getbuffer())
                elif isinstance(data, Shard):
                    add_prepared(writer, key, data)
                else:
                    td = item.tensor_data
                    add_prepared(writer, key, prepare_shard(key, item.index.fqn, data, td.chunk.offsets,
                                                            td.chunk.sizes, td.size))
            summary = writer.finish()
        except BaseException:
            writer.abort()  # its spool files (finish cleans up the same way)
            raise
        results = [WriteResult(index=item.index, size_in_bytes=rec.nbytes, storage_data=None if k else {})
                   for k, ((item, _key), rec) in enumerate(zip(keys, summary.items))]
        if results and local:
            # This writer's finish() commits them: the summary stays here, only the save's id travels (an
            # encode and a decode of every item and new pack entry less).
            self._local_summary = summary
            results[0].storage_data["local"] = self.save_id
        elif results:
            # The rank's items travel as one list with its first result: one encode and one decode, not one
            # per item (370 each in a fine-tune's save).
            results[0].storage_data["items"] = msgspec.msgpack.encode(summary.items)
            results[0].storage_data["packs"] = dict(summary.packs)
            # The packs' entries travel with them: the coordinator indexes them without reading each pack's
            # table back (one request per pack, serially, on object storage).
            results[0].storage_data["entries"] = encode_entries(summary.entries)
            results[0].storage_data["reused_packs"] = sorted(summary.reused_packs)
        elif summary.packs:  # cannot happen: no items, no packs
            raise AssertionError("packs written without items")
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # The coordinator decodes every rank's items and encodes the manifest and DCP metadata here: thousands
        # of small objects, which in a training process can set off a full collection (~0.1 s measured).
        t0 = time.perf_counter()
        with paused_gc():
            self._finish(metadata, results)
        log.debug("save %s: commit %.3f s (%d ranks)", self.checkpoint_id, time.perf_counter() - t0, len(results))

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._commit(metadata, results)
        finally:  # also when the results do not add up: the lock never waits for the writer's collection
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        local, self._local_summary = self._local_summary, None
        if (local is not None and len(results) == 1 and results[0]
                and results[0][0].storage_data.get("local") == self.save_id):
            # The only rank's summary, kept by this writer in _write_data.
            if len(local.items) != len(results[0]):
                raise ValueError(f"a rank wrote {len(local.items)} items for {len(results[0])} write results")
            items, packs, entries, reused = local.items, local.packs, local.entries, local.reused_packs
            storage_data = {wr.index: item.key for wr, item in zip(results[0], items)}
        else:
            items, packs, entries, reused, storage_data = _gather_results(results)
        # What the manifest keeps (and what dcp.save returns on every rank): our item keys, not chunk refs.
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        metadata.version = getattr(metadata, "version", None) or "1.0.0"
        self.store.commit(self.checkpoint_id, items, entries=entries, packs=packs, metadata=self.metadata,
                          # The record itself: msgpack writes it as the same map as its builtins.
                          layer_data={LAYER_KEY: metadata_to_record(metadata)}, parent=self._parent_name,
                          overwrite=self.overwrite, lock=self._lock, checked_packs=reused,
                          after_ns=self._after_ns)


def _resolves_in_place(planner: SavePlanner) -> bool:
    """Whether ``planner`` resolves a tensor item to the state dict's own tensor, as DCP's default planner
    does (its ``resolve_data`` and ``transform_object``, which changes only byte items)."""
    kind = type(planner)
    return (isinstance(planner, DefaultSavePlanner) and kind.resolve_data is DefaultSavePlanner.resolve_data
            and kind.transform_object is DefaultSavePlanner.transform_object
            and kind.lookup_object is DefaultSavePlanner.lookup_object)


def _gather_results(results: list[list[WriteResult]]):
    """(items, packs, entries, reused packs, storage_data) from every rank's write results (encoded by
    ``_write_data``); entries or reused packs are None when a rank did not send them."""
    items: list[Item] = []
    packs: dict[str, int] = {}
    reused: set[str] | None = set()  # None: a rank did not report its look-ups, so check every chunk
    entries: list | None = []  # None: a rank did not send its packs' entries, so read the pack tables
    storage_data: dict[MetadataIndex, str] = {}
    # Extended in place: a new list or set per rank copied everything gathered so far, ranks^2 / 2 copies
    # (1,000 ranks with 1,000 new chunks each: 10 s of the coordinator's commit, every rank waiting).
    for rank_results in results:
        if rank_results and reused is not None:
            found = rank_results[0].storage_data.get("reused_packs")
            if found is None:
                reused = None
            else:
                reused.update(found)
        if rank_results and entries is not None:
            blob = rank_results[0].storage_data.get("entries")
            if blob is None:
                entries = None
            else:
                entries.extend(decode_entries(blob))
        if not rank_results:
            continue
        data = rank_results[0].storage_data
        if "items" not in data:
            raise ValueError("a one-rank save's write results must be finished by the writer that wrote them")
        rank_items = msgspec.msgpack.decode(data["items"], type=list[Item])
        if len(rank_items) != len(rank_results):
            raise ValueError(f"a rank sent {len(rank_items)} items for {len(rank_results)} write results")
        items.extend(rank_items)
        packs.update(data.get("packs", {}))
        for wr, item in zip(rank_results, rank_items):
            storage_data[wr.index] = item.key
    return items, packs, entries, reused, storage_data


def _item_ranges(plan: SavePlan):
    """(group, start, end) in global bytes of each tensor item of ``plan``, as write_data places them."""
    for item in plan.items:
        td = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or td is None:
            continue
        elem = td.properties.dtype.itemsize
        group, offset = shard_placement(item.index.fqn, item_key(item.index), td.chunk.offsets, td.chunk.sizes,
                                        td.size, elem)
        yield group, offset, offset + math.prod(td.chunk.sizes) * elem


def check_replicas(per_rank: list[dict[str, str]], mode: str) -> None:
    """Compare each replicated item's digest across ranks; raise or warn naming the disagreeing ranks."""
    by_item: dict[str, dict[str, list[int]]] = {}
    for rank, digests in enumerate(per_rank):
        for key, digest in digests.items():
            by_item.setdefault(key, {}).setdefault(digest, []).append(rank)
    bad = []
    for key, groups in sorted(by_item.items()):
        if len(groups) > 1:
            ranked = sorted(groups.values(), key=len, reverse=True)
            majority = ranked[0] if len(ranked[0]) > len(ranked[1]) else []
            odd = sorted(r for g in groups.values() if g is not majority for r in g)
            bad.append((key, odd, majority))
    if not bad:
        return
    key, odd, majority = bad[0]
    msg = (f"replicas of {key.rsplit('@', 1)[0]!r} differ across ranks: ranks {odd} disagree with "
           f"{'ranks ' + str(majority) if majority else 'each other'}"
           + (f" (and {len(bad) - 1} more items)" if len(bad) > 1 else "")
           + "; a bit flipped in memory or compute? nothing was saved")
    if mode == "raise":
        raise SilentDataCorruptionError(msg)
    log.warning("%s", msg.replace("nothing was saved", "saving anyway (replica_check='warn')"))

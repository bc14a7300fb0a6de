"""DeltaStorageWriter / DeltaStorageReader under DDP, FSDP2, HSDP and FSDP1 on 2-4 gloo ranks (CPU).

Every child function runs on all ranks (``run_ranks``) and asserts bit-exact equality itself; full tensors
are gathered with ``full_tree`` (a collective) before the save and after the load.
"""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from dist import assert_tree_equal, full_tree, run_ranks, tree_nbytes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

VOCAB, DIM, SEQ = 96, 64, 8
CHUNK = 65536


# --------------------------------------------------------------------------------------------------------
# a tiny transformer-ish model
# --------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, d: int = DIM, n_blocks: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_blocks)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h))


def make_model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


def train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def state_of(model, opt, options=None) -> dict:
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": msd, "optim": osd}


@torch.no_grad()
def perturb(model, opt) -> None:
    """Zero every parameter and every optimizer state tensor in place."""
    for p in model.parameters():
        p.zero_()
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v.zero_()


def save_perturb_load_check(model, opt, path: str, name: str, options=None) -> dict:
    """Save model+optim, zero them, load back; assert bit-exact vs the gathered pre-save state."""
    import deltackpt

    ref = full_tree(state_of(model, opt))
    md = dcp.save(state_of(model, opt, options), storage_writer=deltackpt.DeltaStorageWriter(path, checkpoint_id=name))
    assert md.state_dict_metadata, "dcp.save returned empty metadata"
    perturb(model, opt)
    with pytest.raises(AssertionError):
        assert_tree_equal(full_tree(state_of(model, opt))["model"], ref["model"])
    sd = state_of(model, opt, options)
    dcp.load(sd, storage_reader=deltackpt.DeltaStorageReader(path, name))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
    n = assert_tree_equal(full_tree(state_of(model, opt)), ref)
    assert n > 30
    return ref


@pytest.fixture
def store_path(tmp_path):
    from deltackpt.store import Store

    path = tmp_path / "store"
    Store.init(path, chunk_size_bytes=CHUNK)
    return str(path)


# --------------------------------------------------------------------------------------------------------
# b. DDP: replicated state is saved once
# --------------------------------------------------------------------------------------------------------
def _ddp(rank, world_size, path):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(seed=rank))  # DDP broadcasts rank 0's parameters
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, steps=2, seed=100 + rank)
    ref = save_perturb_load_check(model, opt, path, "ddp-1")
    # Both ranks hold the same (replicated) values.
    gathered = [None] * world_size
    dist.all_gather_object(gathered, ref)
    assert_tree_equal(gathered[1], gathered[0])
    return tree_nbytes(ref)


def test_ddp_replicated_saved_once(store_path):
    from deltackpt.store import Store

    one_copy = run_ranks(_ddp, 2, store_path, timeout=150)[0]
    stats = Store.open(store_path).read_manifest("ddp-1").stats
    # One copy of the tensors (+ a few KiB of pickled param_groups), not world_size copies.
    assert one_copy <= stats.logical_bytes < 1.25 * one_copy, (stats, one_copy)
    assert stats.stored_bytes < 1.25 * one_copy, (stats, one_copy)


# --------------------------------------------------------------------------------------------------------
# c. FSDP2
# --------------------------------------------------------------------------------------------------------
def _fsdp2(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, steps=2, seed=100 + rank)
    sd = state_of(model, opt)
    assert isinstance(sd["model"]["blocks.0.fc1.weight"], DTensor)
    assert isinstance(sd["optim"]["state"]["blocks.0.fc1.weight"]["exp_avg"], DTensor)
    ref = save_perturb_load_check(model, opt, path, "fsdp2")
    # Training continues from the loaded state identically on every rank.
    train(model, opt, steps=1, seed=7)
    after = full_tree(state_of(model, opt))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, after)
    assert_tree_equal(gathered[1], gathered[0])
    return tree_nbytes(ref)


def test_fsdp2_roundtrip(store_path):
    from deltackpt.store import Store

    one_copy = run_ranks(_fsdp2, 2, store_path, timeout=150)[0]
    stats = Store.open(store_path).read_manifest("fsdp2").stats
    assert one_copy <= stats.logical_bytes < 1.25 * one_copy, (stats, one_copy)


# --------------------------------------------------------------------------------------------------------
# d. HSDP on a 2x2 mesh
# --------------------------------------------------------------------------------------------------------
def _hsdp(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, steps=2, seed=100 + rank)
    w = state_of(model, opt)["model"]["blocks.1.qkv.weight"]
    assert isinstance(w, DTensor) and tuple(w.placements) == (Replicate(), Shard(0)), w.placements
    ref = save_perturb_load_check(model, opt, path, "hsdp")
    return tree_nbytes(ref)


def test_hsdp_2x2_roundtrip(store_path):
    from deltackpt.store import Store

    one_copy = run_ranks(_hsdp, 4, store_path, timeout=180)[0]
    stats = Store.open(store_path).read_manifest("hsdp").stats
    # The two replicas write identical boxes: DCP dedups them, so one copy is stored.
    assert one_copy <= stats.logical_bytes < 1.25 * one_copy, (stats, one_copy)


# --------------------------------------------------------------------------------------------------------
# e. FSDP1 with SHARDED_STATE_DICT (ShardedTensor)
# --------------------------------------------------------------------------------------------------------
def _fsdp1(rank, world_size, path):
    import deltackpt
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    warnings.filterwarnings("ignore")
    # No accelerator here: FSDP1 needs device_id=cpu explicitly (device_id=None refuses to run on CPU).
    model = FSDP(make_model(), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, steps=2, seed=100 + rank)
    full = StateDictOptions(full_state_dict=True)
    ref = full_tree(state_of(model, opt, full))

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    assert any(isinstance(v, ShardedTensor) for v in sd["model"].values())
    dcp.save(sd, storage_writer=deltackpt.DeltaStorageWriter(path, "fsdp1"))
    perturb(model, opt)
    with pytest.raises(AssertionError):
        assert_tree_equal(full_tree(state_of(model, opt, full))["model"], ref["model"])

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        dcp.load(sd, storage_reader=deltackpt.DeltaStorageReader(path, "fsdp1"))
        model.load_state_dict(sd["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, sd["optim"]))
    assert assert_tree_equal(full_tree(state_of(model, opt, full)), ref) > 30

    # The same checkpoint through the get_state_dict / set_state_dict API.
    perturb(model, opt)
    sd = state_of(model, opt)
    dcp.load(sd, storage_reader=deltackpt.DeltaStorageReader(path, "fsdp1"))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert_tree_equal(full_tree(state_of(model, opt, full)), ref)
    return True


def test_fsdp1_sharded_state_dict_roundtrip(store_path):
    assert run_ranks(_fsdp1, 2, store_path, timeout=150) == [True, True]


# --------------------------------------------------------------------------------------------------------
# A store directory that does not exist yet, created by the ranks' writers at the same time
# --------------------------------------------------------------------------------------------------------
def _save_to_new_store(rank, world_size, base, rounds):
    import deltackpt

    torch.manual_seed(0)
    sd = {"shared": torch.randn(128, 128), f"own.{rank}": torch.full((1000,), float(rank)), "step": 3}
    ref = full_tree(sd)
    for i in range(rounds):  # several rounds: the ranks reach the store at nearly the same time
        path = f"{base}-{i}"
        dist.barrier()
        deltackpt.save(sd, path, "first")
        dest = {"shared": torch.zeros(128, 128), f"own.{rank}": torch.zeros(1000), "step": None}
        assert deltackpt.load(dest, path) == "first"
        assert_tree_equal(dest, ref)
    return True


def test_ranks_create_missing_store_concurrently(tmp_path):
    """Every rank builds its writer on a path with no store yet: exactly one store must come out of it."""
    from deltackpt.store import Store

    base = str(tmp_path / "new-store")
    assert run_ranks(_save_to_new_store, 2, base, 6, timeout=120) == [True, True]
    for i in range(6):
        store = Store.open(f"{base}-{i}")
        assert [c.name for c in store.list_checkpoints()] == ["first"]
        assert store.read_manifest("first").store_id == store.config.store_id


def _writer_threads(rank: int, world: int, path: str):
    """The coding threads each rank's ChunkWriter got, and what one process alone would get."""
    from deltackpt import DeltaStorageWriter
    from deltackpt.store import threads as store_threads
    from deltackpt.store import writer as store_writer
    from deltackpt.store import Store

    seen = []
    real_init = store_writer.ChunkWriter.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        seen.append(self.num_threads)

    store_writer.ChunkWriter.__init__ = init
    os.environ.pop("DELTACKPT_BASE_CACHE_BYTES", None)
    store = Store.open(path)
    dcp.save({f"t{rank}": torch.randn(128, 128)}, storage_writer=DeltaStorageWriter(store, checkpoint_id="a"))
    cache = store.base_cache
    return (seen, store_threads.default_write_threads(world), store_threads.default_write_threads(1),
            cache.cap_bytes, cache.size_bytes)


def test_ranks_on_one_machine_share_its_cores(store_path, monkeypatch):
    """The coordinator counts ranks per host from the plans; each writer codes with its share of the cores.
    A multi-rank save keeps its keyframes for the next save from the first save on."""
    from deltackpt.store.basecache import AUTO_CAP_BYTES

    from deltackpt.store import threads as store_threads

    monkeypatch.setattr(store_threads, "usable_cores", lambda: 6)
    assert [store_threads.default_write_threads(n) for n in (1, 2, 3, 4, 7)] == [6, 3, 2, 1, 1]
    monkeypatch.setattr(store_threads, "usable_cores", lambda: 64)
    assert store_threads.default_write_threads(1) == 8
    for seen, shared, alone, cap, cached in run_ranks(_writer_threads, 3, store_path, timeout=120):
        assert seen == [shared]
        assert shared == max(1, min(8, alone // 3))
        assert cap == AUTO_CAP_BYTES and cached == 128 * 128 * 4


# --------------------------------------------------------------------------------------------------------
# h. failure atomicity and missing names across ranks
# --------------------------------------------------------------------------------------------------------
def _rank_state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "shared": torch.randn(256, 128, generator=g),  # 128 KiB: two chunks
        f"own.{rank}": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed * 10 + rank)),
        "meta": {"seed": seed},
    }


def _dest(rank: int) -> dict:
    return {"shared": torch.zeros(256, 128), f"own.{rank}": torch.zeros(64, 64), "meta": {"seed": None}}


def _expect_failed_save(path: str, name: str, sd: dict, failing_rank: int, expect: str) -> None:
    import deltackpt
    from deltackpt.store import Store

    with pytest.raises(CheckpointException) as ei:
        dcp.save(sd, storage_writer=deltackpt.DeltaStorageWriter(path, name))
    assert failing_rank in ei.value.failures, ei.value.failures
    assert expect in str(ei.value.failures[failing_rank][0]), ei.value.failures
    dist.barrier()
    store = Store.open(path)
    assert not store.exists(name), f"a manifest for {name!r} was written although the save failed"
    assert [c.name for c in store.list_checkpoints()] == ["good"]


def _check_good(rank: int, path: str, ref: dict) -> None:
    import deltackpt

    dest = _dest(rank)
    assert deltackpt.load(dest, path, "latest") == "good"
    assert_tree_equal(dest, ref)
    dest = _dest(rank)
    deltackpt.load(dest, path, "good")
    assert_tree_equal(dest, ref)


def _failure_atomicity(rank, world_size, path):
    import deltackpt
    import deltackpt.store.repository as repository
    import deltackpt.store.writer as store_writer

    good = _rank_state(rank, seed=1)
    ref = full_tree(good)
    deltackpt.save(good, path, "good")

    # 1) rank 1 holds a value that cannot be serialized: the write step fails on rank 1.
    bad = _rank_state(rank, seed=2)
    if rank == 1:
        bad["unpicklable"] = threading.Lock()
    _expect_failed_save(path, "bad", bad, failing_rank=1, expect="pickle")
    _check_good(rank, path, ref)

    # 2) the store layer fails on rank 1 (after rank 0 may have written its packs).
    def broken_finish(self):
        raise RuntimeError("injected ChunkWriter.finish failure")

    original_finish = store_writer.ChunkWriter.finish
    if rank == 1:
        store_writer.ChunkWriter.finish = broken_finish
    try:
        _expect_failed_save(path, "bad", _rank_state(rank, seed=3), failing_rank=1, expect="injected ChunkWriter")
    finally:
        store_writer.ChunkWriter.finish = original_finish
    _check_good(rank, path, ref)

    # 3) the commit fails on the coordinator: every rank must see the failure.
    def broken_commit(self, *args, **kwargs):
        raise RuntimeError("injected Store.commit failure")

    original_commit = repository.Store.commit
    if rank == 0:
        repository.Store.commit = broken_commit
    try:
        _expect_failed_save(path, "bad", _rank_state(rank, seed=4), failing_rank=0, expect="injected Store.commit")
    finally:
        repository.Store.commit = original_commit
    _check_good(rank, path, ref)

    # The name is still free, and a clean save under it works and loads.
    ok = _rank_state(rank, seed=5)
    deltackpt.save(ok, path, "bad")
    dest = _dest(rank)
    assert deltackpt.load(dest, path, "bad") == "bad"
    assert_tree_equal(dest, full_tree(ok))
    _check_good_by_name_only(rank, path, ref)
    return True


def _check_good_by_name_only(rank, path, ref):
    import deltackpt

    dest = _dest(rank)
    deltackpt.load(dest, path, "good")
    assert_tree_equal(dest, ref)


def test_failed_save_is_atomic_across_ranks(store_path):
    assert run_ranks(_failure_atomicity, 2, store_path, timeout=150) == [True, True]


def _load_missing(rank, world_size, path):
    import deltackpt
    from deltackpt import CheckpointNotFoundError

    good = _rank_state(rank, seed=1)
    deltackpt.save(good, path, "good")
    with pytest.raises(CheckpointNotFoundError):
        deltackpt.DeltaStorageReader(path, "nope")
    with pytest.raises(CheckpointNotFoundError):
        deltackpt.load(_dest(rank), path, "nope")
    with pytest.raises((CheckpointNotFoundError, CheckpointException)) as ei:
        dcp.load(_dest(rank), storage_reader=deltackpt.DeltaStorageReader(path), checkpoint_id="nope")
    if isinstance(ei.value, CheckpointException):
        assert all(isinstance(e, CheckpointNotFoundError) for e, _ in ei.value.failures.values())
    # The group is still healthy: a collective and a real load work afterwards.
    dist.barrier()
    dest = _dest(rank)
    deltackpt.load(dest, path, "good")
    assert_tree_equal(dest, full_tree(good))
    return True


def test_load_missing_name_raises_on_every_rank(store_path):
    assert run_ranks(_load_missing, 2, store_path, timeout=120) == [True, True]

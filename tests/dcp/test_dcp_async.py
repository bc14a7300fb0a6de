"""dcp.async_save / deltackpt.async_save with DeltaStorageWriter: THREAD without and with a process group,
PROCESS with a 2-rank gloo group. The state is mutated in place right after async_save returns; the
checkpoint must hold the values at the time of the call."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dist import assert_tree_equal, full_tree, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CHUNK = 65536


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128), nn.LayerNorm(128))


def _train(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 128, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": 11}}


@torch.no_grad()
def _mutate(model, opt) -> None:
    for p in model.parameters():
        p.add_(1)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)


def _loaded(model_factory, path: str, name: str) -> dict:
    """Load checkpoint ``name`` into a fresh model/optimizer and return its gathered state."""
    import deltackpt

    model, opt = model_factory()
    sd = _state(model, opt)
    sd["extra"] = {"step": None}
    dcp.load(sd, storage_reader=deltackpt.DeltaStorageReader(path, name))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out = full_tree(_state(model, opt))
    out["extra"] = sd["extra"]
    return out


@pytest.fixture
def store_path(tmp_path):
    from deltackpt.store import Store

    path = tmp_path / "store"
    Store.init(path, chunk_size_bytes=CHUNK)
    return str(path)


# --------------------------------------------------------------------------------------------------------
# single process, no process group, THREAD
# --------------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_async_thread_without_process_group(store_path):
    import deltackpt

    def factory():
        m = _model(seed=99)
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    model = _model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, seed=1)
    ref1 = full_tree(_state(model, opt))
    fut = dcp.async_save(_state(model, opt), storage_writer=deltackpt.DeltaStorageWriter(store_path, "a-1"),
                         async_checkpointer_type=AsyncCheckpointerType.THREAD)
    _mutate(model, opt)
    ref2 = full_tree(_state(model, opt))
    fut.result(timeout=120)

    fut2 = deltackpt.async_save(_state(model, opt), store_path, "a-2")
    _mutate(model, opt)
    fut2.result(timeout=120)

    assert_tree_equal(_loaded(factory, store_path, "a-1"), ref1)
    assert_tree_equal(_loaded(factory, store_path, "a-2"), ref2)
    with pytest.raises(AssertionError):
        assert_tree_equal(ref2["model"], ref1["model"])


# --------------------------------------------------------------------------------------------------------
# 2 ranks, FSDP2, THREAD
# --------------------------------------------------------------------------------------------------------
def _fsdp2_factory(seed: int = 99):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _model(seed)
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _async_thread_2ranks(rank, world_size, path):
    import deltackpt

    model, opt = _fsdp2_factory(seed=0)
    _train(model, opt, seed=rank)
    ref1 = full_tree(_state(model, opt))
    fut = dcp.async_save(_state(model, opt), storage_writer=deltackpt.DeltaStorageWriter(path, "t-1"),
                         async_checkpointer_type=AsyncCheckpointerType.THREAD)
    _mutate(model, opt)  # local, no collectives while the background save runs
    fut.result(timeout=120)
    ref2 = full_tree(_state(model, opt))

    fut = deltackpt.async_save(_state(model, opt), path, "t-2",
                               async_checkpointer_type=AsyncCheckpointerType.THREAD)
    _mutate(model, opt)
    fut.result(timeout=120)

    assert_tree_equal(_loaded(_fsdp2_factory, path, "t-1"), ref1)
    assert_tree_equal(_loaded(_fsdp2_factory, path, "t-2"), ref2)
    return True


def test_async_thread_two_ranks_fsdp2(store_path):
    assert run_ranks(_async_thread_2ranks, 2, store_path, timeout=150) == [True, True]


# --------------------------------------------------------------------------------------------------------
# 2 ranks, PROCESS (a background checkpoint process per rank; the writer is pickled per request)
# --------------------------------------------------------------------------------------------------------
def _async_process_2ranks(rank, world_size, path):
    import deltackpt
    import torch.distributed.checkpoint._async_process_executor as ape

    warnings.filterwarnings("ignore")
    try:
        model, opt = _fsdp2_factory(seed=0)
        _train(model, opt, seed=rank)
        ref1 = full_tree(_state(model, opt))
        fut = dcp.async_save(_state(model, opt), storage_writer=deltackpt.DeltaStorageWriter(path, "p-1"),
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        _mutate(model, opt)
        fut.result(timeout=150)
        ref2 = full_tree(_state(model, opt))

        # Second request: the same background process, a freshly pickled writer, an incremental save.
        fut = deltackpt.async_save(_state(model, opt), path, "p-2",
                                   async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        _mutate(model, opt)
        fut.result(timeout=150)

        assert_tree_equal(_loaded(_fsdp2_factory, path, "p-1"), ref1)
        assert_tree_equal(_loaded(_fsdp2_factory, path, "p-2"), ref2)
        return True
    finally:
        proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
        del proc  # __del__ asks the background process to exit and joins it


def test_async_process_two_ranks(store_path):
    from deltackpt.store import Store

    # The background processes rendezvous over TCP on MASTER_ADDR (otherwise the host's FQDN).
    assert run_ranks(_async_process_2ranks, 2, store_path, timeout=180,
                     env={"MASTER_ADDR": "127.0.0.1"}) == [True, True]
    names = [c.name for c in Store.open(store_path).list_checkpoints()]
    assert names == ["p-1", "p-2"]

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


class _FailsElsewhere:
    """Pickles in the process that made it; anywhere else (DCP's checkpoint process) it fails as a full disk."""

    def __init__(self, owner: int | None = None):
        import os

        self.owner = owner or os.getpid()

    def __reduce__(self):
        import os

        if os.getpid() != self.owner:
            raise OSError(28, "No space left on device (injected)")
        return (_FailsElsewhere, (self.owner,))


def _process_save_failing_on_rank_1(rank: int, world: int, path: str) -> dict:
    import deltackpt
    from deltackpt.store import Store
    from deltackpt.store.lock import EXCLUSIVE

    warnings.filterwarnings("ignore")
    state = {"w": torch.randn(64, 64)}
    if rank == 1:
        state["r1"] = _FailsElsewhere()
    fut = deltackpt.async_save(state, path, "step-1", async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                               replica_check="off")
    try:
        fut.result()
        failed = False
    except BaseException:  # noqa: BLE001 - the injected failure, on every rank
        failed = True
    dist.barrier()
    out = {"failed": failed}
    if rank == 0:
        try:
            with Store.open(path).lock(EXCLUSIVE, wait_s=20):
                out["gc"] = "got the store alone"
        except Exception as e:  # noqa: BLE001 - what the test reports
            out["gc"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    state.pop("r1", None)
    deltackpt.async_save(state, path, "step-2", async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                         replica_check="off").result()
    return out


def test_a_process_mode_save_that_fails_on_another_rank_leaves_no_store_lock(store_path):
    """In PROCESS mode the coordinator's store lock is taken in DCP's checkpoint process, and DCP tells no
    writer there that another rank failed: the lock stayed (refreshed) for as long as training ran, and gc
    gave up waiting for it. The writer's copy now takes the lock under an id chosen before it was sent, and
    the failed save's abort removes it."""
    from deltackpt.store import Store

    got = run_ranks(_process_save_failing_on_rank_1, 2, store_path, timeout=240, env={"MASTER_ADDR": "127.0.0.1"})
    assert [r["failed"] for r in got] == [True, True]
    assert got[0]["gc"] == "got the store alone"
    assert [c.name for c in Store.open(store_path).list_checkpoints()] == ["step-2"]


def _two_process_savers(rank: int, world: int, path: str) -> list:
    import deltackpt

    warnings.filterwarnings("ignore")
    big = {"w": torch.randn(4096, 4096)}  # 64 MiB: its save still runs when the next one starts
    small = {"ema": torch.randn(256)}
    errors = []
    for step in range(1, 4):
        big["w"].add_(1.0)
        small["ema"].add_(1.0)
        futures = [deltackpt.async_save(big, path, f"step-{step}", async_checkpointer_type=AsyncCheckpointerType.PROCESS),
                   deltackpt.async_save(small, path + "-ema", f"ema-{step}",
                                        async_checkpointer_type=AsyncCheckpointerType.PROCESS)]
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - what the test reports
                errors.append(f"step {step}: {type(e).__name__}: {e}")
    return errors


def test_two_process_mode_savers_in_one_process_take_turns(store_path):
    """Two PROCESS-mode saves at once in one process (a second CheckpointManager for an EMA copy) went through
    DCP's one checkpoint process and one pipe together, read each other's replies and both failed. They now
    take turns."""
    from deltackpt.store import Store

    assert run_ranks(_two_process_savers, 1, store_path, timeout=300, env={"MASTER_ADDR": "127.0.0.1"}) == [[]]
    assert [c.name for c in Store.open(store_path).list_checkpoints()] == ["step-1", "step-2", "step-3"]
    assert [c.name for c in Store.open(store_path + "-ema").list_checkpoints()] == ["ema-1", "ema-2", "ema-3"]


def _failed_process_save_is_let_go(rank: int, world: int, path: str) -> bool:
    import gc
    import weakref

    import deltackpt
    from deltackpt.dcp.api import one_process_save_at_a_time

    warnings.filterwarnings("ignore")
    state = {"w": torch.randn(512, 512)}
    deltackpt.async_save(state, path, "step-1", async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    writer = deltackpt.DeltaStorageWriter(path, "step-1")  # exists: this save fails
    fut = one_process_save_at_a_time(AsyncCheckpointerType.PROCESS, lambda: dcp.async_save(
        state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS))
    try:
        fut.result()
        return False
    except BaseException:  # noqa: BLE001 - expected: the name exists
        pass
    ref = weakref.ref(writer)
    del writer, fut
    gc.collect()
    return ref() is None


def test_a_failed_process_mode_save_is_not_kept_for_the_next_one(store_path):
    """The turn-taking kept the newest save's future, whose failure's traceback held the staged copy of the
    state and the writer until the next PROCESS-mode save, which might never come."""
    assert run_ranks(_failed_process_save_is_let_go, 1, store_path, timeout=180,
                     env={"MASTER_ADDR": "127.0.0.1"}) == [True]

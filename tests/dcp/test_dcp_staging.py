"""StagingBuffers / DeltaStorageWriter as DCP's AsyncStager: async saves copy into buffers reused from save to
save, the checkpoint holds the state as of the call even when training mutates it before the background save
reads anything, a change of layout re-stages, close() frees the buffers; CUDA tensors stage into pinned memory."""

from __future__ import annotations

import gc
import io
import pickle
import threading
import warnings
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import deltackpt
from deltackpt.dcp import DeltaSavePlanner, DeltaStorageWriter, StagingBuffers
from deltackpt.store import Store
from dist import run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


class GatedPlanner(DeltaSavePlanner):
    """Holds the background save before it reads any tensor until the test opens the gate."""

    def __init__(self, gate: threading.Event):
        super().__init__()
        self.gate = gate

    def create_local_plan(self):
        assert self.gate.wait(60), "the test never opened the gate"
        return super().create_local_plan()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 33, generator=g)
    return {"model": {"w": w, "tied": w, "b": torch.randn(33, generator=g).to(torch.bfloat16),
                      "t": torch.randn(8, 16, generator=g).t()},  # non-contiguous
            "optim": {"step": 3, "exp_avg": torch.randn(64, 33, generator=g)},
            "extra": {"blob": io.BytesIO(b"abc"), "ids": torch.arange(10)}}


def _clone(sd):
    if isinstance(sd, dict):
        return {k: _clone(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, io.BytesIO):
        return io.BytesIO(sd.getvalue())
    return sd


def _blank(sd):
    """A state of the same structure to load into, filled with zeros."""
    if isinstance(sd, dict):
        return {k: _blank(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype)
    if isinstance(sd, io.BytesIO):
        return io.BytesIO()
    return 0 if isinstance(sd, int) else sd


def _assert_same(got, ref):
    if isinstance(ref, dict):
        assert set(got) == set(ref)
        for k in ref:
            _assert_same(got[k], ref[k])
    elif isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                           ref.view(torch.uint8) if ref.dtype == torch.bfloat16 else ref)
    elif isinstance(ref, io.BytesIO):
        got.seek(0)
        assert got.read() == ref.getvalue()
    else:
        assert got == ref


def _load(path, name, like):
    out = _blank(like)
    deltackpt.load(out, path, name)
    return out


@torch.no_grad()
def _mutate(sd) -> None:
    sd["model"]["w"].add_(1)
    sd["model"]["b"].add_(1)
    sd["model"]["t"].mul_(2)
    sd["optim"]["exp_avg"].sub_(0.5)
    sd["optim"]["step"] += 1
    sd["extra"]["blob"].write(b"XYZ")
    sd["extra"]["ids"].add_(7)


def _ptrs(staging: StagingBuffers) -> list[int]:
    return [b.data_ptr() for b in staging._buffers]


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "store"
    Store.init(path, chunk_size_bytes=4096)
    return str(path)


def test_writer_is_an_async_stager():
    writer = DeltaStorageWriter("unused", "x")
    assert isinstance(writer, AsyncStager)
    assert not writer.should_synchronize_after_execute  # stage() returns with its copies done


def test_saves_reuse_buffers_and_hold_the_state_as_of_the_call(store_path):
    sd = _state(0)
    staging = StagingBuffers()
    refs, ptrs = {}, []
    for i in range(4):
        refs[i] = _clone(sd)
        gate = threading.Event()
        fut = deltackpt.async_save(sd, store_path, f"c-{i}", staging=staging, planner=GatedPlanner(gate))
        _mutate(sd)  # after the stall, before the background save has read a byte
        gate.set()
        fut.result(timeout=120)
        ptrs.append(_ptrs(staging))
    assert ptrs[0] and all(p == ptrs[0] for p in ptrs)  # the same buffers every save
    # one copy of the state: tied weights share a buffer
    tensors = [sd["model"]["w"], sd["model"]["b"], sd["model"]["t"], sd["optim"]["exp_avg"], sd["extra"]["ids"]]
    assert staging.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    for i, ref in refs.items():
        got = _load(store_path, f"c-{i}", ref)
        _assert_same(got, ref)
    with pytest.raises(AssertionError):
        _assert_same(refs[3], refs[2])  # the mutations were real


def test_staged_copy_aliases_nothing_of_the_state():
    sd = _state(1)
    staging = StagingBuffers()
    staged = staging.stage(sd)
    live = {t.untyped_storage().data_ptr() for t in (sd["model"]["w"], sd["model"]["b"], sd["model"]["t"],
                                                     sd["optim"]["exp_avg"], sd["extra"]["ids"])}
    staged_ptrs = {t.untyped_storage().data_ptr() for d in (staged["model"], staged["optim"], staged["extra"])
                   for t in d.values() if isinstance(t, torch.Tensor)}
    assert not live & staged_ptrs
    assert staged["model"]["tied"] is staged["model"]["w"]
    assert staged["model"]["t"].is_contiguous() and torch.equal(staged["model"]["t"], sd["model"]["t"])
    assert staged["extra"]["blob"] is not sd["extra"]["blob"]
    ref = _clone(sd)
    _mutate(sd)
    _assert_same(staged, ref)


@pytest.mark.parametrize("change", ["shape", "dtype", "new_key", "untied"])
def test_layout_change_restages(store_path, change):
    sd = _state(2)
    staging = StagingBuffers()
    deltackpt.async_save(sd, store_path, "a", staging=staging).result(timeout=120)
    before = _ptrs(staging)
    deltackpt.async_save(sd, store_path, "b", staging=staging).result(timeout=120)
    assert _ptrs(staging) == before
    if change == "shape":
        sd["optim"]["exp_avg"] = torch.randn(65, 33)
    elif change == "dtype":
        sd["optim"]["exp_avg"] = sd["optim"]["exp_avg"].double()
    elif change == "new_key":
        sd["optim"]["exp_avg_sq"] = torch.rand(64, 33)
    else:
        sd["model"]["tied"] = sd["model"]["w"].clone()
    ref = _clone(sd)
    fut = deltackpt.async_save(sd, store_path, "c", staging=staging)
    _mutate(sd)
    fut.result(timeout=120)
    assert _ptrs(staging) != before
    _assert_same(_load(store_path, "c", ref), ref)


def test_close_frees_the_buffers(store_path):
    sd = _state(3)
    staging = StagingBuffers()
    deltackpt.async_save(sd, store_path, "a", staging=staging).result(timeout=120)
    assert staging.nbytes > 0
    gone = [weakref.ref(b) for b in staging._buffers]
    staging.close()
    gc.collect()
    assert staging.nbytes == 0 and all(r() is None for r in gone)
    # usable again: a later save stages into new buffers
    ref = _clone(sd)
    deltackpt.async_save(sd, store_path, "b", staging=staging).result(timeout=120)
    _assert_same(_load(store_path, "b", ref), ref)


def test_stage_waits_for_the_save_still_using_the_buffers(store_path):
    sd = _state(4)
    staging = StagingBuffers()
    gate = threading.Event()
    ref = _clone(sd)
    fut = deltackpt.async_save(sd, store_path, "a", staging=staging, planner=GatedPlanner(gate))
    _mutate(sd)
    second = threading.Thread(target=lambda: deltackpt.async_save(sd, store_path, "b", staging=staging)
                              .result(timeout=120))
    second.start()  # would overwrite the buffers the first save has not read yet
    second.join(0.5)
    assert second.is_alive()  # it waits for the first save
    gate.set()
    fut.result(timeout=120)
    second.join(120)
    _assert_same(_load(store_path, "a", ref), ref)


def test_writer_pickles_without_its_buffers():
    sd = {"w": torch.zeros(1 << 18)}  # 1 MiB
    writer = DeltaStorageWriter("unused", "x")
    writer.stage(sd)
    assert len(pickle.dumps(writer)) < 64 << 10
    writer.close()
    assert writer._staging.nbytes == 0


def test_dcp_async_save_with_a_reused_writer(store_path):
    sd = _state(5)
    writer = DeltaStorageWriter(store_path, "d-0")
    refs, ptrs = [], []
    for i in range(3):
        refs.append(_clone(sd))
        fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=f"d-{i}", planner=DeltaSavePlanner())
        _mutate(sd)
        fut.result(timeout=120)
        ptrs.append(_ptrs(writer._staging))
    writer.close()
    assert ptrs[0] == ptrs[1] == ptrs[2]
    for i, ref in enumerate(refs):
        _assert_same(_load(store_path, f"d-{i}", ref), ref)


def test_manager_stages_into_one_set_of_buffers(store_path):
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters())
    state = deltackpt.TrainState(model=model, optimizer=opt)
    ptrs = []
    mgr = deltackpt.CheckpointManager(store_path, state, every_n_steps=1, async_mode="thread")
    for step in range(1, 4):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        mgr.save(step)
        mgr.wait()
        ptrs.append(_ptrs(mgr._staging))
    assert ptrs[0] and ptrs[0] == ptrs[1] == ptrs[2]
    mgr.close()
    assert mgr._staging.nbytes == 0


def _process_saves(rank, world_size, path):
    import torch.distributed.checkpoint._async_process_executor as ape

    warnings.filterwarnings("ignore")
    try:
        sd = _state(6)
        staging = StagingBuffers(share_memory=True)
        refs = []
        for i in range(3):
            refs.append(_clone(sd))
            fut = deltackpt.async_save(sd, path, f"p-{i}", staging=staging,
                                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            _mutate(sd)
            fut.result(timeout=150)
        assert all(b.is_shared() for b in staging._buffers)
        for i, ref in enumerate(refs):
            _assert_same(_load(path, f"p-{i}", ref), ref)
        return True
    finally:
        proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
        del proc  # __del__ asks the background process to exit and joins it


@pytest.mark.distributed
def test_process_mode_reuses_shared_buffers(store_path):
    assert run_ranks(_process_saves, 1, store_path, timeout=240, env={"MASTER_ADDR": "127.0.0.1"}) == [True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("share_memory", [False, True])
def test_cuda_state_stages_into_pinned_memory(store_path, share_memory):
    sd = {"w": torch.randn(1024, 257, device="cuda"), "b": torch.randn(300, device="cuda").half(),
          "cpu": torch.arange(5), "n": 1}
    staging = StagingBuffers(share_memory=share_memory)
    refs = []
    for i in range(3):
        refs.append({k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()})
        fut = deltackpt.async_save(sd, store_path, f"g-{i}", staging=staging)
        sd["w"].mul_(1.5)  # queued on the same stream after the device-to-host copies
        sd["b"].add_(1)
        fut.result(timeout=120)
        assert all(b.device.type == "cpu" for b in staging._buffers)
        assert all(b.is_pinned() for b, src in zip(staging._buffers, (sd["w"], sd["b"])))
    for i, ref in enumerate(refs):
        out = {"w": torch.zeros(1024, 257), "b": torch.zeros(300).half(), "cpu": torch.zeros(5, dtype=torch.long),
               "n": 0}
        deltackpt.load(out, store_path, f"g-{i}")
        assert torch.equal(out["w"], ref["w"]) and torch.equal(out["b"], ref["b"])
        assert torch.equal(out["cpu"], ref["cpu"]) and out["n"] == 1
    staging.close()
    assert staging.nbytes == 0

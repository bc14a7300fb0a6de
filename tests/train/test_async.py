"""Background saves: THREAD mode with retention (the kept checkpoints hold the state as of each save call, even
though training mutates it right after), background failures surfacing at the next call, and PROCESS mode on
2 ranks."""

from __future__ import annotations

import os
import time
import traceback
import warnings

import pytest
import torch

from deltackpt import CheckpointManager, DeltackptError, TrainState
from deltackpt.store import Store
from dist import assert_tree_equal, run_ranks
from train_helpers import dataset, full_state, make_model, make_optim, make_sched, shard, train_step

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _batch(rank, step):
    data = torch.stack(dataset(rank))
    return data[(4 * step) % 20:(4 * step) % 20 + 4]


def _state(seed=0):
    model = make_model(seed)
    optim = make_optim(model)
    return TrainState(model=model, optimizer=optim, scheduler=make_sched(optim))


def _step(state, step, rank=0):
    train_step(state.models["model"], state.optimizers["optim"], state.schedulers["scheduler"], _batch(rank, step))
    state.step = step


def _full(state):
    return full_state(state.models["model"], state.optimizers["optim"])


@pytest.fixture
def store_path(tmp_path):
    path = str(tmp_path / "store")
    Store.init(path)
    return path


def test_thread_saves_every_step_keep_last_2(store_path):
    state = _state()
    refs = {}
    with CheckpointManager(store_path, state, every_n_steps=1, keep_last=2, async_mode="thread") as mgr:
        for step in range(1, 6):
            _step(state, step)  # mutates the state the previous background save may still be writing
            refs[step] = _full(state)
            assert mgr.maybe_save(step)
    names = [i.name for i in Store.open(store_path).list_checkpoints()]
    assert names == ["step-00000004", "step-00000005"]

    restored = _state(seed=9)
    with CheckpointManager(store_path, restored) as mgr:
        assert mgr.restore_latest() == 5
        assert assert_tree_equal(_full(restored), refs[5]) >= 12
        assert restored.schedulers["scheduler"].last_epoch == 5
        assert mgr.restore("step-00000004") == 4  # a snapshot from before step 5 trained in place
        assert assert_tree_equal(_full(restored), refs[4]) >= 12


def _await_background(mgr, timeout=60):
    fut = mgr._pending[0]  # white-box: let the failing background save finish before the next call
    deadline = time.monotonic() + timeout
    while not fut.done():
        assert time.monotonic() < deadline, "background save did not finish"
        time.sleep(0.05)


@pytest.mark.parametrize("surface", ["maybe_save_on_cadence", "maybe_save_off_cadence", "wait", "close", "exit"])
def test_thread_background_failure_is_raised(store_path, monkeypatch, surface):
    from deltackpt.dcp.writer import DeltaStorageWriter

    def boom(self, metadata, results):
        raise RuntimeError("injected finish failure")

    monkeypatch.setattr(DeltaStorageWriter, "finish", boom)
    state = _state()
    mgr = CheckpointManager(store_path, state, every_n_steps=2, async_mode="thread")
    _step(state, 2)
    assert mgr.maybe_save(2)  # the failure happens in the background
    _await_background(mgr)
    with pytest.raises(DeltackptError) as ei:
        if surface == "maybe_save_on_cadence":
            mgr.maybe_save(4)
        elif surface == "maybe_save_off_cadence":
            mgr.maybe_save(3)
        elif surface == "wait":
            mgr.wait()
        elif surface == "close":
            mgr.close()
        else:
            with mgr:
                pass
    err = ei.value
    assert "step-00000002" in str(err) and "failed" in str(err)
    chain = "".join(traceback.format_exception(err))
    assert "injected finish failure" in chain
    assert Store.open(store_path).list_checkpoints() == []

    # Raised once, not again; the manager keeps working once the fault is gone (unless it was closed).
    monkeypatch.undo()
    if surface in ("close", "exit"):
        with pytest.raises(RuntimeError, match="closed"):
            mgr.save(4)
        return
    _step(state, 4)
    ref = _full(state)
    assert mgr.maybe_save(4)
    mgr.close()
    assert [i.name for i in Store.open(store_path).list_checkpoints()] == ["step-00000004"]
    restored = _state(seed=5)
    with CheckpointManager(store_path, restored) as m2:
        assert m2.restore_latest() == 4
    assert_tree_equal(_full(restored), ref)


def test_a_step_whose_background_save_failed_is_saved_again_on_retry(store_path, monkeypatch):
    """The final step's save failed in the background: a retry of that very step must save it, not count it
    as saved (the run's last steps were lost without a word)."""
    from deltackpt.dcp.writer import DeltaStorageWriter

    real = DeltaStorageWriter.finish
    monkeypatch.setattr(DeltaStorageWriter, "finish", lambda self, md, res: (_ for _ in ()).throw(OSError("once")))
    state = _state()
    mgr = CheckpointManager(store_path, state, every_n_steps=2, async_mode="thread")
    _step(state, 4)
    assert mgr.maybe_save(4, force=True)
    with pytest.raises(DeltackptError, match="step-00000004"):
        mgr.wait()
    monkeypatch.setattr(DeltaStorageWriter, "finish", real)
    assert mgr.maybe_save(4, force=True)  # saved this time
    mgr.close()
    assert [i.name for i in Store.open(store_path).list_checkpoints()] == ["step-00000004"]


def _process_mode(rank, world_size, path):
    import torch.distributed.checkpoint._async_process_executor as ape

    warnings.filterwarnings("ignore")
    try:
        model = shard(make_model(0), world_size)
        optim = make_optim(model)
        state = TrainState(model=model, optimizer=optim, scheduler=make_sched(optim))
        refs = {}
        with CheckpointManager(path, state, every_n_steps=2, async_mode="process") as mgr:
            for step in range(1, 5):
                _step(state, step, rank)
                if step % 2 == 0:
                    refs[step] = full_state(model, optim)
                mgr.maybe_save(step)
        for step in (2, 4):
            model2 = shard(make_model(1), world_size)
            optim2 = make_optim(model2)
            st2 = TrainState(model=model2, optimizer=optim2, scheduler=make_sched(optim2))
            with CheckpointManager(path, st2) as mgr:
                assert mgr.restore(f"step-{step:08d}") == step
            got = full_state(model2, optim2)
            if rank == 0:
                assert assert_tree_equal(got, refs[step]) >= 12
        return True
    finally:
        proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
        del proc  # __del__ asks the background process to exit and joins it


def test_process_mode_two_ranks(store_path):
    # The background processes rendezvous over TCP on MASTER_ADDR (otherwise the host's FQDN).
    assert run_ranks(_process_mode, 2, store_path, timeout=300, env={"MASTER_ADDR": "127.0.0.1"}) == [True, True]
    assert [i.name for i in Store.open(store_path).list_checkpoints()] == ["step-00000002", "step-00000004"]


def _thread_mode_fsdp(rank, world_size, path):
    warnings.filterwarnings("ignore")
    model = shard(make_model(0), world_size)  # FSDP2: training runs collectives while a save runs its own
    optim = make_optim(model)
    state = TrainState(model=model, optimizer=optim, scheduler=make_sched(optim))
    refs = {}
    with CheckpointManager(path, state, every_n_steps=1, async_mode="thread") as mgr:  # the default group
        assert mgr.process_group is not None  # a group of the manager's own for the save thread
        for step in range(1, 9):
            _step(state, step, rank)
            refs[step] = full_state(model, optim)
            mgr.maybe_save(step)
    model2 = shard(make_model(1), world_size)
    optim2 = make_optim(model2)
    st2 = TrainState(model=model2, optimizer=optim2, scheduler=make_sched(optim2))
    with CheckpointManager(path, st2) as mgr:
        assert mgr.restore_latest() == 8
    got = full_state(model2, optim2)  # a collective: every rank
    if rank == 0:
        assert_tree_equal(got, refs[8])
    return True


def test_thread_mode_on_the_default_group_with_fsdp_saves_every_step(store_path):
    # On one group with training's all-gathers, the save thread's collectives aborted gloo or hung.
    assert run_ranks(_thread_mode_fsdp, 2, store_path, timeout=300) == [True, True]


def _restore_during_a_save(rank, world_size, path):
    import torch.nn as nn

    import deltackpt.dcp.writer as writer

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    optim = torch.optim.Adam(model.parameters())
    state = TrainState(model=model, optimizer=optim)

    def train(step):
        model(torch.ones(2, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
        state.step = step

    with CheckpointManager(path, state, async_mode="thread") as mgr:
        train(1)
        ref = full_state(model, optim)
        mgr.save(1)
        mgr.wait()
        train(2)
        write = writer.DeltaStorageWriter._write_data

        def slow_write(self, *args, **kwargs):  # a slow disk: the save is still in flight at the restore
            time.sleep(2)
            return write(self, *args, **kwargs)

        writer.DeltaStorageWriter._write_data = slow_write
        mgr.save(2)
        step = mgr.restore("step-00000001")
        saved = [i.name for i in mgr.store.list_checkpoints()]
    assert_tree_equal(full_state(model, optim), ref)
    return step, saved


def test_a_restore_during_a_background_save_waits_for_it(store_path):
    # restore(name) did not wait (restore_latest did): its load's collectives and the save thread's met on
    # the manager's group, and every rank hung.
    for step, saved in run_ranks(_restore_during_a_save, 2, store_path, timeout=120):
        assert step == 1
        assert saved == ["step-00000001", "step-00000002"]


def _failed_manager_groups(rank, world_size, path):
    from torch.distributed import distributed_c10d as c10d

    state = _state()
    before = len(c10d._world.pg_map)
    with pytest.raises(Exception):
        CheckpointManager(path, state, async_mode="thread")  # a file, not a store: fails after making its group
    with CheckpointManager(path + "-ok", state, async_mode="thread") as mgr:  # a collective still lines up
        made = len(c10d._world.pg_map)
        assert mgr.process_group is not None
    return before, len(c10d._world.pg_map), made


def test_a_manager_that_fails_to_start_destroys_its_group(tmp_path):
    path = tmp_path / "not-a-store"
    path.write_text("a file")
    for before, after, made in run_ranks(_failed_manager_groups, 2, str(path), timeout=180):
        assert after == before and made == before + 1


def test_a_wait_cut_short_by_a_signal_leaves_the_save_for_close(tmp_path, monkeypatch):
    """A SIGTERM handler that exits (the usual preemption pattern) interrupts the wait for the last save: the
    save goes on, and close() still collects it, here uploading it to the remote (it was dropped: committed
    locally, never uploaded, on a node about to lose its disk)."""
    import signal
    import threading

    from deltackpt.dcp.writer import DeltaStorageWriter

    real = DeltaStorageWriter.write_data

    def slow(self, plan, planner):
        time.sleep(1.0)
        return real(self, plan, planner)

    monkeypatch.setattr(DeltaStorageWriter, "write_data", slow)
    old = signal.signal(signal.SIGUSR1, lambda *a: (_ for _ in ()).throw(SystemExit(143)))
    try:
        state = _state()
        mgr = CheckpointManager(tmp_path / "local", state, every_n_steps=1, async_mode="thread",
                                remote=str(tmp_path / "remote"))
        _step(state, 1)
        mgr.save(1)
        timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        timer.start()
        with pytest.raises(SystemExit):
            mgr.wait()
        timer.join()
        mgr.close()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert [i.name for i in Store.open(tmp_path / "remote").list_checkpoints()] == ["step-00000001"]


def test_process_mode_without_a_process_group_is_refused_at_once(store_path):
    with pytest.raises(ValueError, match="needs a process group"):
        CheckpointManager(store_path, _state(), async_mode="process")

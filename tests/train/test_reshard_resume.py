"""Resume a TrainState saved on 2 FSDP2 ranks on another world size: 1 process (no process group at all)
and 3 ranks (uneven shards). Model, optimizer and scheduler come back bit-exact; ranks that existed at save
time get their own RNG and dataloader position back; a new rank gets a derived, reproducible seed; training
continues and saves again on the new world size."""

from __future__ import annotations

import random
from pathlib import Path
import shutil
import warnings

import numpy as np
import pytest
import torch

from dist import assert_tree_equal, run_ranks
from train_helpers import (
    full_state,
    make_loader,
    make_model,
    make_optim,
    make_sched,
    shard,
    train_step,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

SAVED_STEP = 3


def _seed_rank(rank: int) -> None:
    random.seed(500 + rank)
    np.random.seed(500 + rank)
    torch.manual_seed(500 + rank)


def _save_at_2(rank, world_size, path):
    from deltackpt import CheckpointManager, TrainState

    warnings.filterwarnings("ignore")
    model = shard(make_model(0), world_size)
    optim = make_optim(model)
    sched = make_sched(optim)
    loader = make_loader(rank)
    _seed_rank(rank)
    it = iter(loader)
    for _ in range(SAVED_STEP):
        train_step(model, optim, sched, next(it))
    state = TrainState(model=model, optimizer=optim, scheduler=sched, dataloader=loader)
    rng = torch.get_rng_state()
    mgr = CheckpointManager(path, state, every_n_steps=3)
    assert mgr.maybe_save(SAVED_STEP)
    mgr.close()
    assert torch.equal(torch.get_rng_state(), rng), "saving drew from the torch generator"
    next_batch = next(it)  # what this rank's loader yields right after the save
    ref = full_state(model, optim)
    return {"rng": rng, "next_batch": next_batch, "sched": sched.state_dict(), "ref": ref if rank == 0 else None}


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    from deltackpt.store import Store

    path = str(tmp_path_factory.mktemp("reshard") / "store")
    Store.init(path)
    out = run_ranks(_save_at_2, 2, path, timeout=180)
    assert not torch.equal(out[0]["rng"], out[1]["rng"])
    assert not torch.equal(out[0]["next_batch"], out[1]["next_batch"])
    assert out[0]["ref"]["optim"]["state"], "no optimizer state saved"
    return path, out


def _copy_store(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("cache"))
    return dst


def _fresh_state(rank, world_size, sharded: bool):
    from deltackpt import TrainState

    model = make_model(1234 + world_size)
    if sharded:
        model = shard(model, world_size)
    optim = make_optim(model)
    sched = make_sched(optim)
    loader = make_loader(rank)
    return TrainState(model=model, optimizer=optim, scheduler=sched, dataloader=loader)


def _restore_and_continue(rank, world_size, path, expect, sharded=True):
    """Restore at this world size (twice, to check determinism), compare, train 2 steps, save step 5."""
    from deltackpt import CheckpointManager

    warnings.filterwarnings("ignore")
    results = {}
    for attempt in range(2):
        torch.manual_seed(99 + attempt)  # restore must overwrite whatever the generators held
        random.seed(99 + attempt)
        np.random.seed(99 + attempt)
        state = _fresh_state(rank, world_size, sharded)
        with CheckpointManager(path, state, every_n_steps=1) as mgr:
            assert mgr.restore_latest() == SAVED_STEP
        assert state.step == SAVED_STEP
        results[attempt] = {"rng": torch.get_rng_state(), "py": random.getstate(), "np": np.random.get_state()[1]}
    model, optim = state.models["model"], state.optimizers["optim"]
    sched = state.schedulers["scheduler"]
    full = full_state(model, optim)
    if rank == 0:
        assert assert_tree_equal(full, expect[0]["ref"]) >= 12
    assert sched.state_dict() == expect[0]["sched"]

    if rank < len(expect):  # this rank existed at save time: its own RNG and data position
        assert torch.equal(results[0]["rng"], expect[rank]["rng"])
        other = expect[1 - rank]["rng"]
        assert not torch.equal(results[0]["rng"], other)
    else:  # a new rank: derived seed, the same on both restores, unlike any saved rank's
        assert all(not torch.equal(results[0]["rng"], e["rng"]) for e in expect)
    assert torch.equal(results[0]["rng"], results[1]["rng"])
    assert results[0]["py"] == results[1]["py"]
    assert np.array_equal(results[0]["np"], results[1]["np"])
    drawn = torch.rand(4)

    batch = next(iter(state.dataloader))
    if rank < len(expect):
        assert torch.equal(batch, expect[rank]["next_batch"])

    # Keep training on the new world size and checkpoint again.
    it = iter(state.dataloader)
    losses = []
    with CheckpointManager(path, state, every_n_steps=5) as mgr:
        for step in (4, 5):
            losses.append(train_step(model, optim, sched, next(it)))
            state.step = step
            mgr.maybe_save(step)
    assert all(torch.isfinite(x) for x in losses)
    after = full_state(model, optim)
    state2 = _fresh_state(rank, world_size, sharded)
    with CheckpointManager(path, state2) as mgr:
        assert mgr.restore_latest() == 5
    again = full_state(state2.models["model"], state2.optimizers["optim"])
    if rank == 0:
        assert assert_tree_equal(again, after) >= 12
    return drawn


def test_restore_on_one_process_without_process_group(saved_at_2, tmp_path):
    import torch.distributed as dist

    src, expect = saved_at_2
    path = _copy_store(src, tmp_path / "store1")
    assert not dist.is_initialized()
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            drawn = _restore_and_continue(0, 1, path, expect, sharded=False)
        torch.set_rng_state(expect[0]["rng"])
        assert torch.equal(drawn, torch.rand(4))  # rank 0's next draw at save time
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def test_restore_on_three_ranks(saved_at_2, tmp_path):
    src, expect = saved_at_2
    path = _copy_store(src, tmp_path / "store3")
    drawn = run_ranks(_restore_and_continue, 3, path, expect, timeout=240)
    for rank in (0, 1):
        torch.set_rng_state(expect[rank]["rng"])
        assert torch.equal(drawn[rank], torch.rand(4)), f"rank {rank} did not get its own RNG back"
    assert not torch.equal(drawn[2], drawn[0]) and not torch.equal(drawn[2], drawn[1])


def _fallback_on_two_ranks(rank, world_size, path):
    from deltackpt import CheckpointManager, TrainState
    from deltackpt.store import Store
    from deltackpt.train import manager as manager_mod

    warnings.filterwarnings("ignore")
    model = shard(make_model(0), world_size)
    optim = make_optim(model)
    state = TrainState(model=model, optimizer=optim, scheduler=make_sched(optim))
    loader = make_loader(rank)
    it = iter(loader)
    refs = {}
    with CheckpointManager(path, state, every_n_steps=1) as mgr:
        for step in (1, 2):
            train_step(model, optim, state.schedulers["scheduler"], next(it))
            state.step = step
            mgr.maybe_save(step)
            refs[step] = full_state(model, optim)
    torch.distributed.barrier()
    if rank == 0:  # a pack only step 2 uses is lost
        store = Store.open(path)
        first = {e.pack for i in store.read_manifest("step-00000001").items for e in
                 map(store.index.lookup, (r.id for r in i.chunks))}
        newest = {e.pack for i in store.read_manifest("step-00000002").items for e in
                  map(store.index.lookup, (r.id for r in i.chunks))}
        for pack in newest - first:
            (Path(path) / "packs" / pack[:2] / pack).unlink()
    torch.distributed.barrier()
    verified = []
    real = manager_mod.verify_store
    manager_mod.verify_store = lambda *a, **k: verified.append(1) or real(*a, **k)
    model = shard(make_model(7), world_size)
    optim = make_optim(model)
    fresh = TrainState(model=model, optimizer=optim, scheduler=make_sched(optim))
    with CheckpointManager(path, fresh, every_n_steps=1) as mgr:
        step = mgr.restore_latest()
    got = full_state(fresh.models["model"], fresh.optimizers["optim"])
    return step, len(verified), assert_tree_equal(got, refs[1]) if rank == 0 else None


def test_ranks_fall_back_together_on_the_coordinators_verdict(tmp_path):
    """The newest checkpoint lost a pack: every rank falls back to the one before, on one verification (the
    coordinator's), not one per rank that could each see the store at another moment."""
    from deltackpt.store import Store

    path = str(tmp_path / "store")
    Store.init(path)
    out = run_ranks(_fallback_on_two_ranks, 2, path, timeout=240)
    assert [step for step, _n, _eq in out] == [1, 1]
    assert [n for _s, n, _eq in out] == [2, 0]  # step 2 then step 1, on the coordinator only

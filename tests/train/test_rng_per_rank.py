"""Every rank's RNG state survives a save/restore at the same world size, each rank getting its *own* back.

DCP keeps a single copy of same-key plain values across ranks, so a TrainState that stored RNG under a shared
key would silently give every rank rank 0's generators; rank 1's draws must be rank 1's.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from dist import run_ranks
from train_helpers import make_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _draw() -> dict:
    return {
        "torch": torch.rand(5),
        "torch_normal": torch.randn(3),
        "python": [random.random() for _ in range(3)],
        "python_gauss": random.gauss(0.0, 1.0),  # uses (and fills) random's cached second gaussian
        "numpy": np.random.rand(4),
        "numpy_gauss": np.random.randn(),  # legacy RandomState caches the second gaussian too
    }


def _same(a: dict, b: dict) -> bool:
    return (torch.equal(a["torch"], b["torch"]) and torch.equal(a["torch_normal"], b["torch_normal"])
            and a["python"] == b["python"] and a["python_gauss"] == b["python_gauss"]
            and np.array_equal(a["numpy"], b["numpy"]) and a["numpy_gauss"] == b["numpy_gauss"])


def _save_draw_restore(rank, world_size, path):
    from deltackpt import CheckpointManager, TrainState

    warnings.filterwarnings("ignore")
    model = make_model(0)  # replicated plain module: the state also holds identical same-key tensors
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)
    _draw()
    # Leave a cached gaussian in Python's and NumPy's generators: an odd number of normal draws.
    random.gauss(0.0, 1.0)
    np.random.randn(1)
    state = TrainState(model=model)
    with CheckpointManager(path, state, every_n_steps=1) as mgr:  # both ranks create the store (race)
        store_id = mgr.store.config.store_id
        mgr.maybe_save(1)
    after_save = _draw()
    _draw()  # move on
    torch.manual_seed(12345)  # and even reseed identically on every rank
    random.seed(12345)
    np.random.seed(12345)
    state2 = TrainState(model=make_model(1))
    with CheckpointManager(path, state2) as mgr:
        assert mgr.restore_latest() == 1
    after_restore = _draw()
    assert _same(after_restore, after_save), f"rank {rank}: restored RNG does not continue where the save left it"
    return {**after_save, "store_id": store_id}


def test_each_rank_gets_its_own_rng_back(tmp_path):
    from deltackpt.store import Store

    path = str(tmp_path / "store")  # does not exist yet: every rank's CheckpointManager opens-or-creates it
    out = run_ranks(_save_draw_restore, 2, path, timeout=120)
    assert out[0]["store_id"] == out[1]["store_id"] == Store.open(path).config.store_id
    r0, r1 = out
    # Rank 1's values are rank 1's, not a copy of rank 0's (each generator family on its own).
    assert not torch.equal(r0["torch"], r1["torch"])
    assert r0["python"] != r1["python"]
    assert not np.array_equal(r0["numpy"], r1["numpy"])
    # And they are exactly what a rank seeded like that rank draws at that point (saving draws nothing).
    rng_state = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        for rank, got in enumerate(out):
            random.seed(10 + rank)
            np.random.seed(20 + rank)
            torch.manual_seed(30 + rank)
            _draw()
            random.gauss(0.0, 1.0)
            np.random.randn(1)
            assert _same(_draw(), got), f"rank {rank} drew another rank's numbers"
    finally:
        torch.set_rng_state(rng_state[0])
        random.setstate(rng_state[1])
        np.random.set_state(rng_state[2])


def _fake_cuda(monkeypatch, n: int) -> dict:
    """n CUDA devices as far as the RNG capture and restore can tell (this machine has none)."""
    states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(n)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [states[i].clone() for i in range(n)])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: states.__setitem__(int(d), s.clone()))
    return states


@pytest.mark.parametrize("saved_gpus,resumed_gpus", [(0, 1), (1, 2)])
def test_a_checkpoint_saved_with_fewer_cuda_devices_visible_resumes_where_more_are(tmp_path, monkeypatch,
                                                                                  saved_gpus, resumed_gpus):
    """Saved on CPU (or with one GPU visible to the rank), resumed where more GPUs are visible (another node, all
    of its GPUs visible to each rank): the load's target asked for a generator per visible device and the resume
    was refused as a mismatch. The saved generators are restored; the others keep their state."""
    from deltackpt import CheckpointManager, TrainState
    from train_helpers import make_optim, make_sched

    def state():
        m = make_model(0)
        o = make_optim(m)
        return TrainState(model=m, optimizer=o, scheduler=make_sched(o))

    with monkeypatch.context() as mp:
        if saved_gpus:
            saved = _fake_cuda(mp, saved_gpus)
            saved[0][:] = 77
        with CheckpointManager(str(tmp_path / "s"), state(), every_n_steps=1) as mgr:
            mgr.save(5)
    now = _fake_cuda(monkeypatch, resumed_gpus)
    with CheckpointManager(str(tmp_path / "s"), state(), every_n_steps=1) as mgr:
        assert mgr.restore_latest() == 5
    assert now[0].tolist() == [77 if saved_gpus else 0] * 16
    assert now[resumed_gpus - 1].tolist() == [resumed_gpus - 1] * 16 if resumed_gpus > saved_gpus else True

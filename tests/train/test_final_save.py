"""The README's loop saves the last steps: ``maybe_save(step, force=step >= total)`` saves off the cadence
once, and never saves a step twice (nor one it just restored)."""

from __future__ import annotations

import pytest
import torch

from deltackpt import CheckpointManager, TrainState
from deltackpt.store import Store
from train_helpers import dataset, make_model, make_optim, make_sched, train_step

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]


def _run(path, total_steps, every):
    model = make_model(0)
    optim = make_optim(model)
    sched = make_sched(optim)
    state = TrainState(model=model, optimizer=optim, scheduler=sched)
    data = torch.stack(dataset(0))
    saved = []
    with CheckpointManager(path, state, every_n_steps=every) as mgr:
        step = mgr.restore_latest()
        while step < total_steps:
            step += 1
            train_step(model, optim, sched, data[(4 * step) % 20:(4 * step) % 20 + 4])
            state.step = step
            if mgr.maybe_save(step, force=step >= total_steps):
                saved.append(step)
        assert not mgr.maybe_save(step, force=True), "a step already saved is not saved again"
    return saved


def test_final_steps_are_saved_once(tmp_path):
    path = str(tmp_path / "s")
    assert _run(path, total_steps=12, every=5) == [5, 10, 12]
    assert [i.metadata["step"] for i in Store.open(path).list_checkpoints()] == [5, 10, 12]


def test_final_step_on_the_cadence_is_saved_once_and_a_resume_saves_nothing(tmp_path):
    path = str(tmp_path / "s")
    assert _run(path, total_steps=10, every=5) == [5, 10]
    assert _run(path, total_steps=10, every=5) == []  # restored at step 10: nothing left to save
    assert len(Store.open(path).list_checkpoints()) == 2

"""A CheckpointManager resumes from and forgets only checkpoints of its own ``name_format``: a base model saved
once and a second manager's checkpoints (an EMA copy) share the store untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import deltackpt
from deltackpt import CheckpointManager, TrainState
from deltackpt.store import Store

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]


def _train_two_managers(path: str, steps: int, **kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    model, ema = nn.Linear(8, 8), nn.Linear(8, 8)
    main = CheckpointManager(path, TrainState(model=model), every_n_steps=1, keep_last=2, **kwargs)
    side = CheckpointManager(path, TrainState(model=ema), every_n_steps=1, keep_last=2, name_format="ema-{step:08d}",
                             **kwargs)
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
            ema.weight.mul_(0.5).add_(model.weight, alpha=0.5)
        main.maybe_save(step)
        side.maybe_save(step)
    main.close()
    side.close()
    return model.weight.detach().clone()


def test_a_second_manager_in_the_store_neither_is_resumed_from_nor_forgets_this_ones(tmp_path):
    path = str(tmp_path / "s")
    deltackpt.save({"w": torch.ones(3)}, path, "base")  # a base model, saved once
    trained = _train_two_managers(path, 4)
    assert Store.open(path).checkpoint_names() == sorted(
        ["base", "step-00000003", "step-00000004", "ema-00000003", "ema-00000004"])
    model = nn.Linear(8, 8)
    with CheckpointManager(path, TrainState(model=model)) as mgr:
        assert mgr.restore_latest() == 4  # its own newest, not the EMA manager's (saved after it)
    assert torch.equal(model.weight, trained)


def test_with_a_remote_both_retentions_leave_other_names_alone(tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    deltackpt.save({"w": torch.ones(3)}, local, "base")
    _train_two_managers(local, 4, remote=remote)
    assert Store.open(remote).checkpoint_names() == sorted(
        ["base", "step-00000003", "step-00000004", "ema-00000003", "ema-00000004"])
    assert "base" in Store.open(local).checkpoint_names()


@pytest.mark.parametrize("bad", ["latest", "run-{epoch}-{step}", "step-{step:x}", "ckpt-{step}-{step}"])
def test_a_name_format_without_exactly_one_decimal_step_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="name_format"):
        CheckpointManager(str(tmp_path / "s"), TrainState(model=nn.Linear(2, 2)), name_format=bad)

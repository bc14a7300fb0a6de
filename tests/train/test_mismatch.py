"""Restoring into an incompatible training state raises CheckpointMismatchError naming what differs, before
touching the state, and leaves the store byte-identical."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deltackpt import CheckpointManager, CheckpointMismatchError, TrainState
from deltackpt.store import Store
from dist import assert_tree_equal
from train_helpers import MLP, dataset, full_state, hash_tree, make_model, make_optim, train_step

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class Renamed(MLP):
    """fc2 is called ``middle`` here."""

    def __init__(self):
        super().__init__()
        self.middle = self.fc2
        del self.fc2

    def forward(self, x):
        return self.fc3(torch.relu(self.middle(torch.relu(self.fc1(x)))))


class Wider(MLP):
    """fc2 has 97 outputs instead of 96 (and fc3 97 inputs)."""

    def __init__(self):
        super().__init__()
        self.fc2 = nn.Linear(64, 97)
        self.fc3 = nn.Linear(97, 10)


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "store")
    Store.init(path)
    model = make_model(0)
    optim = make_optim(model, "adamw")
    train_step(model, optim, None, torch.stack(dataset(0))[:4])
    with CheckpointManager(path, TrainState(model=model, optimizer=optim)) as mgr:
        mgr.save(1)
    return path


def _attempt(path, model, optim):
    before_store = hash_tree(path)
    before_state = full_state(model, optim)
    state = TrainState(model=model, optimizer=optim, step=7, epoch=2)
    with CheckpointManager(path, state) as mgr:
        with pytest.raises(CheckpointMismatchError) as ei:
            mgr.restore_latest()
    assert hash_tree(path) == before_store, "a failed restore changed the store"
    assert (state.step, state.epoch) == (7, 2)
    assert_tree_equal(full_state(model, optim), before_state)  # state untouched
    return str(ei.value)


def test_renamed_parameter(saved):
    torch.manual_seed(1)
    model = Renamed()
    msg = _attempt(saved, model, make_optim(model))
    assert "step-00000001" in msg
    for key in ("missing in checkpoint: train.model.middle.weight", "missing in checkpoint: train.model.middle.bias",
                "not in the model/optimizer now: train.model.fc2.weight",
                "not in the model/optimizer now: train.model.fc2.bias"):
        assert key in msg, msg
    assert "fc1" not in msg and "fc3" not in msg, msg


def test_changed_shape(saved):
    torch.manual_seed(1)
    model = Wider()
    msg = _attempt(saved, model, make_optim(model))
    for key in ("shape of train.model.fc2.weight: checkpoint [96, 64], now [97, 64]",
                "shape of train.model.fc2.bias: checkpoint [96], now [97]",
                "shape of train.model.fc3.weight: checkpoint [10, 96], now [10, 97]"):
        assert key in msg, msg
    assert "fc1" not in msg and "fc3.bias" not in msg, msg


def test_other_optimizer_type(saved):
    model = make_model(1)
    msg = _attempt(saved, model, make_optim(model, "sgd"))
    assert "AdamW" in msg and "SGD" in msg, msg
    assert "optimizers" in msg


def test_matching_state_restores(saved):
    """Control: the same setup with a compatible state loads (so the errors above are about the mismatch)."""
    model = make_model(1)
    optim = make_optim(model)
    state = TrainState(model=model, optimizer=optim)
    with CheckpointManager(saved, state) as mgr:
        assert mgr.restore_latest() == 1
    ref = make_model(0)
    assert torch.equal(model.fc2.weight, _trained(ref).fc2.weight)


def _trained(model):
    optim = make_optim(model)
    train_step(model, optim, None, torch.stack(dataset(0))[:4])
    return model


@pytest.mark.parametrize("part", ["scheduler", "scaler"])
def test_a_part_the_checkpoint_lacks_is_a_mismatch_and_nothing_is_restored(tmp_path, part):
    from train_helpers import make_sched

    model = make_model(0)
    optim = make_optim(model)
    with CheckpointManager(str(tmp_path / "s"), TrainState(model=model, optimizer=optim), every_n_steps=1) as mgr:
        train_step(model, optim, None, torch.stack(dataset(0))[:4])
        mgr.save(1)
    model2 = make_model(1)
    optim2 = make_optim(model2)
    extra = {"scheduler": make_sched(optim2)} if part == "scheduler" else {"scaler": torch.amp.GradScaler("cpu")}
    before = full_state(model2, optim2)
    with CheckpointManager(str(tmp_path / "s"), TrainState(model=model2, optimizer=optim2, **extra)) as mgr:
        with pytest.raises(CheckpointMismatchError, match="saved without"):
            mgr.restore_latest()
    assert_tree_equal(full_state(model2, optim2), before)


def test_a_part_the_state_lacks_is_named_in_a_warning(tmp_path, caplog):
    """The reverse: the checkpoint has a scheduler the restoring state does not; restoring the rest is what a
    user who dropped the scheduler wants, but not silently."""
    import logging

    from train_helpers import make_sched

    model = make_model(0)
    optim = make_optim(model)
    state = TrainState(model=model, optimizer=optim, scheduler=make_sched(optim))
    with CheckpointManager(str(tmp_path / "s"), state, every_n_steps=1) as mgr:
        train_step(model, optim, state.schedulers["scheduler"], torch.stack(dataset(0))[:4])
        mgr.save(1)
    model2 = make_model(1)
    with caplog.at_level(logging.WARNING, logger="deltackpt"):
        with CheckpointManager(str(tmp_path / "s"), TrainState(model=model2, optimizer=make_optim(model2))) as mgr:
            assert mgr.restore_latest() == 1
    assert any("holds a scheduler state" in r.getMessage() for r in caplog.records)


def test_a_tensor_in_the_optimizer_param_groups_restores(tmp_path):
    """DCP keys a list's items by index (``...param_groups.0.lr``): the compatibility check once walked dicts
    only and refused every such checkpoint as "not in the model/optimizer now"."""
    def make():
        torch.manual_seed(0)
        m = nn.Linear(4, 3)
        return m, torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), foreach=False)

    m, o = make()
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    with CheckpointManager(tmp_path / "s", TrainState(m, o), every_n_steps=1) as mgr:
        mgr.save(1)
    m2, o2 = make()
    with CheckpointManager(tmp_path / "s", TrainState(m2, o2)) as mgr:
        assert mgr.restore_latest() == 1
    assert torch.equal(m2.weight, m.weight)
    assert torch.equal(o2.state[m2.weight]["exp_avg"], o.state[m.weight]["exp_avg"])
    assert torch.equal(o2.param_groups[0]["lr"], o.param_groups[0]["lr"])


def test_a_param_group_the_optimizer_now_lacks_is_a_mismatch_and_nothing_is_restored(tmp_path):
    # Torch maps param groups by parameter name: two groups saved, one now, and the second group's lr and
    # weight decay were silently replaced by the first's (the check compared tensors only).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optim = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-3},
                               {"params": model[1].parameters(), "lr": 0.5, "weight_decay": 0.3}])
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    with CheckpointManager(str(tmp_path / "s"), TrainState(model=model, optimizer=optim)) as mgr:
        mgr.save(1)
    torch.manual_seed(1)
    model2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    before = full_state(model2, optim2)
    state = TrainState(model=model2, optimizer=optim2)
    with CheckpointManager(str(tmp_path / "s"), state) as mgr:
        with pytest.raises(CheckpointMismatchError, match=r"param groups of train\.model\.optim: checkpoint 2, "
                                                          r"now 1"):
            mgr.restore("step-00000001")
    assert state.step == 0
    assert_tree_equal(full_state(model2, optim2), before)

"""TrainState contents round trip (single process): the user's ``extra`` dict, several models / optimizers /
schedulers, and the validation of which optimizer belongs to which model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deltackpt import CheckpointManager, TrainState

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

EXTRA = {"tokens_seen": 123456789, "run": "exp-a", "nested": {"best_loss": 0.25, "ids": [3, 1, 2]}}


def _save_extra(path):
    state = TrainState(model=nn.Linear(2, 2), extra=EXTRA, epoch=4)
    with CheckpointManager(path, state) as mgr:
        mgr.save(7)


def test_extra_restores_into_state_with_same_keys(tmp_path):
    path = str(tmp_path / "store")
    _save_extra(path)
    state = TrainState(model=nn.Linear(2, 2),
                       extra={"tokens_seen": 0, "run": "", "nested": {"best_loss": 0.0, "ids": [0, 0, 0]}})
    with CheckpointManager(path, state) as mgr:
        assert mgr.restore_latest() == 7
    assert (state.step, state.epoch) == (7, 4)
    assert state.extra == EXTRA
    assert type(state.extra["tokens_seen"]) is int


def test_extra_restores_into_fresh_state(tmp_path):
    path = str(tmp_path / "store")
    _save_extra(path)
    state = TrainState(model=nn.Linear(2, 2))  # the normal resume: the run's extra is not known yet
    with CheckpointManager(path, state) as mgr:
        assert mgr.restore_latest() == 7
    assert state.epoch == 4
    assert state.extra == EXTRA


def _two_models(seed):
    torch.manual_seed(seed)
    model, ema = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ema_opt = torch.optim.SGD(ema.parameters(), lr=0.1, momentum=0.9)
    scheds = [torch.optim.lr_scheduler.StepLR(opt, 2), torch.optim.lr_scheduler.ExponentialLR(ema_opt, 0.9)]
    state = TrainState(model={"model": model, "ema": ema}, optimizer={"opt": opt, "ema_opt": ema_opt},
                       scheduler=scheds)
    return state, model, ema, opt, ema_opt, scheds


def test_several_models_optimizers_schedulers(tmp_path):
    path = str(tmp_path / "store")
    state, model, ema, opt, ema_opt, scheds = _two_models(0)
    for _ in range(3):
        (model(torch.ones(1, 4)).sum() + ema(torch.ones(1, 4)).pow(2).sum()).backward()
        opt.step()
        ema_opt.step()
        for s in scheds:
            s.step()
    with CheckpointManager(path, state) as mgr:
        mgr.save(3)
    state2, model2, ema2, opt2, ema_opt2, scheds2 = _two_models(1)
    with CheckpointManager(path, state2) as mgr:
        assert mgr.restore_latest() == 3
    for a, b in ((model, model2), (ema, ema2)):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[model.weight][key], opt2.state[model2.weight][key])
    assert torch.equal(ema_opt.state[ema.bias]["momentum_buffer"], ema_opt2.state[ema2.bias]["momentum_buffer"])
    assert [s.state_dict() for s in scheds2] == [s.state_dict() for s in scheds]
    assert scheds2[1].get_last_lr() == scheds[1].get_last_lr()


def test_optimizer_must_belong_to_exactly_one_model():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    stray = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'optim' must update the parameters of exactly one model"):
        TrainState(model={"a": a, "b": b}, optimizer=stray)
    both = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"matches: \['a', 'b'\]"):
        TrainState(model={"a": a, "b": b}, optimizer=both)
    with pytest.raises(ValueError, match="at least one model"):
        TrainState(model=None)


@pytest.mark.parametrize("names", [{"model": {"meta": 0}}, {"model": {"extra": 0}}, {"model": {"a.b": 0}},
                                   {"model": {"rank0": 0}}, {"model": {"m": 0}, "scheduler": {"m": 1}},
                                   {"model": {"m": 0}, "scheduler": {"progress": 1}}])
def test_names_that_would_overwrite_other_state_are_refused(names):
    # Before, a model named "meta" was silently replaced in the saved state by TrainState's own "meta".
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    objs = [model, sched]
    kwargs = {kind: {name: objs[i] for name, i in named.items()} for kind, named in names.items()}
    with pytest.raises(ValueError, match="TrainState"):
        TrainState(**kwargs)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.spare = nn.Linear(4, 2)  # trained only from step 3 on: no optimizer state before

    def forward(self, x, step):
        return self.used(x) + (self.spare(x) if step >= 3 else 0)


def _train(model, opt, steps):
    for step in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        model(x, step).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _fresh():
    torch.manual_seed(0)
    model = _TwoHeads()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("stop", [0, 2])
def test_parameters_without_optimizer_state_resume_bit_exact(tmp_path, stop):
    # stop 0: a save before the first step (get_state_dict gave the live Adam a step of its own, and the
    # checkpoint held it: the bias correction was a step off). stop 2: a parameter not trained yet has no
    # Adam state; the restore into a fresh optimizer failed with a CheckpointMismatchError.
    ref_model, ref_opt = _fresh()
    _train(ref_model, ref_opt, range(1, 6))
    model, opt = _fresh()
    _train(model, opt, range(1, stop + 1))
    with CheckpointManager(tmp_path / "s", TrainState(model=model, optimizer=opt), every_n_steps=1) as mgr:
        mgr.save(stop)
    assert {id(p) for p in opt.state} <= {id(p) for p in model.used.parameters()}  # the live one: untouched
    model, opt = _fresh()
    with CheckpointManager(tmp_path / "s", TrainState(model=model, optimizer=opt)) as mgr:
        assert mgr.restore_latest() == stop
    assert {id(p) for p in opt.state} == ({id(p) for p in model.used.parameters()} if stop else set())
    _train(model, opt, range(stop + 1, 6))
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    if stop == 0:  # a plain load reads it too (the state torch gives an optimizer without any is saved)
        import deltackpt

        model, opt = _fresh()
        deltackpt.load({"train": TrainState(model=model, optimizer=opt)}, tmp_path / "s")


class _NestedMomentum(torch.optim.Optimizer):
    """Per-parameter state only in a nested dict (as Shampoo/SOAP-style optimizers keep theirs)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                bufs = self.state[p].setdefault("bufs", {"m1": torch.zeros_like(p), "m2": torch.zeros_like(p)})
                bufs["m1"].mul_(0.9).add_(p.grad)
                bufs["m2"].mul_(0.5).add_(p.grad)
                p.add_(bufs["m1"] + bufs["m2"], alpha=-group["lr"])


def test_an_optimizer_state_held_only_in_nested_dicts_restores(tmp_path):
    # A parameter's name was taken as its state key minus the last part ("weight.bufs" for
    # "weight.bufs.m1"): no parameter had state in the checkpoint, and the restore dropped it all.
    def make():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return model, _NestedMomentum(model.parameters())

    def step(model, opt):
        model(torch.ones(3, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    model, opt = make()
    for _ in range(3):
        step(model, opt)
    with CheckpointManager(tmp_path / "s", TrainState(model=model, optimizer=opt)) as mgr:
        mgr.save(3)
    model2, opt2 = make()
    with CheckpointManager(tmp_path / "s", TrainState(model=model2, optimizer=opt2)) as mgr:
        assert mgr.restore_latest() == 3
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p2, p)
        assert opt2.state[p2].keys() == {"bufs"}
        for buf in ("m1", "m2"):
            assert torch.equal(opt2.state[p2]["bufs"][buf], opt.state[p]["bufs"][buf])
    step(model, opt)
    step(model2, opt2)
    assert torch.equal(model2.weight, model.weight)


def test_an_lbfgs_optimizer_is_refused_with_an_error_that_names_it(tmp_path):
    # torch's get_state_dict calls LBFGS.step() without a closure: a bare "'NoneType' object is not callable".
    model = nn.Linear(4, 2)
    state = TrainState(model=model, optimizer={"lbfgs": torch.optim.LBFGS(model.parameters())})
    with CheckpointManager(tmp_path / "s", state) as mgr:
        with pytest.raises(TypeError, match=r"'lbfgs' \(torch\.optim\.LBFGS\).*closure"):
            mgr.save(1)

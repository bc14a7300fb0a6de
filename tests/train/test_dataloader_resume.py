"""Dataloader resume: a shuffled StatefulDataLoader saved through TrainState/CheckpointManager at every batch
position (incl. the last batch of an epoch and before the first batch) continues with exactly the batches of
an uninterrupted run, across epoch boundaries (each epoch reshuffles from the loader's generator)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader

from deltackpt import CheckpointManager, TrainState
from deltackpt.store import Store

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

EPOCHS, ITEMS, BATCH = 3, 10, 3
BATCHES_PER_EPOCH = 4  # 3 + 3 + 3 + 1


def _loader(num_workers: int = 0):
    return StatefulDataLoader(list(range(ITEMS)), batch_size=BATCH, shuffle=True, num_workers=num_workers,
                              generator=torch.Generator().manual_seed(7))


def _run(state: TrainState, loader, seen: list, stop_after: int | None = None, mgr=None) -> bool:
    """The example's loop. Records batches; saves and returns True after ``stop_after`` batches in total."""
    if stop_after == 0:
        mgr.save(0)
        return True
    for _epoch in range(state.epoch, EPOCHS):
        for batch in loader:
            seen.append(batch.tolist())
            state.step += 1
            if stop_after is not None and state.step == stop_after:
                mgr.save(state.step)
                return True
        state.epoch += 1
    return False


@functools.lru_cache(maxsize=None)
def _reference(num_workers: int):
    loader = _loader(num_workers)
    state = TrainState(model=nn.Linear(2, 2), dataloader=loader)
    seen: list = []
    assert not _run(state, loader, seen)
    assert len(seen) == EPOCHS * BATCHES_PER_EPOCH
    epochs = [sorted(x for b in seen[e * 4:(e + 1) * 4] for x in b) for e in range(EPOCHS)]
    assert all(e == list(range(ITEMS)) for e in epochs)
    assert seen[0:4] != seen[4:8] != seen[8:12], "epochs must be shuffled differently for this test to bite"
    return seen


@pytest.fixture(scope="module")
def reference():
    return _reference(0)


@pytest.mark.parametrize("k", range(EPOCHS * BATCHES_PER_EPOCH + 1))
def test_resume_at_every_batch_position(k, reference, tmp_path):
    _check_resume(k, reference, tmp_path, num_workers=0)


@pytest.mark.parametrize("k", [3, 4, 5, 8])
def test_resume_with_worker_processes(k, tmp_path):
    """Same with 2 loader workers (mid-epoch, last batch of an epoch, first batch of the next)."""
    _check_resume(k, _reference(2), tmp_path, num_workers=2)


def _check_resume(k, reference, tmp_path, num_workers):
    path = str(tmp_path / "store")
    Store.init(path)
    loader = _loader(num_workers)
    state = TrainState(model=nn.Linear(2, 2), dataloader=loader)
    seen: list = []
    with CheckpointManager(path, state) as mgr:
        assert _run(state, loader, seen, stop_after=k, mgr=mgr)
    assert seen == reference[:k]
    del loader, state

    loader2 = _loader(num_workers)
    next(iter(_loader()))  # unrelated use of the same seed elsewhere must not matter
    state2 = TrainState(model=nn.Linear(2, 2), dataloader=loader2)
    with CheckpointManager(path, state2) as mgr:
        assert mgr.restore_latest() == k
    assert state2.step == k
    assert state2.epoch == ((k - 1) // BATCHES_PER_EPOCH if k else 0)
    assert not _run(state2, loader2, seen)
    assert seen == reference, f"resumed after {k} batches: {seen[k:]} != {reference[k:]}"


def test_a_loader_without_a_generator_leaves_the_restored_torch_rng_as_saved(tmp_path):
    # Restored before the loader's iterator was built, the global RNG was one draw off (the iterator draws
    # its base seed from it when the loader has no generator): dropout diverged from the first step.
    def make():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), StatefulDataLoader(
            list(torch.randn(20, 4)), batch_size=4, shuffle=True)

    model, opt, loader = make()
    state = TrainState(model=model, optimizer=opt, dataloader=loader)
    it = iter(loader)
    with CheckpointManager(tmp_path / "s", state, every_n_steps=1) as mgr:
        for step in (1, 2):
            model(next(it)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.maybe_save(step)
    saved = torch.get_rng_state().clone()
    after = [torch.rand(3), next(it)]
    model, opt, loader = make()
    torch.manual_seed(123)
    state = TrainState(model=model, optimizer=opt, dataloader=loader)
    with CheckpointManager(tmp_path / "s", state) as mgr:
        assert mgr.restore_latest() == 2
    assert torch.equal(torch.get_rng_state(), saved)
    got = [torch.rand(3), next(iter(loader))]
    assert torch.equal(got[0], after[0]) and torch.equal(got[1], after[1])

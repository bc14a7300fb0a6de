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


# -- every kind of loader, resumed at each kind of position: batches and torch's RNG as uninterrupted ----------
# A loader without a generator of its own (shuffle=False, or a DistributedSampler: the usual DDP/FSDP setup)
# draws its iterator's base seed from torch's RNG: restored before that draw, the RNG went on one draw off.
# A loader with one was rebuilt while loading, before the loop's sampler.set_epoch: a DistributedSampler
# resumed in epoch >= 1 replayed epoch 0's order.

_KINDS = ["shuffle", "shuffle+generator", "sequential", "sequential+generator", "distributed",
          "distributed+generator"]
# (batches before the save, where): mid-epoch, at the last batch of an epoch (in the loop, or after the
# epoch's end), before the first batch, mid-way through the second epoch.
_POSITIONS = [(0, "batch"), (2, "batch"), (4, "batch"), (4, "epoch_end"), (6, "batch")]


def _kind_loader(kind: str, num_workers: int = 0):
    from torch.utils.data.distributed import DistributedSampler

    torch.manual_seed(0)  # shuffle=True without a generator: the sampler seeds its own from torch's RNG
    gen = torch.Generator().manual_seed(5) if kind.endswith("+generator") else None
    if kind.startswith("distributed"):
        data = list(range(16))  # 8 of them this rank's: 4 batches
        sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
        return StatefulDataLoader(data, batch_size=2, sampler=sampler, generator=gen, num_workers=num_workers)
    return StatefulDataLoader(list(range(8)), batch_size=2, shuffle=kind.startswith("shuffle"), generator=gen,
                              num_workers=num_workers)


def _kind_run(state, loader, seen, stop=None, where="batch", mgr=None) -> bool:
    """Records each batch with a draw from torch's RNG (dropout's); saves and returns True at ``stop``."""
    if stop == 0:
        mgr.save(0)
        return True
    for epoch in range(state.epoch, EPOCHS):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            seen.append((batch.tolist(), torch.rand(2).tolist()))
            state.step += 1
            if where == "batch" and state.step == stop:
                mgr.save(state.step)
                return True
        state.epoch += 1
        if where == "epoch_end" and state.step == stop:
            mgr.save(state.step)
            return True
    return False


@functools.lru_cache(maxsize=None)
def _kind_reference(kind: str, num_workers: int):
    loader = _kind_loader(kind, num_workers)
    state = TrainState(model=nn.Linear(1, 1), dataloader=loader)
    seen: list = []
    torch.manual_seed(42)
    assert not _kind_run(state, loader, seen)
    assert len(seen) == EPOCHS * 4
    return seen


def _check_kind_resume(kind, k, where, num_workers, tmp_path):
    reference = _kind_reference(kind, num_workers)
    if kind.startswith(("shuffle", "distributed")):
        assert [b for b, _ in reference[:4]] != [b for b, _ in reference[4:8]], "epochs must differ"
    loader = _kind_loader(kind, num_workers)
    state = TrainState(model=nn.Linear(1, 1), dataloader=loader)
    seen: list = []
    torch.manual_seed(42)
    with CheckpointManager(tmp_path / "s", state) as mgr:
        assert _kind_run(state, loader, seen, stop=k, where=where, mgr=mgr)
    del loader, state
    loader = _kind_loader(kind, num_workers)
    state = TrainState(model=nn.Linear(1, 1), dataloader=loader)
    torch.manual_seed(123)
    with CheckpointManager(tmp_path / "s", state) as mgr:
        assert mgr.restore_latest() == k
    assert not _kind_run(state, loader, seen)
    assert seen == reference, f"{kind}, resumed after {k} batches ({where}): {seen[k:]} != {reference[k:]}"


@pytest.mark.parametrize("k,where", _POSITIONS)
@pytest.mark.parametrize("kind", _KINDS)
def test_every_kind_of_loader_resumes_with_the_uninterrupted_batches_and_rng(kind, k, where, tmp_path):
    _check_kind_resume(kind, k, where, 0, tmp_path)


@pytest.mark.parametrize("k,where", [(2, "batch"), (4, "epoch_end"), (6, "batch")])
@pytest.mark.parametrize("kind", ["sequential", "distributed+generator"])
def test_every_kind_of_loader_resumes_with_worker_processes(kind, k, where, tmp_path):
    _check_kind_resume(kind, k, where, 2, tmp_path)


def test_a_save_right_after_a_restore_keeps_the_loaded_position_and_the_next_epoch_order(tmp_path):
    # Asked for its state before iter(), the loader built its iterator then: a DistributedSampler's order was
    # frozen at the epoch it held before the loop's set_epoch.
    loader = _kind_loader("distributed+generator")
    state = TrainState(model=nn.Linear(1, 1), dataloader=loader)
    seen: list = []
    torch.manual_seed(42)
    with CheckpointManager(tmp_path / "s", state) as mgr:
        assert _kind_run(state, loader, seen, stop=6, mgr=mgr)
    loader = _kind_loader("distributed+generator")
    state = TrainState(model=nn.Linear(1, 1), dataloader=loader)
    with CheckpointManager(tmp_path / "s", state) as mgr:
        mgr.restore_latest()
        mgr.save(7, metadata={"copy": True})  # a second checkpoint of the same position
        assert not _kind_run(state, loader, seen)
    assert seen == _kind_reference("distributed+generator", 0)


def test_a_loader_whose_torchdata_lacks_get_iterator_is_refused_up_front():
    class Loader:  # next_iter_state without _get_iterator: a torchdata this version does not know
        next_iter_state = None

        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    with pytest.raises(TypeError, match="_get_iterator"):
        TrainState(model=nn.Linear(1, 1), dataloader=Loader())

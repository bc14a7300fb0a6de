"""restore_latest falls back past a damaged newest checkpoint (logging why), refuses to silently restart when
every checkpoint is damaged, and returns 0 on an empty store."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from deltackpt import CheckpointManager, DeltackptError, TrainState
from deltackpt.store import Store
from dist import assert_tree_equal
from train_helpers import dataset, full_state, make_model, make_optim, make_sched, train_step

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

A, B = "step-00000005", "step-00000010"


def _state(seed=0):
    model = make_model(seed)
    optim = make_optim(model)
    return TrainState(model=model, optimizer=optim, scheduler=make_sched(optim))


def _train(state, steps):
    data = torch.stack(dataset(0))
    m, o, s = state.models["model"], state.optimizers["optim"], state.schedulers["scheduler"]
    for i in range(steps):
        train_step(m, o, s, data[(4 * i) % 20:(4 * i) % 20 + 4])


@pytest.fixture
def two_saves(tmp_path):
    """A store with steps 5 and 10 (the model changed in between); the full state at each."""
    path = str(tmp_path / "store")
    Store.init(path)
    state = _state()
    refs = {}
    with CheckpointManager(path, state, every_n_steps=5) as mgr:
        for step in range(1, 11):
            _train(state, 1)
            state.step = step
            if mgr.maybe_save(step):
                refs[step] = full_state(state.models["model"], state.optimizers["optim"])
    assert [i.name for i in Store.open(path).list_checkpoints()] == [A, B]
    return path, refs


def _chunks(store: Store, name: str) -> set[bytes]:
    return {ref.id for item in store.read_manifest(name).items for ref in item.chunks}


def _entry_only_in(path: str, name: str, other: str | None):
    store = Store.open(path)
    only = _chunks(store, name) - (_chunks(store, other) if other else set())
    assert only, f"{name} has no chunk of its own"
    entries = [store.index.lookup(c) for c in sorted(only)]
    entries = [e for e in entries if e is not None and e.stored_len >= 2]
    assert entries
    return max(entries, key=lambda e: e.stored_len)


def _pack_file(path: str, entry) -> str:
    return os.path.join(path, "packs", entry.pack[:2], entry.pack)


def _flip(path: str, entry) -> None:
    f = _pack_file(path, entry)
    os.chmod(f, 0o644)
    with open(f, "r+b") as fh:
        fh.seek(entry.offset + 64 + 1)
        b = fh.read(1)
        fh.seek(entry.offset + 64 + 1)
        fh.write(bytes([b[0] ^ 0x5A]))


def _restore_latest(path):
    state = _state(seed=42)
    with CheckpointManager(path, state) as mgr:
        step = mgr.restore_latest()
    return step, state


@pytest.mark.parametrize("damage", ["flip", "delete_pack"])
def test_falls_back_to_previous_intact_checkpoint(two_saves, damage, caplog):
    path, refs = two_saves
    entry = _entry_only_in(path, B, A)
    if damage == "flip":
        _flip(path, entry)
    else:
        # Packs of a save hold only chunks that save added, so this leaves step 5 whole.
        store = Store.open(path)
        assert not (_chunks(store, A) & {e.chunk_id for e in store.index.iter_entries() if e.pack == entry.pack})
        os.remove(_pack_file(path, entry))
    with caplog.at_level(logging.WARNING, logger="deltackpt.train"):
        step, state = _restore_latest(path)
    assert step == 5 and state.step == 5
    assert assert_tree_equal(full_state(state.models["model"], state.optimizers["optim"]), refs[5]) >= 12
    msgs = [r.getMessage() for r in caplog.records if r.name == "deltackpt.train" and r.levelno == logging.WARNING]
    assert any(B in m and "damaged" in m for m in msgs), msgs


def test_intact_store_restores_newest(two_saves):
    path, refs = two_saves
    step, state = _restore_latest(path)
    assert step == 10
    assert assert_tree_equal(full_state(state.models["model"], state.optimizers["optim"]), refs[10]) >= 12
    with pytest.raises(AssertionError):
        assert_tree_equal(refs[10]["model"], refs[5]["model"])  # the saves differ, so fallback is visible


def test_all_checkpoints_damaged_raises(two_saves):
    path, _ = two_saves
    _flip(path, _entry_only_in(path, B, A))
    _flip(path, _entry_only_in(path, A, None))
    with pytest.raises(DeltackptError) as ei:
        _restore_latest(path)
    msg = str(ei.value)
    assert "no intact checkpoint" in msg and A in msg and B in msg


@pytest.mark.parametrize("kind", ["initialized", "missing_dir"])
def test_empty_store_returns_zero(tmp_path, kind):
    path = str(tmp_path / "store")
    if kind == "initialized":
        Store.init(path)
    state = _state(seed=3)
    before = full_state(state.models["model"], state.optimizers["optim"])
    with CheckpointManager(path, state) as mgr:
        assert mgr.restore_latest() == 0
    assert state.step == 0 and state.epoch == 0
    assert_tree_equal(full_state(state.models["model"], state.optimizers["optim"]), before)


def _flip_manifest(path: str, name: str) -> None:
    f = os.path.join(path, "manifests", name)
    os.chmod(f, 0o644)
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x5A
    open(f, "wb").write(bytes(data))


def _cold_copy(path: str, dst) -> str:
    """The store as another machine sees it: same objects, no local index cache."""
    dst = str(dst)
    shutil.copytree(path, dst, ignore=shutil.ignore_patterns("cache"))
    return dst


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_damaged_manifest_falls_back_with_warning(two_saves, cache, tmp_path, caplog):
    path, refs = two_saves
    _flip_manifest(path, B)
    if cache == "cold":
        path = _cold_copy(path, tmp_path / "cold")
    with caplog.at_level(logging.WARNING, logger="deltackpt.train"):
        step, state = _restore_latest(path)
    assert step == 5
    assert assert_tree_equal(full_state(state.models["model"], state.optimizers["optim"]), refs[5]) >= 12
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(B in m for m in messages), messages


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_all_manifests_damaged_raises(two_saves, cache, tmp_path):
    path, _ = two_saves
    _flip_manifest(path, A)
    _flip_manifest(path, B)
    if cache == "cold":
        path = _cold_copy(path, tmp_path / "cold")
    state = _state(seed=42)
    with CheckpointManager(path, state) as mgr:
        with pytest.raises(DeltackptError) as ei:
            mgr.restore_latest()
    assert A in str(ei.value) and B in str(ei.value)

"""Errors users can catch through DCP: ``deltackpt.save/load/async_save`` raise the typed deltackpt error
(not DCP's ``CheckpointException``, a BaseException), ``deltackpt.unwrap`` turns one from a plain ``dcp.save``
into it with every rank's error attached, and a damaged manifest is a ``CorruptManifestError`` naming it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import deltackpt
from deltackpt import (
    CheckpointExistsError,
    CorruptChunkError,
    CorruptManifestError,
    DeltackptError,
    DeltaStorageWriter,
    ManifestFormatError,
)
from deltackpt.store import Store
from dist import assert_tree_equal, run_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture
def store_path(tmp_path):
    path = str(tmp_path / "store")
    Store.init(path)
    return path


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, generator=g), "b": torch.randn(7, generator=g), "note": f"seed {seed}"}


def _empty() -> dict:
    return {"w": torch.zeros(300), "b": torch.zeros(7), "note": None}


# -- typed errors from save / async_save, and unwrap ---------------------------------------------------------
def test_save_to_existing_name_raises_the_typed_error(store_path):
    deltackpt.save(_state(0), store_path, "dup")
    try:
        deltackpt.save(_state(1), store_path, "dup")
    except Exception as e:  # the point: a plain `except Exception` catches it
        err = e
    else:
        pytest.fail("saving over an existing name did not raise")
    assert isinstance(err, CheckpointExistsError) and isinstance(err, DeltackptError)
    assert str(err).startswith("Checkpoint already exists: dup")
    assert set(err.rank_errors) == {0} and err.rank_errors[0] is err
    assert any("rank 0" in n for n in err.__notes__)
    dest = _empty()
    deltackpt.load(dest, store_path, "dup")
    assert_tree_equal(dest, _state(0))  # the old checkpoint is untouched


def test_unwrap_a_plain_dcp_save(store_path):
    deltackpt.save(_state(0), store_path, "dup")
    with pytest.raises(CheckpointException) as ei:
        dcp.save(_state(1), storage_writer=deltackpt.DeltaStorageWriter(store_path, "dup"))
    assert "Checkpoint already exists" in str(ei.value)  # what code written against DCP's FileSystemWriter expects
    err = deltackpt.unwrap(ei.value)
    assert isinstance(err, CheckpointExistsError) and err.name == "dup"
    assert deltackpt.unwrap(ei.value) is err and len(err.__notes__) == 1  # unwrapping twice adds nothing
    other = ValueError("not DCP's")
    assert deltackpt.unwrap(other) is other


def test_async_save_future_carries_the_typed_error(store_path):
    deltackpt.save(_state(0), store_path, "dup")
    fut = deltackpt.async_save(_state(1), store_path, "dup")
    assert isinstance(fut.exception(timeout=120), CheckpointExistsError)
    with pytest.raises(CheckpointExistsError, match="^Checkpoint already exists: dup"):
        fut.result()
    ok = deltackpt.async_save(_state(2), store_path, "next")
    assert ok.result(timeout=120) is not None
    dest = _empty()
    assert deltackpt.load(dest, store_path) == "next"
    assert_tree_equal(dest, _state(2))


# -- damaged manifests ---------------------------------------------------------------------------------------
def _damage_manifest(store_path: str, name: str) -> None:
    path = f"{store_path}/manifests/{name}"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x5A
    open(path, "wb").write(bytes(data))


def test_damaged_manifest_is_a_typed_error_without_logged_tracebacks(store_path, caplog):
    deltackpt.save(_state(0), store_path, "a")
    deltackpt.save(_state(1), store_path, "b")
    _damage_manifest(store_path, "b")
    caplog.set_level(logging.WARNING)
    for load in (
        lambda: deltackpt.load(_empty(), store_path, "b"),
        lambda: dcp.load(_empty(), storage_reader=deltackpt.DeltaStorageReader(store_path, "b")),
        lambda: dcp.load(_empty(), storage_reader=deltackpt.DeltaStorageReader(store_path, None),
                         checkpoint_id="b"),
    ):
        with pytest.raises(CorruptManifestError) as ei:
            load()
        assert ei.value.checkpoint == "b" and "'b'" in str(ei.value)
    assert not [r for r in caplog.records if r.name.startswith("torch")], caplog.text
    dest = _empty()
    deltackpt.load(dest, store_path, "a")
    assert_tree_equal(dest, _state(0))


def test_load_latest_with_damaged_newest_raises_unless_fallback(store_path):
    deltackpt.save(_state(0), store_path, "a")
    deltackpt.save(_state(1), store_path, "b")
    _damage_manifest(store_path, "b")
    dest = _empty()
    with pytest.raises(CorruptManifestError) as ei:
        deltackpt.load(dest, store_path)
    assert ei.value.checkpoint == "b"
    assert_tree_equal(dest, _empty())  # nothing was loaded
    assert deltackpt.load(dest, store_path, fallback=True) == "a"
    assert_tree_equal(dest, _state(0))


def test_checkpoint_not_written_through_dcp_is_a_typed_error(store_path):
    import numpy as np

    Store.open(store_path).save("raw", {"w": np.zeros(3, np.float32)})
    with pytest.raises(ManifestFormatError, match="not written through DCP"):
        deltackpt.load(_empty(), store_path, "raw")


# -- two ranks: every rank's error is attached ---------------------------------------------------------------
class _RankFailingWriter(deltackpt.DeltaStorageWriter):
    """Rank 0 fails with a foreign error, rank 1 with a deltackpt one."""

    def prepare_local_plan(self, plan):
        if dist.get_rank() == 0:
            raise RuntimeError("rank 0 foreign failure")
        raise CorruptChunkError("rank 1 damage", chunk_id="ab" * 16)


def _two_rank_errors(rank: int, world: int, store_path: str):
    out = {}
    try:
        dcp.save({"w": torch.ones(4)}, storage_writer=_RankFailingWriter(store_path, "x"))
    except CheckpointException as e:
        err = deltackpt.unwrap(e)
        out["mixed"] = (type(err).__name__, err.chunk_id, {r: type(x).__name__ for r, x in err.rank_errors.items()},
                        "\n".join(err.__notes__))
    deltackpt.save({"w": torch.ones(4)}, store_path, "dup")
    try:
        deltackpt.save({"w": torch.zeros(4)}, store_path, "dup")
    except DeltackptError as e:
        out["exists"] = (type(e).__name__, str(e), sorted(e.rank_errors))
    return out


def test_two_ranks_lowest_rank_deltackpt_error_with_all_ranks_attached(store_path):
    results = run_ranks(_two_rank_errors, 2, store_path, timeout=150)
    for out in results:
        kind, chunk_id, rank_errors, notes = out["mixed"]
        assert kind == "CorruptChunkError" and chunk_id == "ab" * 16
        assert rank_errors == {0: "RuntimeError", 1: "CorruptChunkError"}
        assert "raised on rank 1" in notes and "rank 0: RuntimeError: rank 0 foreign failure" in notes
        kind, msg, ranks = out["exists"]
        assert kind == "CheckpointExistsError" and msg.startswith("Checkpoint already exists: dup")
        assert ranks == [0, 1]


def _failed_save_worker(rank: int, world: int, store_path: str, how: str):
    import os

    from deltackpt.dcp.writer import DeltaStorageWriter
    from deltackpt.store.gc import plan_gc

    if how == "replicas":
        state = {"w": torch.ones(100) + (rank == 1)}  # replicas that differ: nothing is saved
    else:
        state = {f"w{rank}": torch.randn(64, 64), "shared": torch.ones(100)}
        real = DeltaStorageWriter._write_data

        def failing(self, *args):
            if self.rank == 1:
                raise OSError(28, "No space left on device (test)")
            return real(self, *args)

        DeltaStorageWriter._write_data = failing  # the coordinator's own write succeeds; DCP skips finish
    try:
        deltackpt.save(state, store_path, "s1")
    except (DeltackptError, OSError) as e:
        error = type(e).__name__
    dist.barrier()
    out = {"error": error, "locks": sorted(os.listdir(os.path.join(store_path, "locks")))}
    dist.barrier()  # both listed before the gc, which plans under a shared lock of its own
    if rank == 0:  # with the failed save's exception and its traceback's frames gone, not collected
        plan_gc(Store.open(store_path), grace_s=0).execute(wait_s=5)
        out["gc"] = "ran"
    dist.barrier()
    return out


@pytest.mark.parametrize("how", ["replicas", "write"])
def test_a_failed_save_releases_the_store_lock(store_path, how):
    """DCP calls no writer method when another rank's write fails, and a replica check fails inside planning:
    either way the coordinator's shared lock must go with the save, or it holds off gc (and gc new saves)."""
    results = run_ranks(_failed_save_worker, 2, store_path, how, timeout=150)
    assert all(r["error"] and r["locks"] == [] for r in results), results
    assert results[0]["gc"] == "ran"


def test_a_finish_that_fails_before_its_commit_releases_the_store_lock(store_path, monkeypatch):
    """Results that do not add up (or any error before the commit) left the shared lock held until the writer
    was collected, holding off gc meanwhile."""
    import os

    store = Store.open(store_path)
    writer = DeltaStorageWriter(store, "s1")

    real, calls = DeltaStorageWriter.storage_meta, []

    def broken_in_finish(self):  # DCP asks in planning, the writer again in finish
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("results do not add up (test)")
        return real(self)

    monkeypatch.setattr(DeltaStorageWriter, "storage_meta", broken_in_finish)
    with pytest.raises(CheckpointException, match="do not add up"):
        dcp.save({"w": torch.arange(10.0)}, storage_writer=writer)
    locks = os.path.join(store_path, "locks")
    assert not os.path.isdir(locks) or os.listdir(locks) == []
    assert writer is not None  # the writer is still alive: its finalizer did not release the lock

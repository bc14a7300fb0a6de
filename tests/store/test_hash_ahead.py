"""Chunk ids hashed ahead of the writer (ChunkWriter.hash_ahead, on another core): the same ids, refs and
packs as hashing as it goes, whatever order the arrays then come in, and the thread never outlives a writer."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from deltackpt import DeltaSavePlanner, DeltaStorageWriter
from deltackpt.store import Store, hashahead
from deltackpt.testing import SMALL_CONFIG

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not hashahead.AVAILABLE, reason="hashing ahead needs the native extension")]
MiB = 1 << 20


def _arrays(rng) -> list[tuple[np.ndarray, int]]:
    """(bytes, global offset): large and small, some at offsets off the chunk grid, one empty."""
    sizes = [3 * MiB + 5, 4, 0, MiB // 2 + 17, 2 * MiB]
    offsets = [0, 40, 0, 3 * 4096 + 8, 9 * MiB]
    return [(rng.integers(0, 256, n, dtype=np.uint8), o) for n, o in zip(sizes, offsets)]


def _write(store: Store, arrays, ahead, order) -> list:
    writer = store.writer(num_threads=1)
    writer.hash_ahead(ahead)
    for k in order:
        data, offset = arrays[k]
        writer.add_array(f"a{k}", data, dtype="uint8", elem_size=1, shape=(len(data),), group=f"g{k}",
                         global_offset=offset)
    summary = writer.finish()
    return sorted((it.key, [(c.id, c.length) for c in it.chunks]) for it in summary.items)


@pytest.mark.parametrize("case", ["all-in-order", "out-of-order", "some-not-ahead", "wrong-offset"])
def test_ids_hashed_ahead_are_the_ids_hashed_in_place(tmp_path, monkeypatch, case):
    monkeypatch.setattr(hashahead, "MIN_AHEAD_BYTES", 0)
    made = []
    real = hashahead.HashAhead
    monkeypatch.setattr(hashahead, "HashAhead", lambda arrays: made.append(len(arrays)) or real(arrays))
    arrays = _arrays(np.random.default_rng(0))
    want = _write(Store.init(tmp_path / "plain", **SMALL_CONFIG), arrays, [], range(len(arrays)))
    assert not made
    order, ahead = list(range(len(arrays))), list(arrays)
    if case == "out-of-order":
        order = [3, 0, 1, 2, 4]
    elif case == "some-not-ahead":
        ahead = [arrays[0], arrays[3]]
    elif case == "wrong-offset":
        ahead = [(arrays[0][0], 8)] + arrays[1:]
    got = _write(Store.init(tmp_path / "ahead", **SMALL_CONFIG), arrays, ahead, order)
    assert made and got == want
    assert not [t for t in threading.enumerate() if t.name == "deltackpt-hash"]


def test_a_failed_writer_stops_the_hashing_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(hashahead, "MIN_AHEAD_BYTES", 0)
    store = Store.init(tmp_path / "s", **SMALL_CONFIG)
    big = np.zeros(64 * MiB, np.uint8)
    writer = store.writer(num_threads=1)
    writer.hash_ahead([(big, 0)])
    with pytest.raises(ValueError):
        writer.add_array("bad", big, dtype="uint8", elem_size=3)
    writer.abort()
    assert not [t for t in threading.enumerate() if t.name == "deltackpt-hash"]


def test_a_dcp_save_of_cpu_tensors_hashes_ahead_and_loads_bit_exact(tmp_path, monkeypatch):
    """The DCP writer hands its CPU tensors' bytes to hash_ahead (a GPU tensor's are copied as they are added);
    the checkpoint reads back exactly, with every chunk's id checked against its bytes."""
    calls = []
    real = hashahead.HashAhead
    monkeypatch.setattr(hashahead, "HashAhead", lambda arrays: calls.append(sum(len(v) for v, _s in arrays))
                        or real(arrays))
    torch.manual_seed(0)
    state = {"w": torch.randn(1024, 1024), "b": torch.randn(1024), "t": torch.randn(64, 64).t(),
             "step": 7, "h": torch.randn(512, 1024, dtype=torch.float64)}
    store = Store.init(tmp_path / "s")
    dcp.save(state, storage_writer=DeltaStorageWriter(store, "c"), planner=DeltaSavePlanner(), no_dist=True)
    # w, b and h: views of their memory; t (transposed, not contiguous) is copied when it is added instead
    assert calls == [4 * MiB + 4096 + 4 * MiB]
    got = {"w": torch.zeros(1024, 1024), "b": torch.zeros(1024), "t": torch.zeros(64, 64), "step": 0,
           "h": torch.zeros(512, 1024, dtype=torch.float64)}
    from deltackpt import DeltaStorageReader
    dcp.load(got, storage_reader=DeltaStorageReader(Store.open(tmp_path / "s"), "c"), no_dist=True)
    assert got["step"] == 7 and all(torch.equal(got[k], state[k]) for k in ("w", "b", "t", "h"))


def test_a_planner_that_copies_tensors_has_one_copy_alive_and_resolves_each_item_once(tmp_path, monkeypatch):
    """Hashing ahead resolved every item first: a planner whose transform_object returns new tensors (a cast)
    had all its copies alive at once, and an item not hashed ahead was resolved twice. Such a planner is now
    resolved as the items are added, once each."""
    import weakref

    from deltackpt.store import writer as writer_mod

    alive, resolved = weakref.WeakSet(), []

    class CastPlanner(DeltaSavePlanner):
        def transform_object(self, write_item, obj):
            resolved.append(write_item.index.fqn)
            obj = super().transform_object(write_item, obj)
            if isinstance(obj, torch.Tensor):
                obj = obj.to(torch.float16)
                alive.add(obj)
            return obj

    peak = []
    real = writer_mod.ChunkWriter.add_array

    def spy(self, *args, **kwargs):
        peak.append(len(alive))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(writer_mod.ChunkWriter, "add_array", spy)
    state = {f"w{i}": torch.randn(512, 1024) for i in range(12)}
    store = Store.init(tmp_path / "s")
    dcp.save(state, storage_writer=DeltaStorageWriter(store, "c"), planner=CastPlanner(), no_dist=True)
    assert len(peak) == 12 and max(peak) <= 2
    assert sorted(resolved) == sorted(state)

"""gc's cost beside verify's: one listing of the packs per phase (plan, then the re-check under the lock), and
each live chunk's index record read once (the marking's look-ups are reused by the sweep) — and the single
listing, made after the manifests', is what lets the index locate every chunk a listed checkpoint uses."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from deltackpt.store import Store, codec
from deltackpt.store import gc as gc_mod
from deltackpt.store.gc import plan_gc
from deltackpt.store.index import ChunkIndex
from deltackpt.store.verify import verify_store

from store_helpers import assert_items_equal, random_array


def _drift(rng, w: np.ndarray, step: int) -> np.ndarray:
    """``w`` with every ``step``-th element changed: stored as deltas against ``w``."""
    w2 = w.copy()
    w2[::step] += rng.standard_normal(w2[::step].size).astype(np.float32)
    return w2


@pytest.fixture
def count_pack_listings(monkeypatch):
    """Counts of the backend's listings of the packs, per backend class."""
    counts: Counter = Counter()

    def counting(store):
        cls = type(store.backend)
        real = cls.list

        def listing(self, prefix=""):
            counts[prefix] += 1
            return real(self, prefix)

        monkeypatch.setattr(cls, "list", listing)
        return counts

    return counting


def test_gc_lists_the_packs_once_to_plan_and_once_to_recheck(store, rng, count_pack_listings):
    """Before: the index's first use, its refresh and gc's own listing, in each phase (5 listings from a
    Store just opened; each is a request per 1,000 packs on object storage)."""
    w = random_array(rng, "float32", (8192,))
    store.save("a", {"w": w, "dead": random_array(rng, "float32", (8192,))})
    store.save("b", {"w": w})
    store.forget("a")
    fresh = Store.open(store.backend, cache_dir=store.cache_dir)  # as `deltackpt gc` opens it
    counts = count_pack_listings(fresh)
    plan = plan_gc(fresh, grace_s=0)
    assert counts["packs/"] == 1
    result = plan.execute()
    assert counts["packs/"] == 2 and result.deleted_packs + result.repacked_packs > 0
    assert verify_store(fresh, level=2).ok
    assert_items_equal({"w": w}, fresh.load("b"))


def test_gc_reads_each_live_chunks_index_record_once(store, rng, monkeypatch):
    """The sweep reuses where the marking located each live chunk (it looked every one up a second time:
    gc cost two index look-ups per chunk, as much as verify --level 0)."""
    w = random_array(rng, "float32", (16384,))
    store.save("a", {"w": w})
    w2 = _drift(rng, w, 50)
    store.save("b", {"w": w2})
    assert any(codec.is_delta(store.index.lookup(r.id).codec) for r in store.read_manifest("b").item_map()["w"].chunks)
    store.forget("a")  # b's deltas keep a's chunks live as their bases
    located: Counter = Counter()
    real_locate, real_lookup = ChunkIndex.locate, ChunkIndex.lookup

    def locate(self, ids):
        located["ids"] += ids.size
        return real_locate(self, ids)

    def lookup(self, cid):
        located["ids"] += 1
        return real_lookup(self, cid)

    monkeypatch.setattr(ChunkIndex, "locate", locate)
    monkeypatch.setattr(ChunkIndex, "lookup", lookup)
    plan = plan_gc(store, grace_s=0)
    assert 0 < located["ids"] <= plan.live_chunks
    plan.execute()
    monkeypatch.setattr(ChunkIndex, "locate", real_locate)
    monkeypatch.setattr(ChunkIndex, "lookup", real_lookup)
    assert verify_store(store, level=2).ok
    assert_items_equal({"w": w2}, store.load("b"))


def test_a_checkpoint_committed_by_another_host_as_gc_marks_keeps_its_delta_bases(store, rng, monkeypatch):
    """Another host (its own index cache, its clock a minute behind gc's: the new pack does not look young)
    commits a checkpoint of deltas against a checkpoint that is then forgotten, just as gc begins to mark.
    gc refreshed its index from a listing of the packs made before that (the new pack unindexed), so it could
    not find the deltas' bases and deleted them: the new checkpoint lost its data. The packs are listed after
    the manifests now, so the index locates every chunk of every manifest listed."""
    w = random_array(rng, "float32", (8192,))
    store.save("a", {"w": w})
    elsewhere = Store.open(store.backend, cache_dir=store.cache_dir.parent / f"{store.cache_dir.name}-other-host")
    w2 = _drift(rng, w, 50)
    monkeypatch.setattr(gc_mod, "time", SimpleNamespace(time=lambda: time.time() + 60, monotonic=time.monotonic))
    real = gc_mod._list_manifests
    calls = []

    def list_manifests(s):
        if not calls:
            elsewhere.save("b", {"w": w2})  # deltas against a
            elsewhere.forget("a")
        calls.append(1)
        return real(s)

    monkeypatch.setattr(gc_mod, "_list_manifests", list_manifests)
    plan_gc(store, grace_s=0, max_unused=0.0).execute()
    monkeypatch.setattr(gc_mod, "_list_manifests", real)
    assert store.checkpoint_names() == ["b"]
    assert any(codec.is_delta(store.index.lookup(r.id).codec) for r in store.read_manifest("b").item_map()["w"].chunks)
    report = verify_store(store, level=2)
    assert report.ok, [p.as_dict() for p in report.problems]
    assert_items_equal({"w": w2}, store.load("b"))


def test_a_chunk_the_index_moved_since_the_marking_keeps_its_copy(store, rng, monkeypatch):
    """The sweep takes each live chunk's location from the marking's look-ups. Where the index moved a chunk
    since (another process rebuilt the shared cache), the entry it now points at must be kept: it was read as
    "a duplicate of a copy elsewhere", and that copy was this one."""
    w = random_array(rng, "float32", (8192,))
    store.save("a", {"w": w})
    store.save("b", {"w": random_array(rng, "float32", (8192,))})
    store.forget("b")  # something to collect, so the plan is acted on
    monkeypatch.setattr(gc_mod.LocatedIds, "where",
                        lambda self, store, live, at, number: np.full(len(at), -2, dtype=np.int64))
    plan_gc(store, grace_s=0, max_unused=0.0).execute()
    monkeypatch.undo()
    report = verify_store(store, level=2)
    assert report.ok, [p.as_dict() for p in report.problems]
    assert_items_equal({"w": w}, store.load("a"))

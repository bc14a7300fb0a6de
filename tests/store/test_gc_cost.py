"""gc's cost beside verify's: one listing of the packs per phase (plan, then the re-check under the lock), and
the marking read from the pack tables, the index read only for chunks stored twice or held by a pack whose
table cannot be read — and the single listing, made after the manifests', is what lets every chunk a listed
checkpoint uses be found."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from deltackpt.store import Store, codec
from deltackpt.store import gc as gc_mod
from deltackpt.store.gc import plan_gc
from deltackpt.store.index import ChunkIndex
from deltackpt.store.pack import FOOTER_SIZE, HEADER_SIZE, PackBuilder, list_packs, pack_key, read_pack_entries
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


def test_gc_marks_from_the_pack_tables_without_an_index_look_up_per_chunk(store, rng, monkeypatch):
    """The pack tables gc reads to sweep also hold each delta's base: the marking follows the chains there
    (it looked every live chunk up in the index: 1.0 of 1.9 s of a plan at 1.2M chunks), and the sweep reads
    the index only for a chunk stored twice."""
    w = random_array(rng, "float32", (16384,))
    store.save("a", {"w": w})
    w2 = _drift(rng, w, 50)
    store.save("b", {"w": w2})
    store.save("c", {"w": random_array(rng, "float32", (16384,))})
    assert any(codec.is_delta(store.index.lookup(r.id).codec) for r in store.read_manifest("b").item_map()["w"].chunks)
    store.forget("a")  # b's deltas keep a's chunks live as their bases
    store.forget("c")  # dead: something for the plan to do
    b_ids = {r.id for r in store.read_manifest("b").item_map()["w"].chunks}
    looked_up: Counter = Counter()
    real_locate, real_lookup = ChunkIndex.locate, ChunkIndex.lookup

    def locate(self, ids):
        looked_up["ids"] += ids.size
        return real_locate(self, ids)

    def lookup(self, cid):
        looked_up["ids"] += 1
        return real_lookup(self, cid)

    monkeypatch.setattr(ChunkIndex, "locate", locate)
    monkeypatch.setattr(ChunkIndex, "lookup", lookup)
    plan = plan_gc(store, grace_s=0)
    assert looked_up["ids"] == 0
    assert plan.live_chunks > len(b_ids)  # b's chunks and a's that b's deltas are coded against
    assert plan.delete_packs or plan.repack
    plan.execute()
    monkeypatch.undo()
    assert verify_store(store, level=2).ok
    assert_items_equal({"w": w2}, store.load("b"))


def test_a_live_chunk_whose_pack_table_is_unreadable_keeps_its_delta_bases(local_store, rng):
    """A pack whose table gc cannot read is left alone, and the chunks it holds are looked up in the index
    instead: their delta bases stay (here the only reason the first checkpoint's pack is live)."""
    store = local_store
    w = random_array(rng, "float32", (16384,))
    store.save("a", {"w": w})
    a_packs = {store.index.lookup(r.id).pack for r in store.read_manifest("a").item_map()["w"].chunks}
    store.save("b", {"w": _drift(rng, w, 50)})
    deltas = [store.index.lookup(r.id) for r in store.read_manifest("b").item_map()["w"].chunks]
    assert any(codec.is_delta(e.codec) for e in deltas)
    store.forget("a")
    b_packs = {e.pack for e in deltas} - a_packs
    for name in b_packs:  # damage the table's checksum: the pack's chunks still read, its table does not
        path = store.backend.local_path() / pack_key(name)
        data = bytearray(path.read_bytes())
        data[-FOOTER_SIZE - 1] ^= 0xFF
        path.write_bytes(bytes(data))
    plan = plan_gc(store, grace_s=0, max_unused=0.0)
    assert not (set(plan.delete_packs) | set(plan.repack)) & (a_packs | b_packs)
    plan.execute()
    assert all(store.backend.exists(pack_key(n)) for n in a_packs)


def _copy_of_chunks(store, entries) -> str:
    """A new pack holding a second copy of each of ``entries`` (stored bytes as they are), as an interrupted
    repack leaves one; the index still locates the first copies."""
    builder = PackBuilder(None)
    for e in entries:
        payload = store.backend.get_range(pack_key(e.pack), e.offset + HEADER_SIZE, e.stored_len)
        builder.add(e.chunk_id, e.codec, e.elem_size, e.raw_len, payload, e.base_id, e.age)
    name, size, new = builder.publish(store.backend)
    store.index.add(new, {name: size})  # ids already indexed keep their first location
    return name


@pytest.mark.parametrize("indexed", ["first", "second", "neither"])
def test_a_chunk_stored_twice_keeps_exactly_the_copy_the_index_locates(local_store, rng, indexed):
    """Of a live chunk with copies in two packs gc keeps the one the index locates (a second copy, left by an
    interrupted repack, is dead), or, when the index locates neither, one of them, and points the index at
    it; the checkpoint restores without an index rebuild either way."""
    store = local_store
    items = {"w": random_array(rng, "float32", (16384,))}
    store.save("a", items)
    entries = [store.index.lookup(r.id) for r in store.read_manifest("a").item_map()["w"].chunks]
    first_packs = {e.pack for e in entries}
    second = _copy_of_chunks(store, entries[:2])
    twice = [e.chunk_id for e in entries[:2]]
    if indexed == "second":
        store.index.relocate([e for e in read_pack_entries(store.backend, second)], {})
    elif indexed == "neither":
        store.index.relocate([dataclasses.replace(e, pack="00" * 16) for e in entries[:2]], {})
    plan = plan_gc(store, grace_s=0, max_unused=0.0)
    plan.execute()
    packs = {n: read_pack_entries(store.backend, n) for n in list_packs(store.backend)}
    held = Counter(e.chunk_id for es in packs.values() for e in es)
    assert all(held[c] == 1 for c in twice)  # one copy each, no more, no fewer
    if indexed == "first":
        assert second not in packs and first_packs <= set(packs)
    elif indexed == "second":
        assert second in packs
    for cid in twice:  # the index locates the copy that stayed
        where = store.index.lookup(cid)
        assert any(e.chunk_id == cid and e.offset == where.offset for e in packs[where.pack])
    fresh = Store.open(store.backend, cache_dir=store.cache_dir)
    assert_items_equal(items, fresh.load("a"))
    assert verify_store(store, level=2).ok


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

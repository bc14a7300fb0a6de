"""An incremental save costs what it touches: each chunk is looked up in the index once (by the writer;
the commit checks only that the packs those look-ups found still exist), the Python collector is paused
through it, and a parent map cut to one writer's byte ranges answers as the whole one does there."""

from __future__ import annotations

import gc
from collections import Counter

import msgspec
import numpy as np
import pytest

from deltackpt.errors import MissingChunkError
from deltackpt.store import ChunkRef, Item, Manifest, ParentMap, Stats, Store
from deltackpt.store import writer as writer_mod
from deltackpt.store.gc import plan_gc
from deltackpt.store.index import ChunkIndex
from deltackpt.store.pack import pack_key
from deltackpt.store.parentmap import Extent

from store_helpers import assert_items_equal, packs_of_checkpoint, random_array

CHUNK = 4096  # SMALL_CONFIG's


@pytest.fixture
def lookups(monkeypatch) -> Counter:
    """Chunk ids looked up in any index: ``["ids"]``."""
    counts: Counter = Counter()
    real_lookup, real_many, real_records = ChunkIndex.lookup, ChunkIndex.lookup_many, ChunkIndex.lookup_records

    def lookup(self, cid):
        counts["ids"] += 1
        return real_lookup(self, cid)

    def lookup_many(self, ids):
        ids = list(ids)
        counts["ids"] += len(ids)
        return real_many(self, ids)

    def lookup_records(self, ids):
        ids = list(ids)
        counts["ids"] += len(ids)
        return real_records(self, ids)

    monkeypatch.setattr(ChunkIndex, "lookup", lookup)
    monkeypatch.setattr(ChunkIndex, "lookup_many", lookup_many)
    monkeypatch.setattr(ChunkIndex, "lookup_records", lookup_records)
    return counts


def _state(rng, n_items=4, chunks_per_item=64):
    return {f"w{i}": random_array(rng, "float32", (chunks_per_item * CHUNK // 4,)) for i in range(n_items)}


def test_unchanged_save_looks_each_chunk_up_once(store, rng, lookups):
    items = _state(rng)
    store.save("a", items)
    fresh = Store.open(store.backend, cache_dir=store.cache_dir)  # no word on where "a"'s chunks are
    lookups.clear()
    m = fresh.save("b", items)
    assert m.stats.new_chunks == 0
    # Once by the writer; the commit looked every chunk (and delta base) up a second time before.
    assert lookups["ids"] == m.stats.num_chunks


def test_save_after_its_own_commit_looks_up_no_chunk_of_the_parent(store, rng, lookups, monkeypatch):
    """The Store that committed the parent knows the packs that held all its chunks: the next save reuses
    them without a look-up each (160k chunks: ~0.3 s of a 0.8 s 1 % save), and the commit checks just
    that those packs exist."""
    items = _state(rng)
    store.save("a", items)
    stats = []
    real_exists = type(store.backend).exists
    monkeypatch.setattr(type(store.backend), "exists", lambda self, key: stats.append(key) or real_exists(self, key))
    lookups.clear()
    m = store.save("b", items)
    assert (m.stats.new_chunks, lookups["ids"]) == (0, 0)
    assert {pack_key(p) for p in packs_of_checkpoint(store, "a")} <= set(stats)
    assert_items_equal(items, store.load("b"))


def test_one_percent_save_looks_up_chunks_once_plus_its_changes(store, rng, lookups):
    items = _state(rng)
    store.save("a", items)
    for a in items.values():
        a[::16 * CHUNK // 4] += 1.0  # one element of every 16th chunk
    lookups.clear()
    m = store.save("b", items)
    changed = m.stats.new_chunks
    assert 0 < changed < m.stats.num_chunks // 8
    # Per changed chunk: itself, its delta base (parent chunk and keyframe) and the commit's check of this
    # save's own new entries; the unchanged chunks are the parent's, whose packs this Store knows.
    assert lookups["ids"] <= 4 * changed


def test_chunks_the_store_holds_never_reach_the_coding_threads(store, rng, monkeypatch):
    """The caller hashes and looks up each batch itself: a save of known chunks (a fine-tune's frozen base)
    hands the coding pool nothing, and one changed chunk among them is the only span coded."""
    items = _state(rng)
    store.save("a", items)
    jobs, coded = [], []
    real_submit, real_store = writer_mod.ThreadPoolExecutor.submit, writer_mod.ChunkWriter._store_chunk
    monkeypatch.setattr(writer_mod.ThreadPoolExecutor, "submit", lambda self, fn, *a: (
        self._thread_name_prefix == "deltackpt-write" and jobs.append(fn), real_submit(self, fn, *a))[1])
    monkeypatch.setattr(writer_mod.ChunkWriter, "_store_chunk",
                        lambda self, cid, *a, **k: (coded.append(cid), real_store(self, cid, *a, **k))[1])
    m = store.save("b", {f"renamed.{k}": a for k, a in items.items()}, num_threads=2)
    assert (m.stats.new_chunks, jobs, coded) == (0, [], [])
    items["w1"][5] += 1.0
    m = store.save("c", items, num_threads=2)
    # A small chunk (4 KiB here) is coded in the caller's thread: in the pool it only contends for the GIL.
    assert (m.stats.new_chunks, len(jobs), len(coded)) == (1, 0, 1)
    assert_items_equal(items, store.load("c"))
    monkeypatch.setattr(writer_mod, "INLINE_CHUNK_BYTES", CHUNK // 2)  # now the same chunk counts as large
    items["w2"][5] += 1.0
    m = store.save("d", items, num_threads=2)
    assert (m.stats.new_chunks, len(jobs), len(coded)) == (1, 1, 2)
    assert_items_equal(items, store.load("d"))


def test_items_split_across_batches_get_the_refs_of_one_batch_each(make_store, rng, monkeypatch):
    """A writer submits runs of an item's spans (pieces) in batches; however the items are cut into
    pieces, a save refers to the same chunks and loads back exact."""
    first = {"big": random_array(rng, "float32", (37 * CHUNK // 4 + 3,)), "small": random_array(rng, "uint8", (5,)),
             "mid": random_array(rng, "float64", (5 * CHUNK // 8,))}
    refs = {}
    for batch_bytes in (1 << 30, 3 * CHUNK + 1, 1):  # all in one batch; pieces of 4 spans; a span a batch
        monkeypatch.setattr(writer_mod, "BATCH_BYTES", batch_bytes)
        store, items = make_store(), {k: a.copy() for k, a in first.items()}
        store.save("a", items)
        for a in items.values():
            a[::7 * CHUNK // a.itemsize] += 1  # one element of every 7th chunk: changed spans among reused ones
        m = store.save("b", items)
        assert 0 < m.stats.new_chunks < m.stats.num_chunks
        assert_items_equal(items, store.load("b"))
        refs[batch_bytes] = [(it.key, it.chunks) for it in m.items]
    assert refs[1 << 30] == refs[3 * CHUNK + 1] == refs[1]


def test_malformed_record_met_by_the_bulk_look_up_is_rebuilt_not_trusted(store, rng):
    items = _state(rng, n_items=2, chunks_per_item=8)
    store.save("a", items)
    victim = store.read_manifest("a").items[0].chunks[3].id
    with store.index.env.begin(write=True, db=store.index._db[b"chunks"]) as txn:
        txn.put(victim, b"short")  # a damaged cache
    m = store.save("b", items)
    assert m.stats.new_chunks == 0  # the index was rebuilt from the packs: every chunk deduplicated again
    assert store.index.lookup(victim) is not None
    assert_items_equal(items, store.load("b"))


def test_writer_reports_the_packs_its_reused_chunks_are_in(store, rng):
    items = _state(rng)
    store.save("a", items)
    w = store.writer(parent=store.read_manifest("a"))
    for key, value in items.items():
        w.add_array(key, value.view(np.uint8), dtype="<f4", elem_size=4, shape=value.shape)
    summary = w.finish()
    assert summary.entries == [] and summary.packs == {}
    assert summary.reused_packs == packs_of_checkpoint(store, "a")


def test_commit_trusting_the_writer_still_refuses_a_pack_gone_since(store, rng, lookups):
    items = _state(rng, n_items=2)
    store.save("a", items)
    w = store.writer(parent=store.read_manifest("a"))
    for key, value in items.items():
        w.add_array(key, value.view(np.uint8), dtype="<f4", elem_size=4, shape=value.shape)
    summary = w.finish()
    victim = sorted(summary.reused_packs)[0]
    store.backend.delete(pack_key(victim))  # behind the index's back, between the write and the commit
    with pytest.raises(MissingChunkError):
        store.commit("b", summary.items, entries=summary.entries, packs=summary.packs,
                     checked_packs=summary.reused_packs)
    assert not store.exists("b")


def test_save_trusting_its_last_commit_refuses_a_pack_lost_since_then_heals(store, rng):
    """A pack of the parent lost behind the index's back: the commit's check of the parent's packs finds it
    (MissingChunkError, nothing committed, as when each chunk was looked up), and the next save, trusting
    nothing, writes the lost chunks again."""
    items = _state(rng, n_items=2)
    store.save("a", items)
    victim = sorted(packs_of_checkpoint(store, "a"))[0]
    store.backend.delete(pack_key(victim))
    with pytest.raises(MissingChunkError):
        store.save("b", items)
    assert not store.exists("b")
    m = store.save("b", items)
    assert m.stats.new_chunks > 0
    assert_items_equal(items, store.load("b"))


def test_a_delta_on_a_chain_whose_keyframe_pack_was_lost_is_refused_at_commit(tmp_path, monkeypatch):
    """A new delta coded on a sparse link (read from the base cache, so nothing is read below it): the commit
    checks the packs of every link down to the keyframe, not only the base's, so a lost keyframe pack refuses
    the save instead of committing a checkpoint that does not restore (the next save then heals)."""
    from deltackpt.store import MemoryBackend

    from store_helpers import SMALL

    monkeypatch.setenv("DELTACKPT_BASE_CACHE_BYTES", str(64 << 20))
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache",
                       **{**SMALL, "chunk_size_bytes": 65536, "pack_target_bytes": 1 << 20})
    x = np.random.default_rng(0).standard_normal(4 * 16384).astype(np.float32)
    store.save("s1", {"x": x})  # keyframes
    x2 = x.copy()
    x2[::16384] += 1
    store.save("s2", {"x": x2})  # sparse links on them
    assert store.index.lookup(store.read_manifest("s2").items[0].chunks[0].id).base_id is not None
    (p1,) = packs_of_checkpoint(store, "s1")
    store.backend.delete(pack_key(p1))  # lost behind the index's back
    x3 = x2.copy()
    x3[5::16384] += 1
    with pytest.raises(MissingChunkError):
        store.save("s3", {"x": x3})
    assert not store.exists("s3")
    store.save("s3", {"x": x3})
    assert_items_equal({"x": x3}, store.load("s3"))


def test_save_trusts_only_the_parent_it_committed_itself(make_store, rng, lookups):
    """The newest checkpoint rewritten by another Store object (same name, other chunks): no trust."""
    store = make_store("local")
    items = _state(rng, n_items=2)
    store.save("a", items)
    other = Store.open(store.backend, cache_dir=store.cache_dir)
    items = _state(rng, n_items=2)
    other.save("a", items, overwrite=True)
    lookups.clear()
    m = store.save("b", items)
    assert m.stats.new_chunks == 0
    assert lookups["ids"] >= m.stats.num_chunks
    assert_items_equal(items, store.load("b"))


def test_save_after_a_gc_moved_the_parents_chunks(store, rng):
    """gc (between saves: never during one, it waits for the save's lock) repacked the pack the parent's
    chunks were in: the packs this Store remembers are gone, the commit looks the chunks up and commits."""
    items = _state(rng, n_items=1)
    store.save("a", {**items, "dead": random_array(rng, "float32", (64 * CHUNK // 4,))})
    store.save("b", items)
    old = packs_of_checkpoint(store, "b")
    store.forget("a")
    plan_gc(store, grace_s=0).execute()
    assert not old & {i.key[len("packs/"):] for i in store.backend.list("packs/")}  # moved
    m = store.save("c", items)
    assert m.stats.new_chunks == 0
    assert_items_equal(items, store.load("c"))


def test_commit_without_the_writers_word_looks_every_chunk_up(store, rng, lookups):
    items = _state(rng, n_items=2)
    m = store.save("a", items)
    packs = packs_of_checkpoint(store, "a")
    lookups.clear()
    store.commit("copy", m.items)  # a caller's own items: nothing vouches for them
    assert lookups["ids"] >= m.stats.num_chunks
    lookups.clear()
    store.commit("trusted", m.items, checked_packs=packs)
    assert lookups["ids"] == 0


def test_engine_save_pauses_the_garbage_collector(store, rng, monkeypatch):
    assert gc.isenabled()
    seen = []
    real_commit = Store.commit
    monkeypatch.setattr(Store, "commit", lambda self, *a, **k: seen.append(gc.isenabled()) or real_commit(self, *a, **k))
    real_read = Store.read_manifest
    monkeypatch.setattr(Store, "read_manifest",
                        lambda self, *a, **k: seen.append(gc.isenabled()) or real_read(self, *a, **k))
    items = _state(rng, n_items=1, chunks_per_item=4)
    store.save("a", items)
    store.save("b", items)
    assert seen and not any(seen)  # the parent manifest read and both commits ran with the collector off
    assert gc.isenabled()


# -- the part of a parent map one writer needs ---------------------------------------------------------------

def _parent(rng, store) -> ParentMap:
    items = {"t": random_array(rng, "float32", (10 * CHUNK // 4,)), "u": random_array(rng, "float32", (CHUNK,))}
    store.save("p", items)
    return ParentMap(store.read_manifest("p"))


def test_parent_map_part_answers_like_the_whole_inside_its_ranges(store, rng):
    whole = _parent(rng, store)
    lo, hi = 3 * CHUNK + 100, 6 * CHUNK - 8  # a rank whose bytes start and end inside chunks
    part = ParentMap.decode_part("p", whole.encode_part([("t", lo, hi)]))
    assert part.name == "p" and part
    assert [e.start for e in part.overlapping("t", 0, 1 << 40)] == [3 * CHUNK, 4 * CHUNK, 5 * CHUNK]
    for start, end in [(3 * CHUNK, 4 * CHUNK), (4 * CHUNK, 5 * CHUNK), (lo, hi), (4 * CHUNK + 8, 5 * CHUNK + 8)]:
        assert part.exact("t", start, end) == whole.exact("t", start, end)
        assert part.covering("t", start, end) == whole.covering("t", start, end)
    assert part.overlapping("u", 0, 1 << 40) == []  # another group's extents stay home


def test_parent_map_part_is_parsed_with_a_strict_schema(store, rng):
    whole = _parent(rng, store)
    assert not ParentMap.decode_part("p", whole.encode_part([("missing", 0, 100)]))
    with pytest.raises(msgspec.ValidationError):
        ParentMap.decode_part("p", msgspec.msgpack.encode({"t": [[0, 1, "not bytes", 0]]}))


def test_parent_map_orders_a_groups_shards_and_passes_over_empty_refs():
    ids = [bytes([i]) * 16 for i in range(4)]
    late = Item(key="t@1", kind="array", nbytes=200, group="t", global_offset=300,
                chunks=[ChunkRef(ids[0], 100), ChunkRef(ids[1], 0), ChunkRef(ids[2], 100, 5)])
    early = Item(key="t@0", kind="array", nbytes=300, group="t", chunks=[ChunkRef(ids[3], 300)])
    pm = ParentMap(Manifest(name="p", store_id="s", created_ns=0, items=[late, early], stats=Stats()))
    whole = [Extent(0, 300, ids[3], 0), Extent(300, 400, ids[0], 0), Extent(400, 500, ids[2], 5)]
    assert pm.overlapping("t", 0, 1 << 40) == whole
    assert pm.exact("t", 400, 500) == whole[2] and pm.exact("t", 300, 300) is None
    assert pm.covering("t", 250, 450) == whole and pm.covering("t", 450, 501) is None

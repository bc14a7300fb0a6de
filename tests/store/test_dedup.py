"""Deduplication: unchanged data is never stored twice; changes cost only the chunks they touch."""

from __future__ import annotations

import numpy as np
import pytest

from store_helpers import SMALL, assert_items_equal, random_array

CHUNK = SMALL["chunk_size_bytes"]


def test_unchanged_resave_stores_under_one_percent(store, rng):
    items = {
        "w": random_array(rng, "float32", (300_000,)),  # 1.2 MB, ~293 chunks
        "b": random_array(rng, "int64", (40_001,)),
        "blob": rng.bytes(200_000),
    }
    m1 = store.save("one", items)
    u1 = store.usage()
    assert m1.stats.stored_bytes > 0.5 * m1.stats.logical_bytes  # random data really was stored
    m2 = store.save("two", {k: (v.copy() if isinstance(v, np.ndarray) else bytes(v)) for k, v in items.items()})
    u2 = store.usage()
    assert m2.stats.logical_bytes == m1.stats.logical_bytes
    assert m2.stats.stored_bytes < 0.01 * m2.stats.logical_bytes
    assert m2.stats.new_chunks == 0
    assert u2.pack_bytes == u1.pack_bytes and u2.num_packs == u1.num_packs
    assert u2.physical_bytes - u1.physical_bytes < 0.01 * u1.physical_bytes
    assert u2.num_chunks == u1.num_chunks
    assert u2.num_checkpoints == 2 and u2.logical_bytes == 2 * m1.stats.logical_bytes
    assert_items_equal(items, store.load("two"))


def test_changed_middle_stores_only_changed_chunks(store, rng):
    x = random_array(rng, "float32", (100 * CHUNK // 4,))  # exactly 100 chunks
    m1 = store.save("v1", {"x": x})
    y = x.copy()
    # Change bytes [40.5 chunks, 43.25 chunks): touches chunks 40, 41, 42, 43.
    lo, hi = int(40.5 * CHUNK) // 4, int(43.25 * CHUNK) // 4
    y[lo:hi] += 1.0
    m2 = store.save("v2", {"x": y})
    assert m2.stats.new_chunks == 4
    assert m2.stats.num_chunks == 100
    # at most 4 raw chunks + per-chunk header/table row + pack magic/footer
    assert 0 < m2.stats.stored_bytes <= 4 * (CHUNK + 128) + 64
    old = {r.id for r in m1.items[0].chunks}
    changed = [i for i, r in enumerate(m2.items[0].chunks) if r.id not in old]
    assert changed == [40, 41, 42, 43]
    np.testing.assert_array_equal(store.load("v2")["x"], y)
    np.testing.assert_array_equal(store.load("v1")["x"], x)


def test_same_array_under_two_keys_is_stored_once(store, rng):
    x = random_array(rng, "float32", (50 * CHUNK // 4,))
    m = store.save("twice", {"a": x, "b": x.copy()})
    assert m.stats.num_chunks == 100
    assert m.stats.new_chunks == 50
    assert m.stats.stored_bytes < 0.55 * m.stats.logical_bytes
    ids_a = [r.id for r in m.items[0].chunks]
    ids_b = [r.id for r in m.items[1].chunks]
    assert ids_a == ids_b
    assert store.usage().num_chunks == 50
    got = store.load("twice")
    np.testing.assert_array_equal(got["a"], x)
    np.testing.assert_array_equal(got["b"], x)


def _save_shards(store, name, arr, split_elems, parent=None):
    """Save ``arr`` as two shards of global tensor "t" split at element ``split_elems`` (``parent``: the
    manifest whose chunks are sliced where the boundaries moved)."""
    flat = arr.reshape(-1)
    es = arr.dtype.itemsize
    w = store.writer(parent=parent)
    for i, (lo, hi) in enumerate([(0, split_elems), (split_elems, flat.size)]):
        part = np.ascontiguousarray(flat[lo:hi])
        w.add_array(f"t.shard{i}", part, dtype=arr.dtype.str, elem_size=es, shape=part.shape, group="t",
                    global_offset=lo * es)
    s = w.finish()
    return store.commit(name, s.items, entries=s.entries, packs=s.packs)


def _save_whole(store, name, arr):
    w = store.writer()
    w.add_array("t", arr, dtype=arr.dtype.str, elem_size=arr.dtype.itemsize, shape=arr.shape, group="t")
    s = w.finish()
    return store.commit(name, s.items, entries=s.entries, packs=s.packs)


def test_shards_split_on_chunk_grid_dedup_fully_against_whole_array(store, rng):
    arr = random_array(rng, "float32", (64 * CHUNK // 4 + 123,))  # tail chunk is partial
    whole = _save_whole(store, "whole", arr)
    assert whole.stats.new_chunks == 65
    sharded = _save_shards(store, "sharded", arr, split_elems=24 * CHUNK // 4)
    assert sharded.stats.new_chunks == 0
    assert sharded.stats.stored_bytes == 0
    assert [it.global_offset for it in sharded.items] == [0, 24 * CHUNK]
    assert all(it.group == "t" for it in sharded.items)
    got = store.load("sharded")
    np.testing.assert_array_equal(np.concatenate([got["t.shard0"], got["t.shard1"]]), arr)
    # and the other way round: a whole save after a sharded one of new data dedups too
    arr2 = arr + 1
    _save_shards(store, "sharded2", arr2, split_elems=40 * CHUNK // 4)
    whole2 = _save_whole(store, "whole2", arr2)
    assert whole2.stats.new_chunks == 0


def test_shards_split_off_grid_only_restore_the_straddling_chunk(store, rng):
    arr = random_array(rng, "float32", (32 * CHUNK // 4,))
    _save_whole(store, "whole", arr)
    split = 10 * CHUNK // 4 + 100  # inside chunk 10
    sharded = _save_shards(store, "sharded", arr, split_elems=split)
    # chunk 10 is cut in two partial chunks; every other chunk is shared with the whole save
    assert sharded.stats.new_chunks == 2
    assert [len(it.chunks) for it in sharded.items] == [11, 22]
    got = store.load("sharded")
    np.testing.assert_array_equal(np.concatenate([got["t.shard0"], got["t.shard1"]]), arr)


def test_moved_shard_edges_reuse_equal_parent_bytes_and_skip_decoding_changed_ones(store, rng, monkeypatch):
    from deltackpt.store.source import ChunkSource

    arr = random_array(rng, "float32", (32 * CHUNK // 4,))
    whole = _save_whole(store, "whole", arr)
    straddling = whole.items[0].chunks[10].id
    split = 10 * CHUNK // 4 + 100  # inside chunk 10
    decoded = []
    real_get = ChunkSource.get
    monkeypatch.setattr(ChunkSource, "get", lambda self, cid, **kw: decoded.append(cid) or real_get(self, cid, **kw))

    # Unchanged bytes: both halves of chunk 10 are slices of the parent's chunk (decoded to check them).
    same = _save_shards(store, "same", arr, split, parent=whole)
    assert same.stats.new_chunks == 0 and straddling in decoded
    assert [(c.id, c.skip) for c in same.items[1].chunks[:1]] == [(straddling, 400)]
    # Changed bytes: a few stored bytes show it, so the parent's chunk is not decoded at all.
    decoded.clear()
    changed = arr.copy()
    changed[10 * CHUNK // 4:11 * CHUNK // 4] *= 1.5
    moved = _save_shards(store, "moved", changed, split, parent=whole)
    assert moved.stats.new_chunks == 2 and straddling not in decoded  # the two halves of chunk 10
    # A change past the bytes probed: the decoded comparison still catches it.
    decoded.clear()
    late = arr.copy()
    late[11 * CHUNK // 4 - 1] += 1.0  # the last element of chunk 10, in shard 1's half
    late_m = _save_shards(store, "late", late, split, parent=whole)
    assert straddling in decoded
    assert [c.id for c in late_m.items[0].chunks[-1:]] == [straddling]  # shard 0's half is still reused
    for name, want in [("same", arr), ("moved", changed), ("late", late)]:
        got = store.load(name)
        np.testing.assert_array_equal(np.concatenate([got["t.shard0"], got["t.shard1"]]), want)


def test_fastcdc_insert_near_front_restores_small_fraction(store, rng):
    blob = rng.bytes(1 << 20)
    m1 = store.save("b1", {"blob": blob})
    assert m1.stats.stored_bytes > 0.9 * len(blob)
    edited = blob[:1000] + b"INSERTED!" + blob[1000:]
    m2 = store.save("b2", {"blob": edited})
    assert m2.stats.logical_bytes == len(blob) + 9
    assert m2.stats.stored_bytes < 0.02 * m2.stats.logical_bytes
    assert m2.stats.new_chunks <= 3
    assert store.load("b2")["blob"] == edited
    # The same edit in a fixed-grid (array) item would shift every chunk after it.
    a1 = np.frombuffer(blob, np.uint8)
    a2 = np.frombuffer(edited, np.uint8)
    store.save("a1", {"arr": a1})
    m4 = store.save("a2", {"arr": a2})
    assert m4.stats.new_chunks > 0.9 * m4.stats.num_chunks


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_dedup_is_exact_per_dtype(mem_store, rng, dtype):
    x = random_array(rng, dtype, (20 * CHUNK // np.dtype(dtype).itemsize + 1,))
    mem_store.save("a", {"x": x})
    m = mem_store.save("b", {"y": x})  # renamed key, same bytes
    assert m.stats.new_chunks == 0 and m.stats.stored_bytes == 0
    assert_items_equal({"y": x}, mem_store.load("b"))


def test_many_small_items_are_batched_and_deduplicated(mem_store, rng, monkeypatch):
    """Spans below BATCH_BYTES are coded in batches: items interleaved with large ones keep their own chunk
    refs, and equal small items (often in one batch) are stored once."""
    from deltackpt.store import writer as writer_mod

    monkeypatch.setattr(writer_mod, "BATCH_BYTES", 64 * 1024)
    submits = []
    real_submit = writer_mod.ThreadPoolExecutor.submit
    monkeypatch.setattr(writer_mod.ThreadPoolExecutor, "submit",
                        lambda self, fn, *a, **k: submits.append(fn) or real_submit(self, fn, *a, **k))
    same = random_array(rng, "float32", (1000,))
    items = {}
    for i in range(60):
        items[f"small{i}"] = random_array(rng, "float32", (int(rng.integers(1, 3000)),))
        items[f"same{i}"] = same.copy()
        if i % 20 == 0:
            items[f"big{i}"] = random_array(rng, "float32", (3 * CHUNK // 4 + 7,))
    m = mem_store.save("c", items)
    save_submits = len(submits)
    assert_items_equal(items, mem_store.load("c"))
    refs = mem_store.read_manifest("c").item_map()
    assert len({tuple(r.id for r in refs[f"same{i}"].chunks) for i in range(60)}) == 1
    assert m.stats.new_chunks == sum(len(it.chunks) for it in refs.values()) - 59  # 60 equal items, one chunk
    # 120 small items (~550 KB) and 3 large ones: about ten batches, not a pool hand-off per span.
    assert save_submits < 20, "small spans should not be submitted one by one"


@pytest.mark.timeout(60)
def test_tiny_inflight_cap_with_batched_spans_does_not_deadlock(mem_store, rng):
    """Spans waiting in an unsubmitted batch hold in-flight bytes: a cap smaller than a large span must not
    leave the queueing thread waiting for bytes only the unsubmitted batch would release."""
    from deltackpt.store.writer import ChunkWriter

    small = {f"s{i}": random_array(rng, "float32", (500,)) for i in range(20)}
    big = random_array(rng, "float32", (2 * CHUNK // 4,))
    w = ChunkWriter(mem_store, max_inflight_bytes=CHUNK // 2)
    for k, v in small.items():
        w.add_array(k, v, dtype="float32", elem_size=4, shape=v.shape)
    w.add_array("big", big, dtype="float32", elem_size=4, shape=big.shape)
    summary = w.finish()
    assert {it.key for it in summary.items} == set(small) | {"big"}
    assert sum(len(it.chunks) for it in summary.items if it.key == "big") == 2


def test_one_coding_thread_codes_inline_like_a_pool(mem_store, rng, monkeypatch):
    """A writer with one coding thread runs its jobs in the caller's thread (no pool hand-offs): same refs as
    a two-thread pool, and a failure in coding still surfaces from finish()."""
    import threading

    from deltackpt.store import writer as writer_mod
    from deltackpt.store.writer import ChunkWriter

    monkeypatch.setattr(writer_mod, "INLINE_CHUNK_BYTES", 0)  # these small chunks too go to a pool of two
    items = {f"t{i}": random_array(rng, "float32", (int(n),)) for i, n in enumerate([10, 5000, CHUNK // 2, 300])}
    threads = set()
    real_write_span = ChunkWriter._write_span
    monkeypatch.setattr(ChunkWriter, "_write_span",
                        lambda self, *a: threads.add(threading.current_thread()) or real_write_span(self, *a))
    summaries = []
    for n in (1, 2):
        threads.clear()
        w = ChunkWriter(mem_store, num_threads=n)
        for k, v in items.items():
            w.add_array(k, v, dtype="float32", elem_size=4, shape=v.shape)
        summaries.append(w.finish())
        assert (threads == {threading.current_thread()}) == (n == 1)
    assert [it.chunks for it in summaries[0].items] == [it.chunks for it in summaries[1].items]

    def broken(self, *a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(ChunkWriter, "_store_chunk", broken)
    w = ChunkWriter(mem_store, num_threads=1)
    w.add_array("x", random_array(rng, "float32", (4096,)), dtype="float32", elem_size=4, shape=(4096,))
    with pytest.raises(RuntimeError, match="disk on fire"):
        w.finish()

"""The LMDB index is only a cache: losing, staling or swapping it never loses data."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from deltackpt.errors import ManifestFormatError
from deltackpt.store import LocalBackend, MemoryBackend, Store, codec
from deltackpt.store.gc import plan_gc
from deltackpt.store.verify import verify_store
from deltackpt.store import index as index_mod
from deltackpt.store.index import ChunkIndex
from deltackpt.store.pack import pack_key

from store_helpers import SMALL, assert_items_equal, close_index, count_index_writes, pack_names, random_array


def _meta_store_id(store) -> bytes | None:
    idx = store.index
    with idx.env.begin(db=idx._db[b"meta"]) as txn:
        v = txn.get(b"store_id")
    return None if v is None else bytes(v)


def test_deleted_cache_is_rebuilt(local_store, rng):
    root = local_store.backend.root
    a = {"w": random_array(rng, "float32", (50_000,)), "b": rng.bytes(20_000)}
    m1 = local_store.save("one", a)
    n_chunks = local_store.usage().num_chunks
    cache = root / "cache"
    assert (cache / "index.lmdb").is_dir()

    close_index(local_store)  # as if the process ended
    shutil.rmtree(cache)
    s = Store.open(root)
    assert_items_equal(a, s.load("one"))  # reads work: the index was rebuilt from the packs
    assert (cache / "index.lmdb").is_dir()
    assert s.usage().num_chunks == n_chunks
    m2 = s.save("two", a)  # dedup works against the rebuilt index
    assert m2.stats.new_chunks == 0 and m2.stats.stored_bytes == 0
    assert [(i.name, i.parent) for i in s.list_checkpoints()] == [("one", None), ("two", "one")]
    assert s.list_checkpoints()[0].stored_bytes == m1.stats.stored_bytes


def test_cache_deleted_while_open_in_this_process(local_store, rng):
    """Deleting the cache under a live process must not break that process (nor a new Store in it)."""
    root = local_store.backend.root
    a = {"w": random_array(rng, "float32", (20_000,))}
    local_store.save("one", a)
    shutil.rmtree(root / "cache")
    s = Store.open(root)
    assert_items_equal(a, s.load("one"))
    b = {"w": a["w"] + 1}
    s.save("two", b)
    assert_items_equal(b, local_store.load("two"))
    close_index(s)
    fresh = Store.open(root)  # a later process rebuilds what it cannot find
    assert_items_equal(a, fresh.load("one"))
    assert_items_equal(b, fresh.load("two"))


def test_store_restored_from_a_copy_in_this_process_is_not_read_through_the_old_cache(local_store, rng,
                                                                                      monkeypatch):
    """A store replaced at its path (deleted, then copied back from a backup) has other cache files: the
    environment this process opened on the old ones (which forgot what the copy still holds) is not reused."""
    from deltackpt.store.retention import plan_forget

    root = local_store.backend.root
    for name in ("one", "two", "three"):
        local_store.save(name, {"w": random_array(rng, "float32", (5_000,))})
    assert len(local_store.list_checkpoints()) == 3  # each summary cached
    shutil.copytree(root, root.parent / "backup")
    plan_forget(local_store, keep_last=1).execute()  # drops the summaries of "one" and "two"
    shutil.rmtree(root)
    shutil.copytree(root.parent / "backup", root)
    reads = []
    real = Store.read_manifest
    monkeypatch.setattr(Store, "read_manifest", lambda self, name: reads.append(name) or real(self, name))
    assert [c.name for c in Store.open(root).list_checkpoints()] == ["one", "two", "three"]
    assert reads == []  # the restored cache's summaries, not the old one's misses


def test_rebuild_index_returns_counts(store, rng):
    store.save("a", {"w": random_array(rng, "float32", (40_000,))})
    store.save("b", {"w": random_array(rng, "float32", (40_000,))})
    n = len(pack_names(store))
    chunks = store.usage().num_chunks
    assert n > 2
    assert store.rebuild_index() == (n, 0)
    assert store.usage().num_chunks == chunks
    victim = sorted(pack_names(store))[0]
    store.backend.delete(pack_key(victim))
    assert store.rebuild_index() == (n - 1, 1)
    assert store.usage().num_chunks < chunks
    assert store.refresh_index() == (0, 0)
    # a Store whose index was never opened can rebuild too
    cold = Store.open(store.backend, cache_dir=store.cache_dir)
    assert cold.rebuild_index() == (n - 1, 0)


def test_unindexed_pack_is_picked_up_by_refresh(store, rng):
    x = random_array(rng, "float32", (30_000,))
    store.save("base", {"y": random_array(rng, "float32", (1000,))})
    before = store.usage().num_chunks
    w = store.writer()
    w.add_array("x", x, dtype=x.dtype.str, elem_size=4, shape=x.shape)
    s = w.finish()  # packs written, never committed nor indexed (a crash before commit)
    assert s.packs and all(store.backend.exists(pack_key(p)) for p in s.packs)
    assert store.index.lookup(s.items[0].chunks[0].id) is None
    assert store.usage().num_chunks == before

    assert store.refresh_index() == (len(s.packs), 0)
    assert store.index.lookup(s.items[0].chunks[0].id) is not None
    assert store.usage().num_chunks == before + len(s.entries)
    assert store.refresh_index() == (0, 0)
    # the orphan chunks now dedup a real save, and committing the orphan items needs no new bytes
    m = store.save("x", {"x": x})
    assert m.stats.new_chunks == 0 and m.stats.stored_bytes == 0
    store.commit("x-orphan", s.items)
    np.testing.assert_array_equal(store.load("x-orphan")["x"], x)


def test_pack_copied_in_from_another_store_is_indexed(make_store, rng):
    src = make_store("local", "src")
    dst = make_store("local", "dst")
    x = random_array(rng, "float32", (30_000,))
    m = src.save("x", {"x": x})
    # copy packs (content-addressed, config-independent) into dst behind its back
    for name in pack_names(src):
        dst.backend.put(pack_key(name), src.backend.get(pack_key(name)))
    # and the manifest (re-committed under dst's store id)
    dst.commit("x", m.items)
    np.testing.assert_array_equal(dst.load("x")["x"], x)
    assert dst.save("y", {"x": x}).stats.new_chunks == 0


def test_foreign_index_cache_is_detected_and_rebuilt(make_store, rng):
    a = make_store("local", "A")
    b = make_store("local", "B")
    xa = random_array(rng, "float32", (20_000,))
    xb = random_array(rng, "float32", (20_000,))
    a.save("ca", {"x": xa})
    # B holds all of A's packs plus its own, so "known pack missing" cannot be what triggers a rebuild.
    for name in pack_names(a):
        b.backend.put(pack_key(name), a.backend.get(pack_key(name)))
    b.save("cb", {"x": xb})
    n_b_packs = len(pack_names(b))
    assert pack_names(a) < pack_names(b)
    a_id, b_id = a.config.store_id, b.config.store_id
    assert _meta_store_id(a) == a_id.encode()

    close_index(a)
    close_index(b)
    shutil.rmtree(b.backend.root / "cache")
    shutil.copytree(a.backend.root / "cache", b.backend.root / "cache")

    idx = ChunkIndex(b.backend, b.backend.root / "cache", b_id)
    assert idx.refresh() == (n_b_packs, 0)  # a full rebuild, not just B's new packs
    assert idx.refresh() == (0, 0)
    b2 = Store.open(b.backend.root)
    assert _meta_store_id(b2) == b_id.encode()
    assert_items_equal({"x": xb}, b2.load("cb"))
    assert [i.name for i in b2.list_checkpoints()] == ["cb"]
    assert b2.save("cb2", {"x": xb}).stats.new_chunks == 0


def test_corrupt_cache_files_are_rebuilt(local_store, rng):
    x = {"x": random_array(rng, "float32", (20_000,))}
    local_store.save("one", x)
    root = local_store.backend.root
    close_index(local_store)
    for f in (root / "cache" / "index.lmdb").iterdir():
        f.write_bytes(b"\xffgarbage" * 10)
    s = Store.open(root)
    assert_items_equal(x, s.load("one"))
    assert s.save("two", x).stats.new_chunks == 0


def test_cache_dir_override_and_env(tmp_path, monkeypatch, rng):
    s = Store.init(LocalBackend(tmp_path / "st"), **SMALL)
    x = {"x": random_array(rng, "float32", (5000,))}
    s.save("one", x)
    assert (tmp_path / "st" / "cache" / "index.lmdb").is_dir()
    monkeypatch.setenv("DELTACKPT_CACHE_DIR", str(tmp_path / "envcache"))
    s2 = Store.open(tmp_path / "st")
    assert Path(s2.cache_dir) == tmp_path / "envcache" / s.config.store_id
    assert_items_equal(x, s2.load("one"))
    assert (tmp_path / "envcache" / s.config.store_id / "index.lmdb").is_dir()
    close_index(s)
    close_index(s2)


# -- many chunks at once: locate, reconcile, batched indexing --------------------------------------------------


def _history(store, rng, n=3):
    w = random_array(rng, "float32", (20_000,))
    for i in range(n):
        w = w.copy()
        w[:: 97 + i] += 1.0  # some chunks change, coded as deltas against the first save
        store.save(f"c{i}", {"w": w})


def test_locate_says_what_lookup_says(store, rng):
    from deltackpt.store import idset
    _history(store, rng)
    ids = [e.chunk_id for e in store.index.iter_entries()] + [bytes(16), b"\xff" * 16]
    loc = store.index.locate(idset.from_ids(ids))
    deltas = dict(zip(loc.delta_at.tolist(), (b.tobytes() for b in loc.delta_base)))
    assert deltas, "the fixture must hold deltas"
    for k, cid in enumerate(ids):
        e = store.index.lookup(cid)
        assert (loc.packs[loc.pack_of[k]] if loc.pack_of[k] >= 0 else None) == (e and e.pack)
        assert deltas.get(k) == (e and e.base_id)


def test_reconcile_writes_nothing_when_the_cache_is_right_and_fixes_what_is_wrong(local_store, rng):
    _history(local_store, rng)
    local_store.list_checkpoints()
    index = local_store.index
    truth = {e.chunk_id: e for e in index.iter_entries()}
    assert index.reconcile() == 0
    wrong, lost = list(truth.values())[:2]
    index.relocate([dataclasses.replace(wrong, offset=wrong.offset + 3)], {})  # well-formed but wrong
    with index.env.begin(write=True, db=index._db[b"chunks"]) as txn:
        txn.delete(lost.chunk_id)
        txn.put(b"\x01" * 16, txn.get(wrong.chunk_id))  # a record of a chunk no pack holds
    assert index.reconcile() == 3
    assert {e.chunk_id: e for e in index.iter_entries()} == truth
    assert set(index.get_summaries()) == {"c0", "c1", "c2"}  # what ``ls`` caches stays


def test_refresh_indexes_many_new_packs_in_one_transaction(local_store, rng):
    _history(local_store, rng, n=6)
    fresh = Store.open(local_store.backend.root, cache_dir=local_store.cache_dir)
    close_index(local_store)
    shutil.rmtree(Path(local_store.cache_dir) / "index.lmdb")
    index = fresh._new_index()
    refreshed = []
    writes = count_index_writes(index, lambda: refreshed.append(index.refresh()))
    added, _ = refreshed[0]
    assert added == len(pack_names(local_store)) > 3 and writes <= 2  # the packs, and nothing else
    assert index.num_chunks() == local_store.index.num_chunks()


def test_records_say_what_lookup_says(store, rng):
    from deltackpt.store.records import decode_record
    _history(store, rng)
    ids = [e.chunk_id for e in store.index.iter_entries()] + [bytes(16), b"\xff" * 16]
    recs, found = store.index.records(ids)
    assert found.tolist() == [True] * (len(ids) - 2) + [False, False]
    assert (recs[-2:].view(np.uint8) == 0).all()
    for cid, rec, hit in zip(ids, recs, found):
        assert (decode_record(cid, rec.tobytes()) if hit else None) == store.index.lookup(cid)
    assert any(store.index.lookup(cid).base_id for cid in ids[:-2]), "the fixture must hold deltas"


@pytest.mark.parametrize("at, value", [(40, 9), (41, 3), (42, 1)])  # no such codec, elem size; a keyframe's base
def test_records_rebuild_a_malformed_cache_record(local_store, rng, at, value):
    _history(local_store, rng)
    index = local_store.index
    victim = next(e for e in index.iter_entries() if e.base_id is None)
    with index.env.begin(write=True, db=index._db[b"chunks"]) as txn:
        rec = bytearray(txn.get(victim.chunk_id))
        rec[at] = value
        txn.put(victim.chunk_id, bytes(rec))
    recs, found = index.records([victim.chunk_id])
    assert found[0] and recs[0]["codec"] == victim.codec and recs[0]["offset"] == victim.offset


def test_check_records_counts_each_kind_of_malformed_record(local_store, rng, monkeypatch):
    monkeypatch.setattr(index_mod, "_CHECK_RECORDS", 3)  # damage in several batches, and sound batches between
    _history(local_store, rng)
    index = local_store.index
    assert index.check_records() == 0
    victims = [e for e in index.iter_entries() if e.base_id is None][:3]
    with index.env.begin(write=True, db=index._db[b"chunks"]) as txn:
        txn.put(victims[0].chunk_id, b"short")  # a record of the wrong size
        rec = bytearray(txn.get(victims[1].chunk_id))
        rec[40] = 9  # no such codec
        txn.put(victims[1].chunk_id, bytes(rec))
        txn.put(b"\x07" * 15, txn.get(victims[2].chunk_id))  # a key that is no chunk id
    assert index.check_records() == 3


# -- catching up with other processes' commits (Store.save: index_as_of the newest checkpoint) -----------------
def _listing(monkeypatch, backend) -> list[str]:
    """The prefixes ``backend`` (its class) is asked to list from now on."""
    listed: list[str] = []
    real_list = type(backend).list
    monkeypatch.setattr(type(backend), "list", lambda self, prefix="": listed.append(prefix) or real_list(self, prefix))
    return listed


def test_a_save_catches_up_with_a_commit_another_process_made(tmp_path, rng, monkeypatch):
    """Two processes with caches of their own (two hosts) save into one store: the one whose cache has not
    seen the newest commit catches up before it saves, and so re-stores nothing the other wrote (it
    refreshed its index on first use only, and stored such chunks again). It reads the commit's record
    instead of listing the packs (tests/store/test_commit_records.py)."""
    a = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache-a", **SMALL)
    b = Store.open(a.backend, cache_dir=tmp_path / "cache-b")
    x, y = random_array(rng, "float32", (20_000,)), random_array(rng, "float32", (20_000,))
    a.save("s1", {"x": x})
    b.save("s2", {"x": x, "y": y})
    listed = _listing(monkeypatch, a.backend)
    m = a.save("s3", {"x": x, "y": y})
    assert m.parent == "s2" and m.stats.new_chunks == 0
    assert "packs/" not in listed
    listed.clear()
    assert a.save("s4", {"x": x, "y": y}).stats.new_chunks == 0
    assert "packs/" not in listed  # its own commit: nothing to catch up with
    assert_items_equal({"x": x, "y": y}, b.load("s4"))


def test_a_new_process_saves_without_listing_the_packs_its_cache_committed(local_store, rng, monkeypatch):
    """A process whose cache indexed the newest commit itself (the last save on this host) lists no pack to
    open its index for a save, and still deduplicates against that checkpoint."""
    x = random_array(rng, "float32", (20_000,))
    local_store.save("s1", {"x": x})
    close_index(local_store)
    fresh = Store.open(local_store.backend.root)
    listed = _listing(monkeypatch, fresh.backend)
    assert fresh.save("s2", {"x": x}).stats.new_chunks == 0
    assert "packs/" not in listed


def test_a_cache_that_saw_the_newest_commit_still_learns_of_another_process_gc(tmp_path, rng):
    """The guarantee that a save never references what a gc swept does not rest on a listing: a gc in a
    process with a cache of its own deleted packs this cache still indexes, the save's cache has seen the
    newest commit (no listing), and the gc epoch sends it to refresh before it deduplicates."""
    a = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache-a", **SMALL)
    b = Store.open(a.backend, cache_dir=tmp_path / "cache-b")
    x, y = random_array(rng, "float32", (20_000,)), random_array(rng, "float32", (20_000,))
    a.save("s0", {"x": x})
    a.save("s1", {"y": y})
    b.forget("s0")
    assert plan_gc(b, grace_s=0).execute().deleted_packs > 0
    m = a.save("s2", {"x": x})  # x's chunks: indexed in a's cache, in packs gc deleted
    assert m.parent == "s1" and m.stats.new_chunks > 0  # written again, not deduplicated against swept packs
    assert_items_equal({"x": x}, Store.open(a.backend, cache_dir=tmp_path / "cache-c").load("s2"))


def test_the_snapshot_a_reconcile_leaves_locates_as_the_index_does(local_store, rng):
    """verify locates chunks through the arrays a reconcile leaves (no B-tree look-up each): they say what
    the index says after the reconcile, including what it repaired, and a chunk they lack (its pack
    published since) is looked up in the index."""
    from deltackpt.store import idset

    _history(local_store, rng)
    index = local_store.index
    truth = list(index.iter_entries())
    wrong, lost = truth[:2]
    other = next(e.pack for e in truth if e.pack != wrong.pack)
    index.relocate([dataclasses.replace(wrong, pack=other)], {})  # well-formed, in a pack that exists, wrong
    with index.env.begin(write=True, db=index._db[b"chunks"]) as txn:
        txn.delete(lost.chunk_id)
    snapshot: list = []
    assert index.reconcile(snapshot=snapshot) == 2
    (snap,) = snapshot
    local_store.save("later", {"v": random_array(rng, "float32", (5000,))})  # indexed after the snapshot
    ids = [e.chunk_id for e in index.iter_entries()] + [bytes(16), b"\xff" * 16]
    assert len(ids) > snap.ids.size + 2
    assert any(codec.is_delta(e.codec) for e in index.iter_entries()), "the fixture must hold deltas"
    for block in (idset.from_ids(ids), idset.from_ids(ids[::-1][:7])):
        got, want = snap.locate(block), index.locate(block)
        assert [got.packs[p] if p >= 0 else None for p in got.pack_of] == \
            [want.packs[p] if p >= 0 else None for p in want.pack_of]
        assert dict(zip(got.delta_at.tolist(), (b.tobytes() for b in got.delta_base))) == \
            dict(zip(want.delta_at.tolist(), (b.tobytes() for b in want.delta_base)))


def test_reconcile_rebuilds_a_cache_with_a_record_of_the_wrong_size(local_store, rng, caplog):
    """A record of the wrong size is never written by deltackpt: the file is damaged, and LMDB cannot say
    where else, so the cache is rebuilt rather than written into (a put beside a damaged record spoiled its
    neighbours)."""
    _history(local_store, rng)
    index = local_store.index
    truth = {e.chunk_id: e for e in index.iter_entries()}
    victim = next(iter(truth))
    with index.env.begin(write=True, db=index._db[b"chunks"]) as txn:
        txn.put(victim, b"short")
    index.reconcile()
    assert any("rebuilding" in r.getMessage() for r in caplog.records)
    assert {e.chunk_id: e for e in index.iter_entries()} == truth


def test_a_walk_of_the_cache_locates_as_look_ups_do(local_store, rng, monkeypatch):
    """Sorted ids that are most of the cache are located by walking it in key order (a cursor step costs a
    third of a look-up): the same packs and bases as look-ups, in steps that end anywhere among the ids,
    ids the cache lacks included; a malformed record is an error only when it is one of the ids'."""
    from deltackpt.store import idset, records

    _history(local_store, rng)
    index = local_store.index
    monkeypatch.setattr(records, "_WALK_BLOCK", 7)  # many steps, cut between any two ids
    entries = sorted(index.iter_entries(), key=lambda e: e.chunk_id)
    ids = idset.unique(idset.from_ids([e.chunk_id for e in entries[1:]] + [bytes(16), b"\xff" * 16, b"\x80" * 16]))
    assert any(codec.is_delta(e.codec) for e in entries), "the fixture must hold deltas"
    chunks = index._db[b"chunks"]

    def both(ids, block):
        with index.env.begin(db=chunks) as txn:
            walked = records.locate_walk(txn, ids, lambda start, loc: (start, loc), block)
            return walked, records.locate_in(txn.get, ids)

    def flat(parts, n):
        pack, base = [None] * n, {}
        for start, loc in parts:
            for k, p in enumerate(loc.pack_of.tolist()):
                pack[start + k] = loc.packs[p] if p >= 0 else None
            base.update({start + a: b.tobytes() for a, b in zip(loc.delta_at.tolist(), loc.delta_base)})
        return pack, base

    for block in (1, 5, 1000):
        walked, looked = both(ids, block)
        sizes = [loc.pack_of.size for _, loc in walked]
        assert [s for s, _ in walked] == [sum(sizes[:k]) for k in range(len(walked))]  # in order, no gap
        assert sum(sizes) == ids.size and max(sizes) <= block
        assert flat(walked, ids.size) == flat([(0, looked)], ids.size)
    with index.env.begin(write=True, db=chunks) as txn:
        txn.put(entries[0].chunk_id, b"short")  # a record of no id asked for: left out
    walked, looked = both(ids, 3)
    assert flat(walked, ids.size) == flat([(0, looked)], ids.size)
    with index.env.begin(write=True, db=chunks) as txn:
        txn.put(entries[3].chunk_id, b"short")  # one of the ids': refused, as a look-up refuses it
    with index.env.begin(db=chunks) as txn, pytest.raises(ManifestFormatError, match=entries[3].chunk_id.hex()):
        records.locate_walk(txn, ids, lambda start, loc: None, 3)


# -- caches of their own (hosts on a shared file system or object storage) --------------------------------------
def test_a_chunk_stored_twice_is_located_at_its_keyframe_so_chains_stay_in_bounds(tmp_path, rng):
    # Caches that missed each other's copy store a chunk twice, coded differently: here W1 as a delta (c1,
    # then forgotten) and as a keyframe (c3, by a cache that caught up through the commit log, which does not
    # name c1's pack). c4 is a delta on the keyframe copy; an index locating the delta copy would see a chain
    # of two in a store whose readers follow one, and gc, keeping the located copy, would make it permanent.
    root = tmp_path / "store"
    Store.init(root, chunk_size_bytes=4096, pack_target_bytes=65536, max_chain=1)
    a, b, c = (Store.open(root, cache_dir=tmp_path / f"cache-{k}") for k in "abc")
    w0 = rng.standard_normal(1024).astype(np.float32)
    w1 = w0.copy()
    w1[[5, 500]] += 1.0
    w2 = w1.copy()
    w2[[7, 900]] += 1.0
    v = [rng.standard_normal(1024).astype(np.float32) for _ in range(5)]
    c.save("c0", {"w": w0, "v": v[0]})
    b.save("c1", {"w": w1, "v": v[1]})
    b.forget(["c1"])
    a.save("c2", {"w": w1, "v": v[2]})
    c.save("c3", {"w": w1, "v": v[3]})
    c.save("c4", {"w": w2, "v": v[4]})
    expected = {"c0": w0, "c2": w1, "c3": w1, "c4": w2}
    x = b.read_manifest("c3").items[[i.key for i in b.read_manifest("c3").items].index("w")].chunks[0].id
    for store in (b, Store.open(root, cache_dir=tmp_path / "fresh")):
        store.index.refresh()
        assert store.index.lookup(x).base_id is None  # the keyframe copy, whichever the cache saw first
    plan_gc(b, grace_s=0, max_unused=0.0).execute()
    fresh = Store.open(root, cache_dir=tmp_path / "fresh-after-gc")
    assert verify_store(fresh, level=2).ok
    for name, w in expected.items():
        np.testing.assert_array_equal(fresh.load(name)["w"], w)


def test_a_read_after_another_hosts_gc_finds_the_moved_chunks(tmp_path, rng):
    root = tmp_path / "store"
    Store.init(root, chunk_size_bytes=4096, pack_target_bytes=65536)
    a = Store.open(root, cache_dir=tmp_path / "host-a")
    data = {f"c{i}": {"w": rng.standard_normal(1024).astype(np.float32)} for i in range(4)}
    for name in ("c0", "c1", "c2"):
        a.save(name, data[name])
    b = Store.open(root, cache_dir=tmp_path / "host-b")
    b.forget(["c0"])
    plan_gc(b, grace_s=0).execute()
    a.save("c3", data["c3"])  # sees the gc's epoch: host a's cache is rebuilt from the packs (trusted)
    assert plan_gc(Store.open(root, cache_dir=tmp_path / "host-b"), grace_s=0).execute().merged_packs > 0
    assert_items_equal(data["c3"], a.load("c3"))  # host a's cache locates the merged packs' chunks again


def test_damaged_pack_marks_survive_a_rebuild_that_dies_half_way(tmp_path, rng, monkeypatch):
    store = Store.init(tmp_path / "s", **SMALL)
    store.save("c1", {"w": random_array(rng, "float32", (3000,))})
    pack = next(iter(store.index.lookup_many({r.id for it in store.read_manifest("c1").items
                                              for r in it.chunks}).values())).pack
    store.index.mark_damaged([pack])

    def crash(*_a, **_k):
        raise KeyboardInterrupt  # the process dies between the cache's drop and its refill

    monkeypatch.setattr(type(store.index), "_index_packs", crash)
    with pytest.raises(KeyboardInterrupt):
        store.index.rebuild()
    monkeypatch.undo()
    assert Store.open(tmp_path / "s").index.damaged_packs(refresh=True) == {pack}


def test_a_rebuild_keeps_a_mark_another_store_object_made(tmp_path, rng):
    store = Store.init(tmp_path / "s", **SMALL)
    store.save("c1", {"w": random_array(rng, "float32", (3000,))})
    assert store.index.damaged_packs() == frozenset()  # read, and cached, before the mark
    pack = next(iter(store.index.lookup_many({r.id for it in store.read_manifest("c1").items
                                              for r in it.chunks}).values())).pack
    Store.open(tmp_path / "s").index.mark_damaged([pack])  # a verify in another process, on this cache
    store.index.rebuild()
    assert Store.open(tmp_path / "s").index.damaged_packs(refresh=True) == {pack}


def test_a_cache_directory_given_to_a_new_store_again_is_not_trusted(tmp_path, rng):
    """A new store (no checkpoint yet) opened with the index cache of another store (one cache_dir, or
    DELTACKPT_CACHE_DIR reused): the cache is the other store's, so nothing is deduplicated against it (its
    chunks were claimed, and every save failed at its commit with MissingChunkError)."""
    cache = tmp_path / "cache"
    state = {"w": rng.standard_normal(300_000).astype(np.float32)}
    for k in range(3):
        root = tmp_path / f"s{k}"
        Store.init(root, cache_dir=cache, chunk_size_bytes=64 * 1024).save("first", state)
        assert_items_equal(state, Store.open(root, cache_dir=tmp_path / f"fresh{k}").load("first"))

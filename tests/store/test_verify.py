"""verify_store: levels 0/1/2, what each kind of damage looks like, how damage maps to checkpoints/items,
partial (sampled / time-limited) runs that rotate over packs, and a lost index cache."""

from __future__ import annotations

import dataclasses
import math
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from deltackpt.errors import CorruptChunkError
from deltackpt.store import Store, codec
from deltackpt.store.manifest import manifest_key
from deltackpt.store.pack import HEADER_SIZE, pack_key
from deltackpt.store.verify import verify_store

from store_helpers import (
    assert_items_equal,
    close_index,
    flip_bit,
    mutate_object,
    pack_names,
    packs_of_checkpoint,
    random_array,
)


# -- a populated store: a keyframe checkpoint, a delta checkpoint on top of it, an unrelated one ----------------


def _perturb(rng, w: np.ndarray) -> np.ndarray:
    """A few elements changed in every 4 KiB chunk, so the next save codes ``w`` as deltas."""
    w2 = w.copy()
    per_chunk = 4096 // w.itemsize
    for start in range(0, w.size, per_chunk):
        idx = start + rng.integers(0, min(per_chunk, w.size - start), size=3)
        w2[idx] += 1.0
    return w2


def populate(store: Store, rng) -> dict[str, dict]:
    w = random_array(rng, "float32", (8192,))  # 8 chunks
    saved = {
        "a": {"w": w, "blob": rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()},
        "b": {"w": _perturb(rng, w), "v": random_array(rng, "float32", (4096,))},
        "c": {"z": random_array(rng, "int64", (2048,))},
    }
    for name, items in saved.items():
        store.save(name, items)
    # the fixture only means something if b's w really is coded as deltas against a's keyframes
    b_ids = [r.id for r in store.read_manifest("b").item_map()["w"].chunks]
    assert any(codec.is_delta(store.index.lookup(c).codec) for c in b_ids)
    return saved


@pytest.fixture
def populated(local_store, rng):
    return local_store, populate(local_store, rng)


def _entry(store, ckpt, key, i=0):
    ref = store.read_manifest(ckpt).item_map()[key].chunks[i]
    e = store.index.lookup(ref.id)
    assert e is not None
    return e


def _delta_and_base(store):
    """(delta entry of b:w, its base entry, which is a chunk of a:w)."""
    for ref in store.read_manifest("b").item_map()["w"].chunks:
        e = store.index.lookup(ref.id)
        if codec.is_delta(e.codec):
            base = store.index.lookup(e.base_id)
            assert base.chunk_id in {r.id for r in store.read_manifest("a").item_map()["w"].chunks}
            return e, base
    raise AssertionError("no delta chunk in b")


def _flip_payload(store, e, bit=3):
    flip_bit(store.backend, pack_key(e.pack), e.offset + HEADER_SIZE + e.stored_len // 2, bit)


def _items(report) -> list[str]:
    return sorted({i for p in report.problems for i in p.items})


def _kinds(report) -> set[str]:
    return {p.kind for p in report.problems}


# -- clean ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [0, 1, 2])
def test_clean_store_is_ok_at_every_level(populated, level):
    store, _ = populated
    r = verify_store(store, level=level)
    assert r.ok and r.problems == [] and r.damaged_checkpoints == []
    assert r.complete
    assert r.num_checkpoints == 3
    assert r.num_packs == len(pack_names(store))
    assert r.orphan_packs == []
    if level == 0:
        assert r.packs_checked == 0 and r.bytes_checked == 0  # level 0 reads no pack data
    else:
        assert r.packs_checked == r.num_packs
        assert r.bytes_checked == sum(i.size_bytes for i in store.backend.list("packs/"))
    if level == 2:
        needed = {ref.id for n in "abc" for it in store.read_manifest(n).items for ref in it.chunks}
        assert r.chunks_checked >= len(needed)  # every chunk decoded (plus the bases)
    d = r.as_dict()
    assert d["ok"] is True and d["level"] == level and d["problems"] == []


def test_bad_arguments_raise(populated):
    store, _ = populated
    for kw in (dict(level=3), dict(level=-1), dict(sample=0.0), dict(sample=1.5)):
        with pytest.raises(ValueError):
            verify_store(store, **kw)


def test_empty_store_is_ok(local_store):
    r = verify_store(local_store, level=2)
    assert r.ok and r.num_checkpoints == 0 and r.num_packs == 0


# -- damage in chunk data ----------------------------------------------------------------------------------


def test_payload_bit_flip_found_at_levels_1_and_2_not_0(populated):
    store, saved = populated
    e = _entry(store, "c", "z", 1)
    _flip_payload(store, e)

    r0 = verify_store(store, level=0)
    assert r0.ok, "level 0 must not read chunk data"

    for level in (1, 2):
        r = verify_store(store, level=level)
        assert not r.ok
        assert "pack-hash" in _kinds(r) and "bad-chunk" in _kinds(r)
        assert r.damaged_checkpoints == ["c"]
        assert _items(r) == ["c:z"]
        bad = [p for p in r.problems if p.kind == "bad-chunk"]
        assert [p.chunk_id for p in bad] == [e.chunk_id.hex()]
        assert bad[0].pack == e.pack
    # the undamaged checkpoints still load
    assert_items_equal(saved["a"], store.load("a"))
    assert_items_equal(saved["b"], store.load("b"))


def test_level_2_decodes_even_when_pack_hash_is_fine(populated):
    """A chunk that does not decode although its pack hashes to its name (a pack written damaged): only
    level 2 (decode + re-hash) can see it."""
    store, _ = populated
    e = _entry(store, "a", "blob", 0)
    data = bytearray(store.backend.get(pack_key(e.pack)))
    data[e.offset + HEADER_SIZE] ^= 0xFF
    # re-publish under the new hash, with the index pointing at it: a pack that is "intact" but holds garbage
    import xxhash

    new = xxhash.xxh3_128_hexdigest(bytes(data))
    store.backend.put(pack_key(new), bytes(data))
    store.backend.delete(pack_key(e.pack))
    store.rebuild_index()

    assert verify_store(store, level=0).ok
    assert verify_store(store, level=1).ok  # hash matches: level 1 trusts the pack
    r2 = verify_store(store, level=2)
    assert not r2.ok and _kinds(r2) == {"bad-chunk"}
    assert r2.damaged_checkpoints == ["a"] and _items(r2) == ["a:blob"]


def test_damaged_delta_base_maps_to_the_deltas_checkpoints(populated):
    store, saved = populated
    delta, base = _delta_and_base(store)
    _flip_payload(store, base)
    r = verify_store(store, level=2)
    assert not r.ok
    assert r.damaged_checkpoints == ["a", "b"]  # a holds the base, b's delta is built on it; c untouched
    assert _items(r) == ["a:w", "b:w"]
    by_chunk = {p.chunk_id: p for p in r.problems if p.kind == "bad-chunk"}
    assert base.chunk_id.hex() in by_chunk and delta.chunk_id.hex() in by_chunk
    assert by_chunk[base.chunk_id.hex()].items == ["a:w", "b:w"]
    assert by_chunk[delta.chunk_id.hex()].items == ["b:w"]
    assert_items_equal(saved["c"], store.load("c"))


def test_damaged_delta_itself_maps_only_to_its_checkpoint(populated):
    store, saved = populated
    delta, base = _delta_and_base(store)
    _flip_payload(store, delta, bit=0)
    r = verify_store(store, level=2)
    assert r.damaged_checkpoints == ["b"]
    assert _items(r) == ["b:w"]
    assert_items_equal(saved["a"], store.load("a"))


def test_level_1_maps_a_damaged_base_through_its_deltas(populated):
    store, _ = populated
    delta, base = _delta_and_base(store)
    assert delta.pack != base.pack
    _flip_payload(store, base)
    r = verify_store(store, level=1)
    assert r.damaged_checkpoints == ["a", "b"]


# -- damage to whole objects ---------------------------------------------------------------------------------


def test_deleted_pack_found_at_level_0(populated):
    store, saved = populated
    (pack,) = packs_of_checkpoint(store, "c")
    store.backend.delete(pack_key(pack))
    for level in (0, 1, 2):
        r = verify_store(store, level=level)
        assert not r.ok
        assert _kinds(r) <= {"missing-pack", "missing-chunk"}
        assert r.damaged_checkpoints == ["c"] and _items(r) == ["c:z"]
    assert_items_equal(saved["b"], store.load("b"))


@pytest.mark.parametrize("level", [0, 1, 2])
def test_deleted_pack_is_reported_as_missing_pack_with_its_name(populated, level):
    """Level 0 rebuilds a cache that names a pack gone, levels 1-2 reconcile it with the tables: either way
    the chunks whose record it drops are reported with the pack the cache located them in before."""
    store, _ = populated
    (pack,) = packs_of_checkpoint(store, "c")
    store.backend.delete(pack_key(pack))
    r = verify_store(store, level=level)
    assert _kinds(r) == {"missing-pack"}
    assert {p.pack for p in r.problems} == {pack}


def test_truncated_pack_found_at_level_1(populated):
    store, _ = populated
    (pack,) = packs_of_checkpoint(store, "c")
    mutate_object(store.backend, pack_key(pack), lambda b: b[: len(b) - 100])
    assert verify_store(store, level=0).ok  # structure only: the pack is still there
    for level in (1, 2):
        r = verify_store(store, level=level)
        assert not r.ok
        assert "pack-hash" in _kinds(r)
        assert all(p.pack == pack for p in r.problems)


@pytest.mark.parametrize("level", [1, 2])
def test_truncated_pack_maps_to_its_checkpoint(populated, level):
    store, _ = populated
    (pack,) = packs_of_checkpoint(store, "c")
    mutate_object(store.backend, pack_key(pack), lambda b: b[: len(b) - 100])
    r = verify_store(store, level=level)
    assert r.damaged_checkpoints == ["c"]
    assert _items(r) == ["c:z"]


def test_truncated_pack_with_fresh_index_maps_to_its_checkpoint(populated):
    """With the cache rebuilt, the truncated pack's chunks are unindexed: missing-chunk for exactly c."""
    store, _ = populated
    (pack,) = packs_of_checkpoint(store, "c")
    mutate_object(store.backend, pack_key(pack), lambda b: b[: len(b) // 2])
    store.rebuild_index()
    r = verify_store(store, level=0)
    assert r.damaged_checkpoints == ["c"] and _items(r) == ["c:z"]


@pytest.mark.parametrize("how", ["flip", "truncate", "garbage"])
def test_corrupted_manifest_is_a_manifest_problem(populated, how):
    store, saved = populated
    fn = {"flip": lambda b: b[:20] + bytes([b[20] ^ 4]) + b[21:], "truncate": lambda b: b[:-3],
          "garbage": lambda b: b"not a manifest at all"}[how]
    mutate_object(store.backend, manifest_key("b"), fn)
    for level in (0, 2):
        r = verify_store(store, level=level)
        assert [p.kind for p in r.problems] == ["manifest"]
        assert r.problems[0].checkpoints == ["b"]
        assert r.damaged_checkpoints == ["b"]
        assert r.num_checkpoints == 2  # a and c parsed
    assert_items_equal(saved["a"], store.load("a"))


def test_verify_a_subset_of_checkpoints(populated):
    store, _ = populated
    _flip_payload(store, _entry(store, "c", "z", 0))
    assert verify_store(store, level=2, checkpoints=["a", "b"]).ok
    r = verify_store(store, level=2, checkpoints=["c"])
    assert r.damaged_checkpoints == ["c"] and r.orphan_packs == []


def test_orphan_packs_are_listed_not_problems(populated):
    store, _ = populated
    w = store.writer()
    w.add_bytes("x", b"orphan data " * 500)
    summary = w.finish()  # packs written, never committed
    r = verify_store(store, level=2)
    assert r.ok
    assert set(r.orphan_packs) == set(summary.packs)


# -- the index cache is not part of the format ------------------------------------------------------------------


def test_verify_works_after_the_lmdb_cache_is_deleted(populated):
    store, saved = populated
    root = store.backend.local_path()
    close_index(store)
    shutil.rmtree(Path(store.cache_dir) / "index.lmdb")
    fresh = Store.open(root)
    r = verify_store(fresh, level=2)
    assert r.ok and r.num_checkpoints == 3
    assert fresh.index.num_chunks() > 0  # rebuilt from the pack tables
    assert (Path(fresh.cache_dir) / "index.lmdb").is_dir()
    for name, items in saved.items():
        assert_items_equal(items, fresh.load(name))


def test_verify_with_deleted_cache_still_finds_damage(populated):
    store, _ = populated
    root = store.backend.local_path()
    e = _entry(store, "a", "blob", 0)
    close_index(store)
    shutil.rmtree(Path(store.cache_dir) / "index.lmdb")
    _flip_payload(store, e)
    r = verify_store(Store.open(root), level=2)
    assert r.damaged_checkpoints == ["a"] and _items(r) == ["a:blob"]


def test_corrupted_index_record_is_not_reported_as_damage(populated):
    store, _ = populated
    e = _entry(store, "c", "z", 0)
    store.index.relocate([dataclasses.replace(e, offset=e.offset + 1)], {})
    assert verify_store(store, level=2).ok


@pytest.mark.parametrize("damage", ["short", "delta-without-base"])
def test_malformed_index_record_does_not_make_verify_raise(populated, damage):
    """A damaged cache is rebuilt, never trusted (and never makes verify raise)."""
    store, saved = populated
    e = _entry(store, "c", "z", 0)
    if damage == "short":
        with store.index.env.begin(write=True, db=store.index._db[b"chunks"]) as txn:
            txn.put(e.chunk_id, b"short")
    else:
        store.index.relocate([dataclasses.replace(e, codec=codec.DELTA, base_id=None)], {})
    for level in (0, 2):
        r = verify_store(store, level=level)
        assert r.ok, [p.as_dict() for p in r.problems]
    assert store.index.lookup(e.chunk_id) == e
    assert_items_equal(saved["c"], store.load("c"))


# -- partial runs ---------------------------------------------------------------------------------------------


def _many_packs(store, rng, n=8):
    for i in range(n):
        store.save(f"p{i}", {"x": random_array(rng, "float32", (3000,))})
    packs = sorted(pack_names(store))
    assert len(packs) == n
    return packs


def test_sampled_runs_rotate_over_all_packs(local_store, rng):
    store = local_store
    packs = _many_packs(store, rng)
    assert all(store.index.last_verified(p) == 0.0 for p in packs)
    sample = 0.25
    per_run = round(len(packs) * sample)
    seen: list[set[str]] = []
    for _ in range(math.ceil(1 / sample)):
        before = {p: store.index.last_verified(p) for p in packs}
        r = verify_store(store, level=1, sample=sample)
        assert r.ok and r.complete is False
        assert r.packs_checked == per_run
        after = {p: store.index.last_verified(p) for p in packs}
        checked = {p for p in packs if after[p] != before[p]}
        assert len(checked) == per_run
        # least recently verified first: never-verified packs go before any verified one
        never = {p for p in packs if before[p] == 0.0}
        assert checked <= never or never <= checked
        seen.append(checked)
    assert set().union(*seen) == set(packs)
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])  # no pack twice in one cycle
    # the next run starts over with the packs verified longest ago
    before = {p: store.index.last_verified(p) for p in packs}
    oldest = set(sorted(packs, key=lambda p: (before[p], p))[:per_run])
    verify_store(store, level=1, sample=sample)
    assert {p for p in packs if store.index.last_verified(p) != before[p]} == oldest
    assert verify_store(store, level=1, sample=1.0).complete is True


def test_sampled_runs_eventually_find_damage(local_store, rng):
    store = local_store
    _many_packs(store, rng)
    victim = sorted(packs_of_checkpoint(store, "p5"))[0]
    e = next(x for x in store.index.iter_entries() if x.pack == victim)
    _flip_payload(store, e)
    found = []
    for _ in range(6):
        r = verify_store(store, level=2, sample=0.25)
        found.append(r.damaged_checkpoints)
    first = found.index(["p5"])
    assert first < 4 and found[:first] == [[]] * first
    # A damaged pack is not recorded as verified: it stays first in line, so every later run reports it
    # (a rotating `verify --sample` job must not exit 0 right after finding damage).
    assert found[first:] == [["p5"]] * (6 - first)
    assert store.index.last_verified(victim) == 0.0


def test_max_duration_gives_a_partial_run(local_store, rng):
    store = local_store
    packs = _many_packs(store, rng, n=4)
    r = verify_store(store, level=2, max_duration_s=1e-9)
    assert r.complete is False and r.packs_checked < len(packs)
    assert r.packs_checked + r.packs_skipped == len(packs) and r.skipped_by == "max_duration"
    r = verify_store(store, level=2, max_duration_s=0)
    assert (r.packs_checked, r.packs_skipped, r.chunks_checked) == (0, len(packs), 0)
    assert r.chunks_skipped == r.as_dict()["chunks_skipped"] >= len(packs)  # each pack holds one checkpoint's
    assert r.ok and not r.clean  # nothing wrong found, but nothing read: never reported as clean
    r = verify_store(store, level=2, max_duration_s=600)
    assert r.complete is True and r.packs_checked == len(packs)
    assert (r.packs_skipped, r.chunks_skipped, r.skipped_by, r.clean) == (0, 0, None, True)


def test_a_sample_reports_what_it_skipped(local_store, rng):
    store = local_store
    _many_packs(store, rng, n=4)
    r = verify_store(store, level=1, sample=0.5)
    assert (r.packs_checked, r.packs_skipped, r.skipped_by, r.clean) == (2, 2, "sample", False)
    assert r.chunks_skipped == sum(len(store.read_manifest(f"p{i}").items[0].chunks) for i in range(4)) // 2
    assert verify_store(store, level=0, max_duration_s=0).clean  # level 0 reads no pack: nothing to skip


def test_last_verified_is_recorded(local_store, rng):
    store = local_store
    packs = _many_packs(store, rng, n=2)
    store.index.mark_verified(packs[0], when=1234.5)
    assert store.index.last_verified(packs[0]) == 1234.5
    verify_store(store, level=1)
    assert all(store.index.last_verified(p) > 1234.5 for p in packs)


# -- robustness of verify itself -----------------------------------------------------------------------------


def test_chunk_frame_with_forged_content_size_is_reported_not_raised(populated):
    store, _ = populated
    e = _entry(store, "a", "w", 0)
    assert e.codec == codec.ZSTD  # float32 normals: byte planes compress
    key = pack_key(e.pack)
    forged = bytes([0xE0]) + struct.pack("<Q", 1 << 62)  # frame header: single segment, 8-byte content size

    def fn(data):
        b = bytearray(data)
        start = e.offset + HEADER_SIZE + 4  # after the zstd magic
        b[start:start + len(forged)] = forged
        return b

    mutate_object(store.backend, key, fn)
    r = verify_store(store, level=2)
    assert r.damaged_checkpoints == ["a", "b"]  # b's delta is based on this chunk
    assert _items(r) == ["a:w", "b:w"]
    with pytest.raises(CorruptChunkError):
        store.load("a")


# -- cost: the cache is checked, not rebuilt; memory per unique chunk ------------------------------------------


def test_damaged_base_no_checkpoint_references_maps_to_its_deltas(populated):
    store, saved = populated
    delta, base = _delta_and_base(store)
    store.forget("a")  # the base stays (b's deltas need it), referenced by no manifest
    _flip_payload(store, base)
    r = verify_store(store, level=2)
    assert r.damaged_checkpoints == ["b"]
    by_chunk = {p.chunk_id: p for p in r.problems if p.kind == "bad-chunk"}
    assert by_chunk[base.chunk_id.hex()].items == ["b:w"] and by_chunk[base.chunk_id.hex()].checkpoints == ["b"]
    assert_items_equal(saved["c"], store.load("c"))


def test_level_1_keeps_the_ls_summaries_and_does_not_grow_the_cache(populated):
    store, _ = populated
    store.list_checkpoints()  # caches what ``ls`` shows
    summaries = store.index.get_summaries()
    assert set(summaries) == {"a", "b", "c"}
    data = Path(store.cache_dir) / "index.lmdb" / "data.mdb"
    size = data.stat().st_size
    for _ in range(3):
        assert verify_store(store, level=1).clean
    assert store.index.get_summaries() == summaries
    assert data.stat().st_size == size


def test_level_1_still_repairs_a_wrong_record(populated):
    store, saved = populated
    e = _entry(store, "c", "z")
    store.index.relocate([dataclasses.replace(e, offset=e.offset + 1)], {})  # well-formed but wrong
    assert verify_store(store, level=1).clean
    assert store.index.lookup(e.chunk_id) == e
    assert_items_equal(saved["c"], store.load("c"))


def test_level_0_memory_grows_with_unique_chunks_not_with_references(mem_store, rng):
    """A history that references the same chunks over and over costs verify no memory per reference."""
    w = random_array(rng, "float32", (2000 * 1024,))  # 2000 chunks
    peaks = {}
    for n in (10, 100):
        while len(mem_store.checkpoint_names()) < n:
            mem_store.save(f"c{len(mem_store.checkpoint_names()):03d}", {"w": w})
        verify_store(mem_store, level=0)  # warm (the index, imports)
        tracemalloc.start()
        try:
            assert verify_store(mem_store, level=0).clean
            peaks[n] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    extra_refs = 90 * 2000
    # A "checkpoint:item" string per reference cost ~70 bytes each; an id array 16 bytes per unique chunk.
    assert peaks[100] - peaks[10] < 10 * extra_refs, peaks


@pytest.mark.parametrize("damage", ["none", "pack-gone", "record-gone"])
def test_level_0_reports_the_same_when_it_walks_the_cache(populated, monkeypatch, damage):
    """Past 2^17 ids, locating most of the cache walks it instead of a look-up each: forced here at a small
    size, the report (problems, their packs and chunks, damaged checkpoints) is the one look-ups give."""
    from deltackpt.store import index as index_mod

    store, _ = populated
    (pack,) = packs_of_checkpoint(store, "c")
    if damage == "pack-gone":
        store.backend.delete(pack_key(pack))
    elif damage == "record-gone":
        victim = _entry(store, "c", "z")
        with store.index.env.begin(write=True, db=store.index._db[b"chunks"]) as txn:
            txn.delete(victim.chunk_id)
    copy = store.backend.local_path().parent / "copy"
    shutil.copytree(store.backend.local_path(), copy)

    def report(path, walk: bool):
        monkeypatch.setattr(index_mod, "_WALK_ABOVE", 0 if walk else 1 << 62)
        walked = []
        real = index_mod.locate_walk
        monkeypatch.setattr(index_mod, "locate_walk", lambda *a: walked.append(1) or real(*a))
        r = verify_store(Store.open(path), level=0)
        return sorted((p.kind.value, p.pack, p.chunk_id) for p in r.problems), r.damaged_checkpoints, bool(walked)

    looked, walked = report(copy, False), report(store.backend.local_path(), True)
    assert walked[2] and not looked[2]
    assert walked[:2] == looked[:2]
    assert bool(looked[0]) == (damage == "pack-gone")  # a record the cache lost is the cache's, repaired


@pytest.mark.parametrize("level", [1, 2])
def test_damage_in_a_chunk_no_checked_checkpoint_needs_is_not_blamed_on_them(tmp_path, level):
    """A pack holding chunks of two checkpoints, one of b's chunks damaged: a verify of a_only alone (or one of
    the whole store, for a_only) decodes every chunk of the pack whose hash failed and pins the damage to that
    chunk, instead of blaming every checkpoint with a chunk in the pack."""
    from deltackpt.store.pack import HEADER_SIZE

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    store = Store.init(tmp_path / "t", chunk_size_bytes=4096, pack_target_bytes=1 << 20)
    store.save("ab", {"a": a, "b": b})  # one pack with a's and b's chunks
    store.save("a_only", {"a": a})
    e = store.index.lookup(store.read_manifest("ab").items[1].chunks[0].id)

    def flip(data: bytes) -> bytes:
        data = bytearray(data)
        data[e.offset + HEADER_SIZE + 10] ^= 0xFF
        return bytes(data)

    mutate_object(store.backend, pack_key(e.pack), flip)
    s = Store.open(tmp_path / "t")
    assert verify_store(s, level=level).damaged_checkpoints == ["ab"]
    sub = verify_store(s, level=level, checkpoints=["a_only"])
    assert sub.damaged_checkpoints == [] and not sub.clean  # the damage is reported, on no checkpoint
    np.testing.assert_array_equal(s.load("a_only")["a"], a)


def test_a_pack_a_gc_replaced_during_verify_leaves_the_report_incomplete_not_clean(tmp_path, monkeypatch):
    """verify takes no lock: a pack gc repacked after verify listed it is not read, so it is not verified."""
    from deltackpt.store import verify as verify_mod
    from deltackpt.store.gc import plan_gc

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(20_000).astype(np.float32), rng.standard_normal(20_000).astype(np.float32)
    store = Store.init(tmp_path / "s")
    store.save("c0", {"a": a, "b": b})  # one pack holding a and b
    store.save("c1", {"a": a})  # a deduplicated: c1 lives in c0's pack
    real = verify_mod._check_packs

    def gc_meanwhile(*args, **kwargs):
        other = Store.open(tmp_path / "s", cache_dir=tmp_path / "other-cache")  # another process
        other.forget(["c0"])
        assert plan_gc(other, grace_s=0, max_unused=0.0).execute().repacked_packs == 1
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_mod, "_check_packs", gc_meanwhile)
    report = verify_store(Store.open(tmp_path / "s", cache_dir=tmp_path / "cache"), level=2)
    assert report.packs_checked == 0 and not report.complete and not report.clean
    assert report.skipped_by == "concurrent-gc" and report.packs_skipped == 1


@pytest.mark.parametrize("forget", [False, True])
def test_verify_from_a_cache_that_holds_no_chunk_yet(tmp_path, forget):
    """A host whose cache had no chunk records (it verified the store while it was empty) failed every later
    verify with IndexError once another host had saved, until its cache was deleted."""
    Store.init(tmp_path / "s", cache_dir=tmp_path / "c-init", chunk_size_bytes=16384)
    h0 = Store.open(tmp_path / "s", cache_dir=tmp_path / "c0")
    h1 = Store.open(tmp_path / "s", cache_dir=tmp_path / "c1")
    assert verify_store(h1, level=2).clean
    h0.save("c001", {"w": np.arange(16384, dtype=np.float32)})
    if forget:
        h0.forget(["c001"])
    report = verify_store(h1, level=2)
    assert report.clean and report.problems == []

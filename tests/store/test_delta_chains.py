"""Bounded delta chains (``max_chain``): a delta's base may be a delta; every path that follows bases follows
the whole chain (read, save, commit, gc, verify, copy) and never one longer than the store allows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deltackpt.errors import CorruptChunkError, UnsupportedFormatError
from deltackpt.store import MemoryBackend, Store, codec, planes
from deltackpt.store import config as config_mod
from deltackpt.store import deltapolicy
from deltackpt.store import source as source_mod
from deltackpt.store.chunking import chunk_id_of
from deltackpt.store.copy import copy_checkpoints
from deltackpt.store.gc import plan_gc
from deltackpt.store.manifest import ChunkRef, Item, Manifest, Stats, encode_manifest
from deltackpt.store.pack import HEADER_SIZE, PackBuilder, list_packs, pack_key
from deltackpt.store.verify import verify_store

from store_helpers import mutate_object

CHUNK = 16384


def _sparse_steps(seed: int, count: int, n: int = 16_384) -> list[np.ndarray]:
    """``count`` states of a float32 vector of ``n`` elements where each step nudges a few elements by one
    ulp (a sparse update: the delta against the previous state is tiny, against an older one it grows)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n) * 0.05).astype(np.float32)
    out = [w.copy()]
    for _ in range(count - 1):
        bits = w.view(np.uint32)
        bits[rng.integers(0, n, 40)] += np.uint32(1)
        out.append(w.copy())
    return out


def _depth(store: Store, cid: bytes) -> int:
    """Deltas down chunk ``cid``'s chain (0 for a keyframe)."""
    depth, entry = 0, store.index.lookup(cid)
    while codec.is_delta(entry.codec):
        depth, entry = depth + 1, store.index.lookup(entry.base_id)
    return depth


def _chunk_ids(store: Store, name: str) -> list[bytes]:
    return [r.id for it in store.read_manifest(name).items for r in it.chunks]


def _chained_store(location, max_chain: int, count: int, *, reopen: bool = False, **config):
    store = Store.init(location, chunk_size_bytes=CHUNK, max_chain=max_chain, **config)
    states = _sparse_steps(max_chain, count)
    for i, w in enumerate(states):
        if reopen:  # a new Store object per save: every base is read back from the store, none cached
            store = Store.open(location)
        store.save(f"c{i}", {"w": w})
    return store, states


@pytest.mark.parametrize("max_chain,reopen", [(1, False), (2, False), (4, False), (4, True), (8, False)])
def test_chains_restore_bit_exact_and_never_exceed_max_chain(tmp_path, max_chain, reopen):
    store, states = _chained_store(tmp_path / "s", max_chain, 12, reopen=reopen)
    depths = [_depth(store, cid) for i in range(len(states)) for cid in _chunk_ids(store, f"c{i}")]
    assert max(depths) == max_chain, "chains grow to the bound and no further"
    reopened = Store.open(tmp_path / "s")
    for i, w in enumerate(states):
        np.testing.assert_array_equal(reopened.load(f"c{i}")["w"], w)
    assert ("delta-chains" in reopened.config.features) == (max_chain > 1)
    assert verify_store(reopened, level=2).clean


@pytest.mark.parametrize("links", ["sparse", "all"])
def test_a_save_reads_nothing_from_the_store_with_chains(tmp_path, links):
    backend = MemoryBackend()
    store = Store.init(backend, cache_dir=tmp_path / "c", chunk_size_bytes=CHUNK, max_chain=4, chain_links=links)
    store.base_cache.reserve(64 << 20)  # a training loop's store (a one-off first save keeps no copies)
    states = _sparse_steps(5, 8) if links == "sparse" else _dense_steps(5, 8)
    store.save("c0", {"w": states[0]})
    reads = []
    real = backend.get_range_into
    backend.get_range_into = lambda key, *a, **k: (reads.append(key), real(key, *a, **k))[1]
    for i, w in enumerate(states[1:], 1):
        store.save(f"c{i}", {"w": w})
    assert not [k for k in reads if k.startswith("packs/")], "bases came from the keyframe cache"
    # A sparse chain grows to the last checkpoint; a dense one's place may start a new cycle on the way.
    names = ["c7"] if links == "sparse" else [f"c{i}" for i in range(8)]
    assert max(_depth(store, cid) for name in names for cid in _chunk_ids(store, name)) >= 2


def test_chains_make_sparse_updates_smaller_than_keyframe_bases(tmp_path):
    sizes = {}
    for max_chain in (1, 4):
        store, _ = _chained_store(tmp_path / f"s{max_chain}", max_chain, 10)
        sizes[max_chain] = store.usage().pack_bytes
    assert sizes[4] < sizes[1]


def test_gc_keeps_the_bases_of_a_live_tip_and_drops_them_once_unneeded(tmp_path):
    store, states = _chained_store(tmp_path / "s", 4, 5)
    tip = _chunk_ids(store, "c4")
    chain = set()
    for cid in tip:
        entry = store.index.lookup(cid)
        while entry.base_id is not None:
            chain.add(entry.base_id)
            entry = store.index.lookup(entry.base_id)
    assert chain - set(tip), "the tip is coded against older checkpoints' chunks"
    store.forget([f"c{i}" for i in range(4)])
    plan_gc(store, grace_s=0).execute()
    reopened = Store.open(tmp_path / "s")
    np.testing.assert_array_equal(reopened.load("c4")["w"], states[4])
    assert all(reopened.index.lookup(c) is not None for c in chain)
    assert verify_store(reopened, level=2).clean
    # Once nothing needs the chain (the tip is forgotten too), gc removes all of it.
    reopened.save("other", {"w": np.arange(16_384, dtype=np.float32)})
    reopened.forget(["c4"])
    plan_gc(reopened, grace_s=0).execute()
    again = Store.open(tmp_path / "s")
    assert all(again.index.lookup(c) is None for c in chain | set(tip))
    np.testing.assert_array_equal(again.load("other")["w"], np.arange(16_384, dtype=np.float32))


def test_verify_finds_a_missing_mid_chain_base(tmp_path):
    # One chunk per checkpoint, each save its own pack: deleting c1's pack removes the middle of c3's chain.
    store, _ = _chained_store(tmp_path / "s", 4, 4)
    ids = [_chunk_ids(store, f"c{i}")[0] for i in range(4)]
    assert [_depth(store, c) for c in ids] == [0, 1, 2, 3]
    mid = store.index.lookup(ids[1])
    store.backend.delete(pack_key(mid.pack))
    report = verify_store(Store.open(tmp_path / "s"), level=0)
    by_chunk = {p.chunk_id: p for p in report.problems}
    assert by_chunk[ids[3].hex()].kind == "bad-base"
    assert ids[1].hex() in by_chunk[ids[3].hex()].detail and "down its chain" in by_chunk[ids[3].hex()].detail
    assert {"c1", "c2", "c3"} <= {c for p in report.problems for c in p.checkpoints}
    assert "c0" not in {c for p in report.problems for c in p.checkpoints}
    # The lost chunk's own problem names every checkpoint whose chain runs through it.
    assert by_chunk[ids[1].hex()].checkpoints == ["c1", "c2", "c3"]
    with pytest.raises(CorruptChunkError) as ei:
        Store.open(tmp_path / "s").load("c3")
    assert ei.value.chunk_id == ids[3].hex()


def test_verify_follows_a_chain_through_checkpoints_forgotten(tmp_path):
    """The links of a kept tip's chain that no kept checkpoint references are still needed, checked and
    attributed to the tip (verify walks them as chunks beyond the referenced ones)."""
    store, states = _chained_store(tmp_path / "s", 4, 5)
    ids = [_chunk_ids(store, f"c{i}")[0] for i in range(5)]
    assert [_depth(store, c) for c in ids] == [0, 1, 2, 3, 4]
    for name in ("c0", "c1", "c2", "c3"):
        store.forget(name)
    assert verify_store(Store.open(tmp_path / "s"), level=0).clean
    store.backend.delete(pack_key(store.index.lookup(ids[2]).pack))
    report = verify_store(Store.open(tmp_path / "s"), level=0)
    by_chunk = {p.chunk_id: p for p in report.problems}
    assert by_chunk[ids[4].hex()].kind == "bad-base" and "2 deltas down its chain" in by_chunk[ids[4].hex()].detail
    assert ids[2].hex() in by_chunk[ids[4].hex()].detail
    # The lost pack's chunks are no kept checkpoint's own: each of the tip's chunks names its lost link.
    assert set(by_chunk) == set(c.hex() for c in _chunk_ids(store, "c4"))
    assert all(p.kind == "bad-base" and p.checkpoints == ["c4"] for p in report.problems)


def test_copy_of_a_chain_tip_to_an_empty_store_loads(tmp_path):
    src, states = _chained_store(tmp_path / "src", 4, 6)
    assert max(_depth(src, c) for c in _chunk_ids(src, "c5")) >= 2
    dst = Store.init(tmp_path / "dst")  # max_chain 1 here: the copied chains are still readable
    copy_checkpoints(src, dst, ["c5"])
    reopened = Store.open(tmp_path / "dst")
    assert "delta-chains" in reopened.config.features
    np.testing.assert_array_equal(reopened.load("c5")["w"], states[5])
    assert verify_store(reopened, level=2).clean


def test_format_gate_names_delta_chains(tmp_path, monkeypatch):
    _chained_store(tmp_path / "s", 2, 3)
    raw = json.loads((tmp_path / "s" / "config").read_bytes())
    assert raw["max_chain"] == 2 and "delta-chains" in raw["features"]
    # A reader from before chains: it knows every other feature, and refuses by name, not as damage.
    monkeypatch.setattr(config_mod, "SUPPORTED_FEATURES",
                        {k: v for k, v in config_mod.SUPPORTED_FEATURES.items() if k != "delta-chains"})
    with pytest.raises(UnsupportedFormatError, match="delta-chains"):
        Store.open(tmp_path / "s")


def test_a_depth_one_store_config_reads_as_before_chains(tmp_path):
    Store.init(tmp_path / "s", max_chain=1)
    raw = json.loads((tmp_path / "s" / "config").read_bytes())
    # An older reader refuses unknown fields: 1 (what a config without the field means) is left out, and no
    # feature is added.
    assert "max_chain" not in raw and "delta-chains" not in raw["features"]
    assert Store.open(tmp_path / "s").config.max_chain == 1


def test_a_new_store_chains_deltas_and_says_so(tmp_path):
    Store.init(tmp_path / "s")
    raw = json.loads((tmp_path / "s" / "config").read_bytes())
    assert raw["max_chain"] == config_mod.NEW_STORE_MAX_CHAIN and "delta-chains" in raw["features"]


@pytest.mark.parametrize("bad", [0, config_mod.MAX_CHAIN + 1])
def test_max_chain_out_of_range_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="max_chain"):
        Store.init(tmp_path / "s", max_chain=bad)


def _write_raw_checkpoint(store: Store, entries_spec, tip: bytes, n: int) -> None:
    """Put one pack built from ``entries_spec`` ((id, codec, payload, base_id)) and a manifest reading ``tip``
    past the commit's checks (which would refuse a broken chain)."""
    pb = PackBuilder()
    for cid, cod, payload, base_id in entries_spec:
        pb.add(cid, cod, 4, n, payload, base_id)
    name, data, entries = pb.seal()
    store.backend.put(pack_key(name), data)
    store.index.add(entries, {name: len(data)})
    item = Item(key="t", kind="array", nbytes=n, chunks=[ChunkRef(tip, n)], dtype="<f4", elem_size=4,
                shape=[n // 4])
    manifest = Manifest(name="t", store_id=store.config.store_id, created_ns=1, items=[item], stats=Stats())
    store.backend.put("manifests/t", encode_manifest(manifest))


def test_a_cycle_of_deltas_is_damage_not_a_hang(tmp_path):
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "c", max_chain=4)
    store.ensure_features()
    rng = np.random.default_rng(9)
    n = 4096
    a, b = rng.bytes(n), rng.bytes(n)
    ida, idb = chunk_id_of(a), chunk_id_of(b)
    _write_raw_checkpoint(store, [(ida, codec.DELTA, codec.encode_delta(a, b, 4, 1), idb),
                                  (idb, codec.DELTA, codec.encode_delta(b, a, 4, 1), ida)], ida, n)
    with pytest.raises(CorruptChunkError, match="cycle") as ei:
        store.load("t")
    assert ei.value.chunk_id == ida.hex()
    assert any("meets itself" in p.detail for p in verify_store(store, level=0).problems)


def test_a_chain_longer_than_the_format_allows_is_damage(tmp_path, monkeypatch):
    monkeypatch.setattr(config_mod, "MAX_CHAIN", 3)
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "c", max_chain=3)
    store.ensure_features()
    rng = np.random.default_rng(10)
    n = 4096
    states = [rng.bytes(n)]
    for i in range(4):
        nxt = bytearray(states[-1])
        nxt[i] ^= 1
        states.append(bytes(nxt))
    ids = [chunk_id_of(s) for s in states]
    spec = [(ids[0], codec.RAW, states[0], None)]
    spec += [(ids[i], codec.DELTA, codec.encode_delta(states[i], states[i - 1], 4, 1), ids[i - 1])
             for i in range(1, 5)]  # four deltas deep: one more than allowed
    _write_raw_checkpoint(store, spec, ids[4], n)
    with pytest.raises(CorruptChunkError, match="more than 3 deltas"):
        store.load("t")
    assert any("more than 3 deltas" in p.detail for p in verify_store(store, level=0).problems)


def test_a_delta_against_a_chained_base_is_weighed_against_the_keyframe(tmp_path):
    """A delta base's own stored size is a delta's; whether a new delta pays is judged against the keyframe
    at the bottom of the chain (else every delta that outgrows one step's change became a keyframe)."""
    from deltackpt.store.deltapolicy import DeltaPolicy

    store, _ = _chained_store(tmp_path / "s", 2, 3)
    ids = [_chunk_ids(store, f"c{i}")[0] for i in range(3)]
    assert [_depth(store, c) for c in ids] == [0, 1, 2]
    key, mid = store.index.lookup(ids[0]), store.index.lookup(ids[1])
    policy = DeltaPolicy(store)
    base = policy.base_for(ids[2], key.raw_len)
    assert base.entry.chunk_id == ids[1] and base.depth == 1 and base.age == 2, "the chain is at its bound"
    assert base.keyframe_len == key.stored_len
    grown = 4 * mid.stored_len  # a delta covering several steps of change: far above the base's own size
    assert grown < 0.5 * key.stored_len
    assert policy.accepts(grown, base, key.raw_len)


def _change_a_stored_value(store: Store, cid: bytes) -> None:
    """Replace one nonzero value of delta chunk ``cid``'s zero-sparse planes (stored as is) by another nonzero
    one: the chunk still decodes, to bytes that no longer match its hash."""
    entry = store.index.lookup(cid)
    key, start = pack_key(entry.pack), entry.offset + HEADER_SIZE
    data = bytearray(store.backend.get(key))
    payload = bytes(data[start:start + entry.stored_len])
    for mode, off, _slen in codec.plane_layout(payload, entry.raw_len, entry.elem_size):
        if mode == codec.SEG_SPARSE:
            nnz, _bm_mode, bm_len, vals_mode = planes._SPARSE.unpack_from(payload, off)
            if nnz and vals_mode == codec.SEG_RAW:
                at = start + off + planes._SPARSE.size + bm_len
                data[at] = 0x55 if data[at] != 0x55 else 0x66
                mutate_object(store.backend, key, lambda _old: data)
                return
    raise AssertionError("no plane with values stored as is")


def test_a_chain_restore_checks_the_hash_of_the_chunk_it_restores_only(tmp_path, monkeypatch):
    store, states = _chained_store(tmp_path / "s", 8, 9)
    ids = _chunk_ids(store, "c8")
    assert {_depth(store, c) for c in ids} == {8}
    hashed = []
    real = source_mod.chunk_id_of
    monkeypatch.setattr(source_mod, "chunk_id_of", lambda buf: (hashed.append(1), real(buf))[1])
    np.testing.assert_array_equal(Store.open(tmp_path / "s").load("c8")["w"], states[8])
    assert len(hashed) == len(set(ids)), "one hash per restored chunk, none for the 8 chunks below each"


def test_damage_in_the_middle_of_a_chain_is_caught_by_the_tip_and_named_at_its_link(tmp_path):
    store, states = _chained_store(tmp_path / "s", 4, 4)
    ids = [_chunk_ids(store, f"c{i}")[0] for i in range(4)]
    assert [_depth(store, c) for c in ids] == [0, 1, 2, 3]
    _change_a_stored_value(store, ids[1])  # decodes cleanly, to the wrong bytes
    reopened = Store.open(tmp_path / "s")
    np.testing.assert_array_equal(reopened.load("c0")["w"], states[0])
    for name in ("c1", "c3"):
        with pytest.raises(CorruptChunkError) as ei:
            Store.open(tmp_path / "s").load(name)
        err = ei.value if name == "c1" else ei.value.__cause__
        assert err.chunk_id == ids[1].hex() and "do not match their hash" in str(err)
    assert ei.value.chunk_id == ids[3].hex() and ei.value.base_chunk_id == ids[2].hex()
    report = verify_store(reopened, level=2)
    assert ids[1].hex() in {p.chunk_id for p in report.problems}


def test_a_loads_bundles_count_the_links_down_each_chain(tmp_path):
    # A bundle is one thread's job: counting a delta's own bytes and its base's only packed a deep chain's
    # load into a few bundles that 2 threads could not share; each bundle must stay within its byte budget
    # counted over every link it decodes.
    from deltackpt.store.reader import _BUNDLE, BUNDLE_BYTES, CheckpointReader

    store = Store.init(tmp_path / "s", chunk_size_bytes=CHUNK, max_chain=8)
    for i, w in enumerate(_sparse_steps(3, 9, n=16 * CHUNK // 4)):
        store.save(f"c{i}", {"w": w})
    ids = _chunk_ids(store, "c8")
    assert min(_depth(store, cid) for cid in ids) >= 4

    def chain_bytes(cid: bytes) -> int:
        entry, total = store.index.lookup(cid), 0
        while True:
            total += entry.span
            if not codec.is_delta(entry.codec):
                return total
            entry = store.index.lookup(entry.base_id)

    with CheckpointReader(store, store.read_manifest("c8"), num_threads=2) as reader:
        out = np.empty(reader.item("w").nbytes, dtype=np.uint8)
        jobs = reader.coalesce(reader.chunk_jobs("w", out))
        limit = min(BUNDLE_BYTES, -(-sum(chain_bytes(cid) for cid in ids) // 2))
        bundles = [job for job in jobs if job[0] is _BUNDLE]
        assert bundles and len(jobs) >= 4
        for job in bundles:
            assert sum(chain_bytes(part[2].id) for part in job[1]) <= limit
        for job in jobs:
            reader.run_job(job)
    assert np.array_equal(out.view(np.float32), _sparse_steps(3, 9, n=16 * CHUNK // 4)[-1])


def _dense_steps(seed: int, count: int, n: int = 16_384) -> list[np.ndarray]:
    """``count`` states where every element moves each step (Adam moments, a dense LM's weights)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n) * 0.05).astype(np.float32)
    out = [w.copy()]
    for _ in range(count - 1):
        w = w * np.float32(1.0001) + np.float32(1e-6)
        out.append(w.copy())
    return out


@pytest.mark.parametrize("reopen", [False, True])
def test_only_sparse_deltas_grow_chains(tmp_path, reopen):
    """A delta that is a pass over the chunk is never a base: its place's next delta goes against the keyframe,
    so chains cost restores only their sparse links' nonzero bytes (with or without the writer's cache)."""
    store = Store.init(tmp_path / "s", chunk_size_bytes=CHUNK, max_chain=8)
    dense, sparse = _dense_steps(1, 6), _sparse_steps(1, 6)
    for i, (d, s) in enumerate(zip(dense, sparse)):
        if reopen:
            store = Store.open(tmp_path / "s")
        store.save(f"c{i}", {"dense": d, "sparse": s})
    last = store.read_manifest("c5")
    depth = {it.key: max(_depth(store, r.id) for r in it.chunks) for it in last.items}
    assert depth["dense"] == 1 and depth["sparse"] == 5
    reopened = Store.open(tmp_path / "s")
    for i in range(6):
        got = reopened.load(f"c{i}")
        np.testing.assert_array_equal(got["dense"], dense[i])
        np.testing.assert_array_equal(got["sparse"], sparse[i])


def test_sparse_link_rule_reads_the_stored_delta():
    rng = np.random.default_rng(3)
    base = rng.standard_normal(4096).astype(np.float32)
    few, every = base.copy(), base * np.float32(1.001)
    few[::500] += np.float32(1e-3)
    for new, sparse in ((few, True), (every, False)):
        stored = bytes(codec.encode_delta(new.view(np.uint8), base.view(np.uint8), 4, 1, codec.ZDELTA))
        assert deltapolicy.is_sparse_link(stored, new.nbytes, 4) is sparse
    assert not deltapolicy.is_sparse_link(b"DCPL" + b"\0" * 40, few.nbytes, 4)  # damaged: never a base


@pytest.mark.parametrize("keep", [1, 3])
def test_gc_marks_each_chain_from_the_pack_tables_as_the_index_does(tmp_path, keep):
    """gc's marking follows a tip's chain through the pack tables, level by level, and keeps each entry's
    position in the growing live set as bases are merged in: the same set as the index's chains give, and
    the positions a fresh search of it gives."""
    from deltackpt.store import idset, mark
    from deltackpt.store.pack import read_pack_table

    store, _ = _chained_store(tmp_path / "s", 4, 6)
    store.forget([f"c{i}" for i in range(6 - keep)])
    tables = [read_pack_table(store.backend, n, i.size_bytes) for n, i in list_packs(store.backend).items()]
    ids = np.concatenate([t.chunk_ids for t in tables])
    bases = np.concatenate([t.base_ids for t in tables])
    has_base = np.concatenate([t.has_base for t in tables])
    manifest_ids = mark.manifest_ids(store)
    live, pos = mark.mark_live(store, manifest_ids, bases[:0], ids, bases, has_base)
    want = mark.with_chain_bases(store, manifest_ids)
    assert live.size > manifest_ids.size, "the tips are coded against chunks of forgotten checkpoints"
    assert live.tobytes() == want.tobytes()
    assert pos.tolist() == idset.find(live, ids).tolist()


@pytest.mark.parametrize("reopen", [False, True])
def test_chain_links_all_chains_dense_deltas_and_restores_them(tmp_path, reopen):
    """With ``chain_links`` "all" a dense delta is a base too: its place's chain grows to ``max_chain`` (with or
    without the writer's cache), fewer bytes are stored than with sparse links only, and every checkpoint
    restores bit-exact and verifies, also once the checkpoints a chain runs through are forgotten."""
    dense = _dense_steps(1, 7)
    sizes = {}
    for links in ("sparse", "all"):
        path = tmp_path / links
        store = Store.init(path, chunk_size_bytes=CHUNK, max_chain=4, chain_links=links)
        for i, d in enumerate(dense):
            if reopen:
                store = Store.open(path)
            store.save(f"c{i}", {"dense": d})
        depths = [_depth(store, cid) for i in range(7) for cid in _chunk_ids(store, f"c{i}")]
        assert max(depths) == (4 if links == "all" else 1)
        sizes[links] = sum(i.added_bytes for i in store.list_checkpoints())
        reopened = Store.open(path)
        for i, d in enumerate(dense):
            np.testing.assert_array_equal(reopened.load(f"c{i}")["dense"], d)
        assert verify_store(reopened, level=2).clean
    assert sizes["all"] < sizes["sparse"]
    store = Store.open(tmp_path / "all")
    store.forget([f"c{i}" for i in range(6)])
    plan_gc(store, grace_s=0).execute()
    np.testing.assert_array_equal(Store.open(tmp_path / "all").load("c6")["dense"], dense[6])
    assert verify_store(Store.open(tmp_path / "all"), level=2).clean


def test_chain_links_is_left_out_at_its_default_and_named_by_a_feature_otherwise(tmp_path, monkeypatch):
    Store.init(tmp_path / "s")
    raw = json.loads((tmp_path / "s" / "config").read_bytes())
    assert "chain_links" not in raw and "chain-all-deltas" not in raw["features"]  # older readers open it
    assert Store.open(tmp_path / "s").config.chain_links == "sparse"
    Store.init(tmp_path / "all", chain_links="all")
    raw = json.loads((tmp_path / "all" / "config").read_bytes())
    assert raw["chain_links"] == "all" and "chain-all-deltas" in raw["features"]
    # A reader from before the field: it refuses the store by the feature's name, not as a damaged config.
    monkeypatch.setattr(config_mod, "SUPPORTED_FEATURES",
                        {k: v for k, v in config_mod.SUPPORTED_FEATURES.items() if k != "chain-all-deltas"})
    with pytest.raises(UnsupportedFormatError, match="chain-all-deltas"):
        Store.open(tmp_path / "all")


@pytest.mark.parametrize("config,match", [({"chain_links": "dense"}, "chain_links must be one of"),
                                          ({"chain_links": "all", "max_chain": 1}, "needs max_chain > 1")])
def test_a_bad_chain_links_setting_is_refused(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        Store.init(tmp_path / "s", **config)
    assert not (tmp_path / "s" / "config").exists()


def test_chain_links_names_a_config_field_that_copies_and_repairs_do_not_carry(tmp_path):
    """The feature guards ``chain_links`` in a config: a copy's destination keeps its own setting (and needs
    only the data's features), a recreated config is at the default; neither lists the feature, so a reader
    that does not know it still opens them."""
    from deltackpt.store.repair import repair_store

    src = Store.init(tmp_path / "src", chunk_size_bytes=CHUNK, chain_links="all")
    for i, d in enumerate(_dense_steps(2, 4)):
        src.save(f"c{i}", {"dense": d})
    dst = Store.init(tmp_path / "dst", chunk_size_bytes=CHUNK, max_chain=1)
    copy_checkpoints(src, dst)
    raw = json.loads((tmp_path / "dst" / "config").read_bytes())
    assert "chain-all-deltas" not in raw["features"] and "delta-chains" in raw["features"]
    np.testing.assert_array_equal(Store.open(tmp_path / "dst").load("c3")["dense"], _dense_steps(2, 4)[3])
    (tmp_path / "src" / "config").unlink()
    repair_store(tmp_path / "src")
    raw = json.loads((tmp_path / "src" / "config").read_bytes())
    assert "chain-all-deltas" not in raw["features"] and "chain_links" not in raw
    assert verify_store(Store.open(tmp_path / "src"), level=2).clean


def test_chain_links_without_its_feature_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs the feature chain-all-deltas"):
        Store.init(tmp_path / "s", chain_links="all", features=("delta-chains", "plane-container"))
    assert not (tmp_path / "s" / "config").exists()


@pytest.mark.parametrize("links, gain", [("sparse", None), ("all", codec.MIN_ZDELTA_PLANE_GAIN_ALL)])
def test_a_store_made_for_the_fewest_bytes_zstd_codes_zigzag_planes_that_save_a_little(monkeypatch, links, gain):
    """chain_links "all" trades load time for bytes; it also zstd-codes a zigzag-difference plane that saves
    3 % (bf16 run: 393.95 -> 392.77 MiB), where other stores want 10 % for the time a zstd pass costs."""
    seen = []
    real = codec.encode_delta

    def spy(raw, base, elem_size, level, kind=codec.DELTA, zdelta_gain=None):
        seen.append((kind, zdelta_gain))
        return real(raw, base, elem_size, level, kind, zdelta_gain)

    monkeypatch.setattr(codec, "encode_delta", spy)
    store = Store.init(MemoryBackend(), chunk_size_bytes=1 << 20, chain_links=links)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(1 << 18).astype(np.float32)
    store.save("a", {"w": w})
    w2 = w + (rng.standard_normal(w.size) * 1e-6).astype(np.float32)
    store.save("b", {"w": w2})
    assert seen and {g for _k, g in seen} == {gain}
    np.testing.assert_array_equal(store.load("b")["w"], w2)


@pytest.mark.parametrize("op", ["load", "verify", "gc"])
def test_a_store_object_opened_before_chains_arrived_follows_them(tmp_path, op):
    """A Store opened before another one copied chained checkpoints in (the copy adds ``delta-chains`` to the
    config): it walked chains by the config it read at open, so its loads and verify called intact chains
    damaged, and its gc left deeper bases unmarked and deleted them (a rank's Store while the coordinator
    fetched a chained remote; any long-lived process)."""
    from deltackpt.store.retention import plan_forget_names

    cfg = dict(chunk_size_bytes=4096, pack_target_bytes=16384)
    src = Store.init(tmp_path / "src", max_chain=16, chain_links="all", keyframe_interval=30, **cfg)
    Store.init(tmp_path / "dst", max_chain=1, **cfg)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(8192).astype(np.float32)
    saved = {}
    for i in range(12):
        w.view(np.uint32)[rng.integers(0, w.size, 20)] += np.uint32(1)
        saved[f"c{i:02d}"] = w.copy()
        src.save(f"c{i:02d}", {"w": saved[f"c{i:02d}"]})
    stale = Store.open(tmp_path / "dst")
    copy_checkpoints(src, Store.open(tmp_path / "dst"))
    assert config_mod.CHAINS_FEATURE not in stale.config.features
    if op == "load":
        np.testing.assert_array_equal(stale.load("c11")["w"], saved["c11"])
        assert stale.index.damaged_packs() == frozenset()
    elif op == "verify":
        assert verify_store(stale, level=2).clean
    else:
        plan_forget_names(Store.open(tmp_path / "dst"), [f"c{i:02d}" for i in range(10)]).execute()
        plan_gc(stale, grace_s=0, max_unused=0.0).execute()
    fresh = Store.open(tmp_path / "dst")
    for name in fresh.checkpoint_names():
        np.testing.assert_array_equal(fresh.load(name)["w"], saved[name])
    assert verify_store(fresh, level=2).clean


def test_gc_does_not_repack_a_damaged_pack_into_a_valid_one(tmp_path):
    """Bit rot in a pack gc then repacks: its bytes were copied into a new pack with a correct hash, so verify's
    default level (pack hashes) called the store clean while the chunk and every delta on it did not load. The
    damaged pack is now left as it is (and marked), for verify and repair."""
    from deltackpt.store.pack import HEADER_SIZE
    from deltackpt.store.retention import plan_forget_names

    store = Store.init(tmp_path / "s", chunk_size_bytes=4096, pack_target_bytes=1 << 20, max_chain=8,
                       chain_links="all")
    rng = np.random.default_rng(0)
    w = rng.standard_normal(8192).astype(np.float32)
    store.save("c0", {"w": w.copy(), "junk": rng.standard_normal(8192).astype(np.float32)})  # one pack
    for i in range(1, 4):
        w.view(np.uint32)[rng.integers(0, w.size, 20)] += np.uint32(1)
        store.save(f"c{i}", {"w": w.copy()})
    e = store.index.lookup(store.read_manifest("c0").items[0].chunks[0].id)
    def flip(data: bytes) -> bytes:
        data = bytearray(data)
        data[e.offset + HEADER_SIZE + e.stored_len // 2] ^= 0xFF
        return bytes(data)

    mutate_object(store.backend, pack_key(e.pack), flip)
    plan_forget_names(store, ["c0"]).execute()  # its "junk" dies: the pack is planned for a repack
    plan = plan_gc(store, grace_s=0)
    assert e.pack in plan.repack
    result = plan.execute()
    assert store.backend.exists(pack_key(e.pack)) and result.repacked_packs == 0 and result.new_packs == 0
    report = verify_store(Store.open(tmp_path / "s"), level=1)
    assert sorted(report.damaged_checkpoints) == ["c1", "c2", "c3"]

"""Delta coding: lossless round trips, bounded chains, keyframe refresh, damaged bases."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltackpt import kernels
from deltackpt.errors import CorruptChunkError
from deltackpt.store import MemoryBackend, Store, codec, planes
from deltackpt.store.pack import HEADER_SIZE, pack_key

DTYPES = ["float32", "float16", "int64", "uint8", "bfloat16"]


def _np_dtype(name):
    return np.dtype("uint16") if name == "bfloat16" else np.dtype(name)


def _codecs(store: Store) -> Counter:
    """Entries per codec name; both delta codecs (XOR, zigzag difference) count as "delta"."""
    return Counter("delta" if codec.is_delta(e.codec) else codec.CODEC_NAMES[e.codec]
                   for e in store.index.iter_entries())


def _store_with_first_save(tmp_path, seed: int):
    """(backend, store, rng, w): a memory store holding checkpoint "c0" = {"w": w}."""
    backend = MemoryBackend()
    store = Store.init(backend, cache_dir=tmp_path / "c", chunk_size_bytes=16384)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(40_000) * 0.05).astype(np.float32)
    store.save("c0", {"w": w})
    return backend, store, rng, w


def _record_reads(backend) -> list:
    """The keys of every ranged read from ``backend`` from now on."""
    reads = []
    real_get_range = backend.get_range
    backend.get_range = lambda key, off, n: reads.append(key) or real_get_range(key, off, n)
    return reads


@pytest.fixture
def mem_store(tmp_path):
    return Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=16384)


@settings(deadline=None, max_examples=40)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 3000),
    seed=st.integers(0, 2**32 - 1),
    flip_frac=st.floats(0, 1),
)
def test_delta_codec_round_trips_every_dtype(dtype, n, seed, flip_frac):
    rng = np.random.default_rng(seed)
    es = _np_dtype(dtype).itemsize
    base = rng.integers(0, 256, n * es + (seed % 3), dtype=np.uint8)  # odd lengths too
    new = base.copy()
    mask = rng.random(new.size) < flip_frac
    new[mask] = rng.integers(0, 256, int(mask.sum()), dtype=np.uint8)
    stored = codec.encode_delta(new, base, es, 1)
    out = codec.decode(codec.DELTA, stored, len(new), es, base)
    assert bytes(out) == new.tobytes()
    for cod, blob in [codec.encode_best(new, es, 1, 0.03), (codec.RAW, new.tobytes())]:
        assert bytes(codec.decode(cod, blob, len(new), es)) == new.tobytes()


def test_delta_decode_parity_native_numpy():
    if kernels.native_impl is None:
        pytest.skip("native kernels not built")
    rng = np.random.default_rng(7)
    a = rng.standard_normal(50_001).astype(np.float32)
    b = (a + rng.standard_normal(a.size).astype(np.float32) * 1e-4).astype(np.float32)
    for es in (1, 2, 4, 8):
        nat = kernels.native_impl.xor_shuffle(b, a, es)
        ref = kernels.numpy_impl.xor_shuffle(b, a, es)
        assert np.array_equal(nat, ref)
        assert np.array_equal(kernels.native_impl.unshuffle_xor(nat, a, es), kernels.numpy_impl.unshuffle_xor(ref, a, es))


def _drift(rng, w, scale):
    return (w + rng.standard_normal(w.size).astype(w.dtype) * scale).astype(w.dtype)


def test_small_changes_are_stored_as_deltas_and_restore_bit_exact(mem_store):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(60_000) * 0.05).astype(np.float32)
    first = mem_store.save("c0", {"w": w})
    w1 = _drift(rng, w, 1e-5)
    second = mem_store.save("c1", {"w": w1})
    assert _codecs(mem_store)["delta"] > 0
    assert second.stats.stored_bytes < 0.8 * first.stats.stored_bytes
    assert np.array_equal(mem_store.load("c1")["w"], w1)
    assert np.array_equal(mem_store.load("c0")["w"], w)


def test_twenty_checkpoint_chain_restores_every_checkpoint(tmp_path):
    store = Store.init(tmp_path / "s", chunk_size_bytes=16384, keyframe_interval=4, max_chain=1)
    rng = np.random.default_rng(2)
    w = (rng.standard_normal(40_000) * 0.05).astype(np.float32)
    h = rng.integers(0, 1000, 5_000).astype(np.int64)
    saved = {}
    for i in range(20):
        w = _drift(rng, w, 1e-5)
        h[rng.integers(0, h.size, 10)] += 1
        store.save(f"c{i}", {"w": w, "h": h, "meta": f"step {i}".encode()})
        saved[f"c{i}"] = (w.copy(), h.copy())
    reopened = Store.open(tmp_path / "s")
    for name, (ew, eh) in saved.items():
        out = reopened.load(name)
        assert np.array_equal(out["w"], ew) and np.array_equal(out["h"], eh), name
    entries = list(reopened.index.iter_entries())
    by_id = {e.chunk_id: e for e in entries}
    deltas = [e for e in entries if codec.is_delta(e.codec)]
    assert deltas, "expected delta chunks"
    for e in deltas:
        base = by_id[e.base_id]
        assert not codec.is_delta(base.codec), "a delta's base must be a keyframe"
        assert 1 <= e.age <= 4, "keyframes are refreshed after keyframe_interval checkpoints at the latest"
    keyframes_of_w = [e for e in entries if not codec.is_delta(e.codec) and e.elem_size == 4]
    # 20 checkpoints, bases retire after 4 uses -> at least 20/5 keyframe generations per chunk position
    assert len(keyframes_of_w) >= 4 * 3


def test_a_keyframe_is_refreshed_once_its_deltas_cost_more_than_a_new_cycle(tmp_path):
    """Deltas against an aging keyframe grow as changed elements pile up (sparse rows, Adam moments filling
    in). The base is refreshed once the next delta costs more than its cycle so far per checkpoint (the
    keyframe and its deltas), well before keyframe_interval, and that stores fewer bytes than keeping it."""
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "c", chunk_size_bytes=16384, max_chain=1)
    assert store.config.keyframe_interval == 10
    rng = np.random.default_rng(11)
    w = rng.standard_normal(3 * 4096).astype(np.float32)  # three chunks of near-random mantissas
    states = [w]
    for _ in range(9):  # 1/16 of the elements get new values per checkpoint
        w = w.copy()
        rows = rng.choice(w.size, w.size // 16, replace=False)
        w[rows] = rng.standard_normal(rows.size).astype(np.float32)
        states.append(w)
    stored = sum(store.save(f"c{i}", {"w": s}).stats.stored_bytes for i, s in enumerate(states))
    keyframes = [e for e in store.index.iter_entries() if not codec.is_delta(e.codec)]
    assert len(keyframes) > 3, "every place refreshed its keyframe within the 10 checkpoints"
    for i, s in enumerate(states):
        assert np.array_equal(store.load(f"c{i}")["w"], s)
    first = states[0].view(np.uint8)
    kept = store.read_manifest("c0").stats.stored_bytes + sum(  # keeping c0's keyframes for every checkpoint
        len(codec.encode_delta(s.view(np.uint8)[o:o + 16384], first[o:o + 16384], 4, 1, codec.ZDELTA))
        for s in states[1:] for o in range(0, first.size, 16384))
    assert stored < 0.95 * kept


def test_keyframe_refreshes_when_delta_stops_paying(mem_store):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(20_000) * 0.05).astype(np.float32)
    mem_store.save("c0", {"w": w})
    other = (rng.standard_normal(20_000) * 0.05).astype(np.float32)  # unrelated content: delta useless
    mem_store.save("c1", {"w": other})
    assert _codecs(mem_store)["delta"] == 0
    assert np.array_equal(mem_store.load("c1")["w"], other)


def test_delta_disabled_by_config(tmp_path):
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "c", chunk_size_bytes=16384, delta=False)
    rng = np.random.default_rng(4)
    w = (rng.standard_normal(20_000) * 0.05).astype(np.float32)
    store.save("c0", {"w": w})
    store.save("c1", {"w": _drift(rng, w, 1e-6)})
    assert _codecs(store)["delta"] == 0


def test_base_is_read_from_store_when_not_cached(mem_store):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(20_000) * 0.05).astype(np.float32)
    mem_store.save("c0", {"w": w})
    mem_store.base_cache.clear()  # as after a restart
    w1 = _drift(rng, w, 1e-6)
    mem_store.save("c1", {"w": w1})
    assert _codecs(mem_store)["delta"] > 0
    assert np.array_equal(mem_store.load("c1")["w"], w1)


def test_corrupt_base_names_both_chunks(tmp_path):
    store = Store.init(tmp_path / "s", chunk_size_bytes=16384)
    rng = np.random.default_rng(6)
    w = (rng.standard_normal(4096) * 0.05).astype(np.float32)  # exactly one chunk
    store.save("c0", {"w": w})
    store.save("c1", {"w": _drift(rng, w, 1e-6)})
    entries = {e.chunk_id: e for e in store.index.iter_entries()}
    delta = next(e for e in entries.values() if codec.is_delta(e.codec))
    base = entries[delta.base_id]
    path = tmp_path / "s" / pack_key(base.pack)
    data = bytearray(path.read_bytes())
    data[base.offset + HEADER_SIZE + 10] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError) as info:
        Store.open(tmp_path / "s").load("c1")
    err = info.value
    assert err.chunk_id == delta.chunk_id.hex()
    assert err.base_chunk_id == base.chunk_id.hex()
    assert base.chunk_id.hex() in str(err) and delta.chunk_id.hex() in str(err)


def test_damaged_base_is_not_built_upon(tmp_path):
    """A save whose base is corrupt writes a keyframe instead of a delta nobody could decode."""
    store = Store.init(tmp_path / "s", chunk_size_bytes=16384)
    rng = np.random.default_rng(8)
    w = (rng.standard_normal(4096) * 0.05).astype(np.float32)
    store.save("c0", {"w": w})
    (entry,) = list(store.index.iter_entries())
    path = tmp_path / "s" / pack_key(entry.pack)
    data = bytearray(path.read_bytes())
    data[entry.offset + HEADER_SIZE + 5] ^= 0x01
    path.write_bytes(bytes(data))
    w1 = _drift(rng, w, 1e-6)
    Store.open(tmp_path / "s").save("c1", {"w": w1})
    reopened = Store.open(tmp_path / "s")
    assert np.array_equal(reopened.load("c1")["w"], w1)


def test_base_cache_spares_reading_bases_back(tmp_path):
    """With its cache on, a Store's later save finds its delta bases in memory."""
    backend = MemoryBackend()
    store = Store.init(backend, cache_dir=tmp_path / "c", chunk_size_bytes=16384)
    store.base_cache.limit(64 << 20)
    rng = np.random.default_rng(9)
    w = (rng.standard_normal(40_000) * 0.05).astype(np.float32)
    store.save("c0", {"w": w})
    reads = _record_reads(backend)
    w1 = _drift(rng, w, 1e-6)
    store.save("c1", {"w": w1})
    assert _codecs(store)["delta"] > 0
    assert not [k for k in reads if k.startswith("packs/")], "bases should come from the cache"
    assert np.array_equal(store.load("c1")["w"], w1)
    assert Store.open(backend, cache_dir=tmp_path / "c").base_cache.size_bytes == 0  # each Store owns its own


@pytest.mark.parametrize("env", [None, "0"])
def test_second_save_through_a_store_turns_its_cache_on(tmp_path, monkeypatch, env):
    """One save keeps no copies; a second save through the same Store (a training loop) raises its cache to
    AUTO_CAP_BYTES and keeps the bases it reads back, so the third reads none. An explicit
    DELTACKPT_BASE_CACHE_BYTES wins."""
    from deltackpt.store import basecache

    if env is None:
        monkeypatch.delenv("DELTACKPT_BASE_CACHE_BYTES", raising=False)
    else:
        monkeypatch.setenv("DELTACKPT_BASE_CACHE_BYTES", env)
    backend, store, rng, w = _store_with_first_save(tmp_path, seed=10)
    cache = store.base_cache
    assert cache.cap_bytes == 0 and cache.size_bytes == 0
    w = _drift(rng, w, 1e-6)
    store.save("c1", {"w": w})
    assert cache.cap_bytes == (basecache.AUTO_CAP_BYTES if env is None else 0)
    reads = _record_reads(backend)
    w = _drift(rng, w, 1e-6)
    store.save("c2", {"w": w})
    assert _codecs(store)["delta"] > 0
    base_reads = [k for k in reads if k.startswith("packs/")]
    assert (not base_reads) if env is None else base_reads
    assert np.array_equal(store.load("c2")["w"], w)


def test_a_save_after_a_restore_keeps_its_keyframes(tmp_path, monkeypatch):
    """A resumed run restores, then saves: that first save already keeps its keyframes, so the next save reads
    no bases back from the store."""
    from deltackpt.store import basecache

    monkeypatch.delenv("DELTACKPT_BASE_CACHE_BYTES", raising=False)
    backend, _, rng, w = _store_with_first_save(tmp_path, seed=15)
    store = Store.open(backend, cache_dir=tmp_path / "c2")  # as if in a new process
    cache = store.base_cache
    assert np.array_equal(store.load("c0")["w"], w)
    assert cache.cap_bytes == 0
    w = rng.standard_normal(w.size).astype(np.float32)  # all new: keyframes
    store.save("c1", {"w": w})
    assert cache.cap_bytes == basecache.AUTO_CAP_BYTES
    c1_ids = {r.id for r in store.read_manifest("c1").item_map()["w"].chunks}
    assert c1_ids <= set(cache._data)
    reads = _record_reads(backend)
    w = _drift(rng, w, 1e-6)
    store.save("c2", {"w": w})
    assert _codecs(store)["delta"] > 0
    assert not [k for k in reads if k.startswith("packs/")]
    assert np.array_equal(store.load("c2")["w"], w)


def test_a_store_sent_to_a_worker_keeps_its_cap_and_the_workers_cache(tmp_path):
    """DCP's process-based async save sends the Store to its worker once per save: the cap travels, and the
    Stores the worker receives for one store share its cache, so the worker's next save finds its bases."""
    import pickle  # how multiprocessing sends it; the store never reads pickle back

    store = Store.init(tmp_path / "s", chunk_size_bytes=16384)
    store.base_cache.limit(1 << 20)
    first, second = pickle.loads(pickle.dumps(store)), pickle.loads(pickle.dumps(store))
    assert first.base_cache is second.base_cache and first.base_cache is not store.base_cache
    assert first.base_cache.cap_bytes == 1 << 20 and first.base_cache.fixed


def test_sample_decides_between_delta_and_keyframe():
    from deltackpt.store.deltapolicy import _sample_prefers_delta

    rng = np.random.default_rng(10)
    base = rng.standard_normal(1 << 18).astype(np.float32)
    close = (base + rng.standard_normal(base.size).astype(np.float32) * 1e-6).astype(np.float32)
    unrelated = rng.standard_normal(base.size).astype(np.float32)
    limit = 0.9 * len(codec.encode_planes(base, 4, 1)) / base.nbytes  # the keyframe's ratio, less 10 %
    assert _sample_prefers_delta(memoryview(close).cast("B"), base, 4, 1, limit).pays is True
    assert _sample_prefers_delta(memoryview(unrelated).cast("B"), base, 4, 1, limit).pays is False
    assert _sample_prefers_delta(memoryview(close[:1000]).cast("B"), base[:1000], 4, 1, limit).pays is None


def test_chunks_the_sample_rejects_are_coded_once_as_keyframes(tmp_path, monkeypatch):
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=1 << 20)
    rng = np.random.default_rng(11)
    store.save("c0", {"w": rng.standard_normal(1 << 18).astype(np.float32)})
    calls = Counter()
    for name in ("encode_delta", "encode_planes"):
        real = getattr(codec, name)
        monkeypatch.setattr(codec, name, lambda *a, _r=real, _n=name: (calls.update([(_n, len(a[0]))]), _r(*a))[1])
    store.save("c1", {"w": rng.standard_normal(1 << 18).astype(np.float32)})  # unrelated: no delta pays
    full = [k for k in calls if k[1] == 1 << 20]
    assert full == [("encode_planes", 1 << 20)] and calls[full[0]] == 1
    assert _codecs(store)["delta"] == 0



def _count_codings(monkeypatch) -> Counter:
    """(codec function, input length) -> calls, from now on."""
    calls = Counter()
    for name in ("encode_delta", "encode_planes"):
        real = getattr(codec, name)
        monkeypatch.setattr(codec, name, lambda *a, _r=real, _n=name: (calls.update([(_n, len(a[0]))]), _r(*a))[1])
    return calls


def test_a_place_whose_last_delta_paid_off_skips_the_sample(tmp_path, monkeypatch):
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=1 << 20)
    rng = np.random.default_rng(12)
    w = rng.standard_normal(1 << 18).astype(np.float32)  # one 1 MiB chunk
    store.save("c0", {"w": w})
    calls = _count_codings(monkeypatch)
    store.save("c1", {"w": _drift(rng, w, 1e-6)})  # no history yet: the sample decides, then the delta
    assert _codecs(store)["delta"] == 1
    assert calls[("encode_delta", 1 << 20)] == 1 and any(n < 1 << 20 for _, n in calls)
    calls.clear()
    w2 = _drift(rng, w, 1e-6)
    store.save("c2", {"w": w2})  # the parent's delta paid off: coded outright, no sample
    assert dict(calls) == {("encode_delta", 1 << 20): 1}
    assert _codecs(store)["delta"] == 2
    assert np.array_equal(store.load("c2")["w"], w2)


def test_chunks_much_smaller_than_the_chunk_size_are_keyframes(tmp_path, monkeypatch):
    """A bias or norm shard of a few hundred bytes is never delta-coded nor cached as a base."""
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=1 << 20)
    cache = store.base_cache
    rng = np.random.default_rng(14)
    small = rng.standard_normal(256).astype(np.float32)  # 1 KiB
    big = rng.standard_normal(1 << 16).astype(np.float32)  # 256 KiB: a quarter chunk, delta-coded
    for i in range(3):
        small, big = _drift(rng, small, 1e-6), _drift(rng, big, 1e-6)
        store.save(f"c{i}", {"small": small, "big": big})
    small_ids = {r.id for r in store.read_manifest("c2").item_map()["small"].chunks}
    big_ids = {r.id for r in store.read_manifest("c2").item_map()["big"].chunks}
    assert not all(codec.is_delta(store.index.lookup(c).codec) for c in small_ids)
    assert all(codec.is_delta(store.index.lookup(c).codec) for c in big_ids)
    cached = set(cache._data)
    big_bases = {store.index.lookup(c).base_id for c in big_ids}
    assert big_bases <= cached and not small_ids & cached
    assert np.array_equal(store.load("c2")["small"], small)
    assert np.array_equal(store.load("c2")["big"], big)

# -- the plane container ----------------------------------------------------------------------------------------


def _modes(stored, elem_size: int) -> list[int]:
    stored = bytes(stored)
    assert stored[:4] == codec.PLANES_MAGIC
    return [stored[4 + 5 * i] for i in range(elem_size + 1)]


def test_incompressible_planes_are_stored_as_is_and_exponents_are_compressed():
    rng = np.random.default_rng(3)
    w = rng.standard_normal(1 << 18).astype(np.float32)  # 1 MiB: planes judged by a sample
    stored = codec.encode_planes(w, 4, 1)
    modes = _modes(stored, 4)
    assert modes[0] == codec.SEG_RAW and modes[1] == codec.SEG_RAW  # low mantissa bytes: noise
    assert modes[3] == codec.SEG_ZSTD  # sign + exponent byte
    assert len(stored) < 0.9 * w.nbytes
    assert bytes(codec.decode(codec.ZSTD, stored, w.nbytes, 4)) == w.tobytes()
    noise = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    assert _modes(codec.encode_planes(noise, 1, 1), 1)[0] == codec.SEG_RAW


def test_an_evenly_spread_plane_is_stored_as_is_without_trying_zstd(monkeypatch):
    """A plane whose bytes are spread evenly over all values (the low mantissa bytes of new fp32 chunks) skips
    zstd: the equal-pair count shows no coder of independent bytes could shrink it. Planes with any skew
    zstd can use are still tried, and the stored bytes are what trying zstd on every plane stores."""
    rng = np.random.default_rng(31)
    w = rng.standard_normal(1536 * 4).astype(np.float32)  # 6 KiB planes, coded whole (a fine-tune's new chunks)
    tried = []
    real = planes.compressor

    class Counting:
        def __init__(self, cctx):
            self.cctx = cctx

        def compress(self, data):
            tried.append(len(data))
            return self.cctx.compress(data)

    monkeypatch.setattr(planes, "compressor", lambda level: Counting(real(level)))
    stored = codec.encode_planes(w, 4, 1)
    assert _modes(stored, 4)[:4] == [codec.SEG_RAW, codec.SEG_RAW, codec.SEG_RAW, codec.SEG_ZSTD]
    assert tried == [w.nbytes // 4]  # only the sign + exponent plane went to zstd
    # 64 byte values at 1/128 each and 128 at 1/256: 7.5 bits a byte, 6 % for zstd's Huffman coder to save
    skewed = rng.choice(256, 6144, p=np.r_[[2.0] * 64, [1.0] * 128, [0.0] * 64] / 256).astype(np.uint8)
    tried.clear()
    assert _modes(codec.encode_planes(skewed, 1, 1), 1)[0] == codec.SEG_ZSTD and tried == [6144]
    # A plane coded whole keeps any gain, also where a sampled one needs 10 % (a zigzag-difference plane's).
    assert _modes(planes.pack_planes(skewed, 1, 1, 0.1), 1)[0] == codec.SEG_ZSTD and tried == [6144] * 2
    monkeypatch.setattr(planes, "_incompressible", lambda sample, gain: False)  # zstd tries every plane
    assert bytes(codec.encode_planes(w, 4, 1)) == bytes(stored)
    assert len(tried) == 2 + 4  # the two above, then all four planes


def _drifted(n: int, seed: int, frac: float):
    """(base, new): fp32 weights and a copy where ``frac`` of the values moved by about one part in 10^4."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(n) * 0.05).astype(np.float32)
    new = base.copy()
    moved = rng.random(n) < frac
    new[moved] = (new[moved] * np.float32(1 + 1e-4)).astype(np.float32)
    return base, new


@pytest.mark.parametrize("n", [4000, 1 << 18])  # judged on the whole plane / on a sample of it
def test_mostly_zero_delta_planes_are_stored_sparse(n):
    base, new = _drifted(n, 21, 0.2)
    stored = codec.encode_delta(new, base, 4, 1)
    assert _modes(stored, 4)[:4] == [codec.SEG_SPARSE] * 4  # 80 % of the values kept every byte
    assert bytes(codec.decode(codec.DELTA, stored, new.nbytes, 4, base.view(np.uint8))) == new.tobytes()
    base, new = _drifted(n, 21, 0.9)
    stored = codec.encode_delta(new, base, 4, 1)
    modes = _modes(stored, 4)
    assert modes[0] != codec.SEG_SPARSE  # low mantissa bytes of the moved values: noise, mostly nonzero
    assert modes[3] == codec.SEG_SPARSE  # sign + exponent: a move of 1e-4 rarely changes it
    assert bytes(codec.decode(codec.DELTA, stored, new.nbytes, 4, base.view(np.uint8))) == new.tobytes()
    # A plane of all zeros (nothing changed) is a bitmap that zstd shrinks to almost nothing.
    same = codec.encode_delta(base, base, 4, 1)
    assert _modes(same, 4)[:4] == [codec.SEG_SPARSE] * 4 and len(same) < base.nbytes // 50
    assert bytes(codec.decode(codec.DELTA, same, base.nbytes, 4, base.view(np.uint8))) == base.tobytes()


def test_sparse_planes_beat_plain_zstd_on_a_mostly_zero_plane(monkeypatch):
    base, new = _drifted(1 << 18, 22, 0.1)
    sparse = len(codec.encode_delta(new, base, 4, 1))
    monkeypatch.setattr(planes, "SPARSE_MAX_DENSITY", -1.0)  # never sparse
    plain = codec.encode_delta(new, base, 4, 1)
    assert codec.SEG_SPARSE not in _modes(plain, 4)
    assert sparse < len(plain)


def test_keyframe_of_a_mostly_zero_tensor_is_stored_sparse():
    rng = np.random.default_rng(23)
    table = np.zeros((2048, 64), dtype=np.float32)  # an embedding's Adam state: few rows touched yet
    rows = rng.choice(2048, 100, replace=False)
    table[rows] = rng.standard_normal((100, 64)).astype(np.float32)
    cod, stored = codec.encode_best(table.reshape(-1).view(np.uint8), 4, 1, 0.03)
    assert cod == codec.ZSTD and set(_modes(stored, 4)[:4]) == {codec.SEG_SPARSE}
    assert len(stored) < table.nbytes / 10
    assert bytes(codec.decode(cod, stored, table.nbytes, 4)) == table.tobytes()


def test_sparse_planes_decode_through_per_thread_scratch():
    """Decoding a zero-sparse plane reuses this thread's bitmap/values scratch (no buffer per chunk), and a
    result never aliases that scratch."""
    base, new = _drifted(1 << 16, 25, 0.2)
    other = new.copy()
    other[::3] = base[::3]
    outs = []
    for want in (new, other, new):
        stored = codec.encode_delta(want, base, 4, 1)
        outs.append(codec.decode(codec.DELTA, stored, want.nbytes, 4, base.view(np.uint8)))
        scratch = {k: getattr(planes._local, k).__array_interface__["data"][0]
                   for k in ("sparse_bitmap", "sparse_values")}
        if len(outs) == 1:
            first = scratch
    assert scratch == first
    assert [bytes(o) for o in outs] == [new.tobytes(), other.tobytes(), new.tobytes()]


def _sparse_segment(stored: bytes, plane: int) -> tuple[int, int]:
    """(offset, length) of ``plane``'s segment in a 4-byte-element container."""
    pos = codec.container_header_size(4)
    for i in range(plane):
        pos += int.from_bytes(stored[5 + 5 * i:9 + 5 * i], "little")
    return pos, int.from_bytes(stored[5 + 5 * plane:9 + 5 * plane], "little")


@pytest.mark.parametrize("plane", [0, 1])  # values stored as is / zstd-coded
@pytest.mark.parametrize("damage", ["nnz_high", "nnz_low", "bitmap_len", "bitmap_mode", "values_mode",
                                    "short_header", "bitmap_byte", "values_byte"])
def test_damaged_sparse_planes_raise_value_error(damage, plane):
    base, new = _drifted(1 << 16, 24, 0.2)
    stored = bytearray(bytes(codec.encode_delta(new, base, 4, 1)))
    assert stored[4 + 5 * plane] == codec.SEG_SPARSE
    off, length = _sparse_segment(bytes(stored), plane)
    nnz, bm_mode, bm_len, vals_mode = planes._SPARSE.unpack_from(stored, off)
    assert nnz > 0 and bm_mode == codec.SEG_ZSTD and vals_mode == (codec.SEG_RAW, codec.SEG_ZSTD)[plane]
    body = off + planes._SPARSE.size
    if damage == "nnz_high":
        planes._SPARSE.pack_into(stored, off, new.size + 1, bm_mode, bm_len, vals_mode)
    elif damage == "nnz_low":
        planes._SPARSE.pack_into(stored, off, nnz - 1, bm_mode, bm_len, vals_mode)
    elif damage == "bitmap_len":
        planes._SPARSE.pack_into(stored, off, nnz, bm_mode, length, vals_mode)
    elif damage == "bitmap_mode":
        planes._SPARSE.pack_into(stored, off, nnz, 7, bm_len, vals_mode)
    elif damage == "values_mode":
        planes._SPARSE.pack_into(stored, off, nnz, bm_mode, bm_len, 7)
    elif damage == "short_header":
        # the plane claims 3 bytes: its header is cut (the container's trailing bytes would be caught too)
        stored[5 + 5 * plane:9 + 5 * plane] = (3).to_bytes(4, "little")
    elif damage == "bitmap_byte":  # a bit flipped inside a raw-stored bitmap, or a zstd frame damaged
        stored[body + bm_len // 2] ^= 0x10
    else:
        stored[body + bm_len + (length - planes._SPARSE.size - bm_len) // 2] ^= 0x01
    try:
        out = codec.decode(codec.DELTA, bytes(stored), new.nbytes, 4, base.view(np.uint8))
    except ValueError:
        return
    # A flipped value byte that stays nonzero decodes, to other bytes: the chunk hash catches it upstream.
    assert damage in ("values_byte", "bitmap_byte") and bytes(out) != new.tobytes()


def test_single_zstd_frame_payloads_of_older_stores_still_decode():
    import zstandard

    rng = np.random.default_rng(4)
    base = rng.standard_normal(5000).astype(np.float32)
    new = (base + np.float32(1e-4)).astype(np.float32)
    legacy_key = zstandard.ZstdCompressor(level=1).compress(kernels.shuffle(new, 4))
    legacy_delta = zstandard.ZstdCompressor(level=1).compress(kernels.xor_shuffle(new, base, 4))
    assert bytes(codec.decode(codec.ZSTD, legacy_key, new.nbytes, 4)) == new.tobytes()
    assert bytes(codec.decode(codec.DELTA, legacy_delta, new.nbytes, 4, base.view(np.uint8))) == new.tobytes()


def test_decode_into_out_fills_the_destination():
    rng = np.random.default_rng(5)
    base = rng.standard_normal(4099).astype(np.float32)
    new = (base * np.float32(1.001)).astype(np.float32)
    for cod, stored, b in [(codec.ZSTD, codec.encode_planes(new, 4, 1), None),
                           (codec.DELTA, codec.encode_delta(new, base, 4, 1), base.view(np.uint8))]:
        out = np.zeros(new.nbytes, dtype=np.uint8)
        res = codec.decode(cod, stored, new.nbytes, 4, b, out=out)
        assert np.shares_memory(res, out) and out.tobytes() == new.tobytes()



def test_decode_uses_the_callers_planes_scratch():
    rng = np.random.default_rng(7)
    base = rng.standard_normal(3001).astype(np.float32)
    new = (base * np.float32(1.01)).astype(np.float32)
    for cod, stored, b in [(codec.ZSTD, codec.encode_planes(new, 4, 1), None),
                           (codec.DELTA, codec.encode_delta(new, base, 4, 1), base.view(np.uint8))]:
        scratch = np.full(new.nbytes, 0xAB, dtype=np.uint8)
        out = np.zeros(new.nbytes, dtype=np.uint8)
        codec.decode(cod, stored, new.nbytes, 4, b, out=out, scratch=scratch)
        assert out.tobytes() == new.tobytes()
        assert not (scratch == 0xAB).all(), "the planes were decoded into the scratch buffer"
        with pytest.raises(ValueError, match="planes buffer"):
            codec.decode(cod, stored, new.nbytes, 4, b, out=out, scratch=scratch[:-1])
    # One-byte elements: the planes are the raw bytes, decoded straight into ``out``.
    u8 = rng.integers(0, 4, 5000).astype(np.uint8)
    out = np.zeros(u8.size, dtype=np.uint8)
    res = codec.decode(codec.ZSTD, codec.encode_planes(u8, 1, 1), u8.size, 1, out=out)
    assert np.shares_memory(res, out) and out.tobytes() == u8.tobytes()


def test_zstd_frame_with_a_wrong_declared_size_is_rejected():
    import zstandard

    w = np.random.default_rng(8).standard_normal(1000).astype(np.float32)
    frame = zstandard.ZstdCompressor(level=1).compress(kernels.shuffle(w, 4))
    with pytest.raises(ValueError, match="declares"):
        codec.decode(codec.ZSTD, frame, w.nbytes + 4, 4)
    with pytest.raises(ValueError, match="damaged|decoded to"):
        codec.decode(codec.ZSTD, frame[:-7], w.nbytes, 4)

@pytest.mark.parametrize("damage", ["trailing", "mode", "short_header", "raw_length", "bad_magic"])
def test_damaged_plane_containers_raise_value_error(damage):
    w = np.random.default_rng(6).standard_normal(4096).astype(np.float32)
    stored = bytearray(bytes(codec.encode_planes(w, 4, 1)))
    if damage == "trailing":
        stored += b"\0"
    elif damage == "mode":
        stored[4] = 9
    elif damage == "short_header":
        stored = stored[:12]
    elif damage == "raw_length":
        assert stored[4] == codec.SEG_RAW
        stored[5] ^= 1  # plane 0 claims another length
    else:
        stored[:4] = b"XXXX"
    with pytest.raises(ValueError):
        codec.decode(codec.ZSTD, bytes(stored), w.nbytes, 4)


def test_sparse_fill_in_keeps_trying_deltas(tmp_path):
    """Adam state of an embedding table fills in a few rows per interval: a delta that grows past its keyframe
    re-keyframes the place, and the next saves' deltas pay again."""
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=1 << 20)
    rng = np.random.default_rng(13)
    m = np.zeros((1 << 14, 16), dtype=np.float32)  # 1 MiB: one chunk
    sizes = []
    for i in range(8):
        rows = rng.choice(m.shape[0], m.shape[0] // 50, replace=False)
        m[rows] = rng.standard_normal((rows.size, 16)).astype(np.float32)
        sizes.append(store.save(f"c{i}", {"m": m}).stats.stored_bytes)
    deltas = _codecs(store)["delta"]
    assert deltas >= 3, (deltas, sizes)  # growing deltas are re-keyframed; the next ones pay again


def _zstd_coded(rng, es: int, n: int) -> tuple[np.ndarray, bytes]:
    """Raw bytes (floats of little entropy in their high bytes) and their zstd codec bytes with at least one
    zstd-coded plane."""
    raw = (rng.standard_normal(n // 4 + 1).astype(np.float32) * 0.02).view(np.uint8)[:n].copy()
    stored = bytes(codec.encode_planes(raw, es, 1))
    layout = codec.plane_layout(np.frombuffer(stored, np.uint8), n, es)
    assert layout is None or any(mode == codec.SEG_ZSTD for mode, _o, _l in layout)
    return raw, stored


@pytest.mark.parametrize("es, n", [(1, 8192), (2, 8193), (4, 8192), (4, 8195), (8, 8192), (4, 300_000)])
def test_small_frames_decode_in_one_call_as_the_stream_path_does(monkeypatch, es, n):
    """Planes of at most SMALL_FRAME_BYTES are decoded with one call and copied; the same bytes, and the same
    errors for damage, as the stream reader (every frame) gives."""
    raw, stored = _zstd_coded(np.random.default_rng(es * n), es, n)
    layout = codec.plane_layout(np.frombuffer(stored, np.uint8), n, es)
    _mode, at, length = next(seg for seg in layout if seg[0] == codec.SEG_ZSTD)
    damaged = {"flipped": bytearray(stored), "cut": bytearray(stored)}
    damaged["flipped"][at + length // 2] ^= 0xFF
    del damaged["cut"][at + length - 3:at + length]  # the frame ends early, the container still adds up
    damaged["cut"][4 + 5 * layout.index((_mode, at, length)) + 1:][:4] = (length - 3).to_bytes(4, "little")
    results = []
    for small in (planes.SMALL_FRAME_BYTES, 0):
        monkeypatch.setattr(planes, "SMALL_FRAME_BYTES", small)
        out = np.full(n, 0xEE, np.uint8)
        codec.decode(codec.ZSTD, stored, n, es, out=out, scratch=np.empty(n, np.uint8))
        outcome = [out.tobytes()]
        for name, bad in damaged.items():
            try:  # a flip zstd cannot see decodes to other bytes (the chunk's hash then tells)
                outcome.append(codec.decode(codec.ZSTD, bytes(bad), n, es, out=np.empty(n, np.uint8)).tobytes())
            except ValueError:
                outcome.append(ValueError)
        results.append(outcome)
    assert results[0] == results[1]
    assert results[0][0] == raw.tobytes() and results[0][2] is ValueError  # a cut frame never decodes
    assert results[0][1] != raw.tobytes()


def test_a_delta_written_again_for_want_of_its_base_is_indexed_at_its_new_copy(tmp_path):
    """A chunk the index holds as a delta whose base it lost is written again by the next save that has it
    (as a keyframe); the commit points the index at that copy, so later saves and loads need no base."""
    _backend, store, rng, w = _store_with_first_save(tmp_path, seed=5)
    w2 = w.copy()
    w2[rng.integers(0, w.size, 50)] += np.float32(1e-3)
    store.save("c1", {"w": w2})
    deltas = [e for e in store.index.iter_entries() if codec.is_delta(e.codec)]
    assert deltas, "expected c1 to hold deltas against c0"
    store.index.remove_packs({store.index.lookup(d.base_id).pack for d in deltas})  # the bases' pack lost
    store.save("c2", {"w": w2})
    for d in deltas:
        now = store.index.lookup(d.chunk_id)
        assert now.pack != d.pack and not codec.is_delta(now.codec)
    np.testing.assert_array_equal(store.load("c2")["w"], w2)

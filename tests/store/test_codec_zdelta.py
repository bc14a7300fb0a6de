"""The zigzag-difference delta codec (``zdelta``) next to the XOR one: bit-exact round trips of every bit
pattern, what it is for (ulp-sized moves), and how the writer picks between the two per chunk."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltackpt.store import MemoryBackend, Store, codec, deltapolicy
from deltackpt.store.gc import plan_gc
from deltackpt.store.verify import verify_store

DELTA_CODECS = [pytest.param(codec.DELTA, id="xor"), pytest.param(codec.ZDELTA, id="zigzag")]
FLOATS = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def _special_bits(dtype: str) -> np.ndarray:
    """Bit patterns of NaNs (quiet, signalling, with payloads, negative), +-inf, +-0, denormals and the
    extremes, as unsigned integers of the dtype's width (bfloat16: the top half of float32's)."""
    if dtype == "bfloat16":
        return np.array([0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F,
                         0x7F7F, 0xFF7F, 0x0080], dtype=np.uint16)
    f = FLOATS[dtype]
    info = np.finfo(f)
    u = np.dtype(f"u{info.bits // 8}")
    vals = np.array([np.inf, -np.inf, 0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_subnormal,
                     -info.smallest_subnormal, info.tiny - info.smallest_subnormal], dtype=f).view(u)
    nan = np.array([np.nan], dtype=f).view(u)[0]
    mant = u.type((1 << (info.nmant - 1)) - 1)
    sign = u.type(1 << (info.bits - 1))
    nans = np.array([nan, nan | sign, nan | mant, (nan & ~u.type(1 << (info.nmant - 1))) | u.type(1)], dtype=u)
    return np.concatenate([vals, nans])


def _states(dtype: str, n: int, seed: int, moved: float, special: float) -> tuple[np.ndarray, np.ndarray]:
    """(base, new) raw bytes: values of ``dtype``; ``moved`` of them a few units of the last place apart, some
    replaced by unrelated values, and a ``special`` fraction NaN / inf / denormal / zero in either."""
    rng = np.random.default_rng(seed)
    width = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    u = np.dtype(f"u{width}")
    if dtype == "bfloat16":
        base = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        base = (rng.standard_normal(n) * 0.05).astype(dtype).view(u)
    new = base.copy()
    step = rng.integers(-3, 4, n).astype(u)  # wraps: a move of -3 is 2**bits - 3
    pick = rng.random(n) < moved
    new[pick] += step[pick]
    far = rng.random(n) < moved / 10
    new[far] = rng.integers(0, np.iinfo(u).max, int(far.sum()), dtype=u, endpoint=True)
    specials = _special_bits(dtype)
    for arr in (base, new):
        hit = rng.random(n) < special
        arr[hit] = specials[rng.integers(0, specials.size, int(hit.sum()))]
    return base.view(np.uint8), new.view(np.uint8)


@pytest.mark.parametrize("kind", DELTA_CODECS)
@settings(deadline=None, max_examples=40)
@given(dtype=st.sampled_from(["float32", "bfloat16", "float16", "float64"]), n=st.integers(0, 5000),
       seed=st.integers(0, 2**32 - 1), moved=st.floats(0, 1), special=st.sampled_from([0.0, 0.05, 0.5]),
       tail=st.integers(0, 7))
def test_delta_codecs_restore_every_bit_pattern(kind, dtype, n, seed, moved, special, tail):
    base, new = _states(dtype, n, seed, moved, special)
    es = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    extra = np.random.default_rng(seed).integers(0, 256, (2, tail), dtype=np.uint8)  # a partial last element
    base, new = np.concatenate([base, extra[0]]), np.concatenate([new, extra[1]])
    stored = codec.encode_delta(new, base, es, 1, kind)
    assert bytes(codec.decode(kind, bytes(stored), new.size, es, base)) == new.tobytes()
    out = np.empty(new.size, dtype=np.uint8)
    assert codec.decode(kind, stored, new.size, es, base, out=out) is out and out.tobytes() == new.tobytes()


@pytest.mark.parametrize("es", [1, 2, 4, 8])
def test_zdelta_round_trips_integer_state_of_every_width(es):
    rng = np.random.default_rng(es)
    u = np.dtype(f"u{es}")
    base = rng.integers(0, np.iinfo(u).max, 20_001, dtype=u, endpoint=True)
    new = base + rng.integers(0, 3, base.size).astype(u)  # counters: some step by 1 or 2, a few wrap
    new[::97] = np.iinfo(u).max
    stored = codec.encode_delta(new, base, es, 1, codec.ZDELTA)
    assert bytes(codec.decode(codec.ZDELTA, stored, new.nbytes, es, base.view(np.uint8))) == new.tobytes()


def test_zdelta_codes_ulp_moves_smaller_than_xor():
    """bf16 weights moved by a unit of the last place or so (a fine-tuning step): the difference is +-1 where
    XOR is a carry chain, so the low plane has less entropy and the higher ones are zero more often."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(1 << 19).astype(np.float32) * 0.02).view(np.uint32)
    moved = ((w.view(np.float32) + rng.standard_normal(w.size).astype(np.float32) * 2e-5)).view(np.uint32)
    old, new = (w >> 16).astype(np.uint16), (moved >> 16).astype(np.uint16)
    assert 0.1 < np.mean(old != new) < 0.5
    xor = len(codec.encode_delta(new, old, 2, 1, codec.DELTA))
    zz = len(codec.encode_delta(new, old, 2, 1, codec.ZDELTA))
    assert zz < 0.9 * xor
    head = bytes(codec.encode_delta(new, old, 2, 1, codec.ZDELTA))[:codec.container_header_size(2)]
    assert codec.plane_layout(head, new.nbytes, 2)[1][0] == codec.SEG_SPARSE  # high plane: zero for moves < 128


@pytest.mark.parametrize("kind", [codec.RAW, codec.ZSTD, 7])
def test_only_delta_codecs_code_deltas(kind):
    a = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="not a delta codec"):
        codec.encode_delta(a, a, 4, 1, kind)
    assert not codec.is_delta(kind) and codec.is_delta(codec.DELTA) and codec.is_delta(codec.ZDELTA)


def test_a_delta_read_with_the_other_codec_does_not_restore():
    """The codec id is part of what a delta means: the chunk hash check upstream relies on a mismatch."""
    base, new = _states("float32", 4096, 5, 0.5, 0.0)
    for kind, other in ((codec.DELTA, codec.ZDELTA), (codec.ZDELTA, codec.DELTA)):
        stored = bytes(codec.encode_delta(new, base, 4, 1, kind))
        assert bytes(codec.decode(other, stored, new.size, 4, base)) != new.tobytes()


# -- the choice: the sample that decides delta vs keyframe also picks the delta codec ---------------------------


def _sign_flips(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(base, new) fp32: 30 % of the values change sign, the rest stay: XOR is one bit, a difference all four
    bytes (the case XOR wins)."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(n) * 0.05).astype(np.float32)
    new = base.copy()
    flip = rng.random(n) < 0.3
    new[flip] = -new[flip]
    return base, new


def _ulp_moves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(n) * 0.05).astype(np.float32)
    return base, (base.view(np.uint32) + rng.integers(0, 3, n).astype(np.uint32)).view(np.float32)


@pytest.mark.parametrize("states, want", [(_ulp_moves, codec.ZDELTA), (_sign_flips, codec.DELTA)])
def test_the_sample_picks_the_smaller_delta_codec(states, want):
    base, new = states(1 << 18, 1)  # 1 MiB: sampled
    sizes = {k: len(codec.encode_delta(new, base, 4, 1, k)) for k in (codec.DELTA, codec.ZDELTA)}
    assert min(sizes, key=sizes.get) == want  # the whole chunk agrees with the sample
    verdict = deltapolicy._sample_prefers_delta(memoryview(new).cast("B"), base, 4, 1, 0.9)
    assert verdict == (True, want)
    small = deltapolicy._sample_prefers_delta(memoryview(new[:4096]).cast("B"), base[:4096], 4, 1, 0.9)
    assert small == (None, deltapolicy.DEFAULT_DELTA_CODEC)  # too small to sample: coded in full, default codec


def _count_delta_codings(monkeypatch) -> Counter:
    """(delta codec, input length) -> encode_delta calls, from now on."""
    calls = Counter()
    real = codec.encode_delta
    monkeypatch.setattr(codec, "encode_delta", lambda *a: (calls.update([(a[4], len(a[0]))]), real(*a))[1])
    return calls


def test_store_holds_both_delta_codecs_and_a_place_keeps_its_codec(tmp_path, monkeypatch):
    """A chunk is stored in the codec its sample picked; the next checkpoint at that place, whose last delta
    paid off, is coded in the same codec without a sample. Both restore, verify, and keep their bases
    through forget + gc."""
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=1 << 20)
    n = 1 << 18  # one 1 MiB chunk per item
    ulp0, ulp1 = _ulp_moves(n, 2)
    flip0, flip1 = _sign_flips(n, 3)
    store.save("c0", {"ulp": ulp0, "flip": flip0})
    store.save("c1", {"ulp": ulp1, "flip": flip1})

    def codec_of(name, key):
        (ref,) = store.read_manifest(name).item_map()[key].chunks
        return store.index.lookup(ref.id).codec

    assert (codec_of("c1", "ulp"), codec_of("c1", "flip")) == (codec.ZDELTA, codec.DELTA)
    calls = _count_delta_codings(monkeypatch)
    ulp2 = (ulp1.view(np.uint32) + np.uint32(1)).view(np.float32)
    flip2 = flip1.copy()
    flip2[::5] = -flip2[::5]
    store.save("c2", {"ulp": ulp2, "flip": flip2})
    assert dict(calls) == {(codec.ZDELTA, 4 * n): 1, (codec.DELTA, 4 * n): 1}  # history: no sample coded
    assert (codec_of("c2", "ulp"), codec_of("c2", "flip")) == (codec.ZDELTA, codec.DELTA)
    saved = {"c1": (ulp1, flip1), "c2": (ulp2, flip2)}
    store.forget("c0")  # the bases' own checkpoint: the deltas keep them live
    plan_gc(store, grace_s=0).execute()
    fresh = Store.open(store.backend, cache_dir=tmp_path / "cache")
    report = verify_store(fresh, level=2)
    assert report.ok, [p.as_dict() for p in report.problems]
    for name, (ulp, flip) in saved.items():
        out = fresh.load(name)
        assert out["ulp"].tobytes() == ulp.tobytes() and out["flip"].tobytes() == flip.tobytes()


@pytest.mark.parametrize("last_codec, sampled, want", [
    (None, {codec.ZDELTA, codec.DELTA}, codec.ZDELTA),  # the first delta after a keyframe: both sampled
    (codec.DELTA, {codec.DELTA}, codec.DELTA),  # a place whose last delta was XOR stays XOR: one sample
])
def test_a_place_with_a_delta_behind_it_samples_only_its_own_codec(tmp_path, monkeypatch, last_codec, sampled,
                                                                    want):
    from deltackpt.store.pack import PackEntry

    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=1 << 20)
    base, new = _ulp_moves(1 << 18, 5)  # 1 MiB: sampled; zdelta is the smaller codec here
    n = base.nbytes
    keyframe = PackEntry(b"k" * 16, "00" * 16, 0, n, n, codec.RAW, 4)
    # The last delta came in under the line but not far enough to skip the sample.
    last = None if last_codec is None else int(0.88 * n)
    delta_base = deltapolicy.DeltaBase(keyframe, 2, last, last_codec, 0, n, None)
    calls = _count_delta_codings(monkeypatch)
    verdict = deltapolicy.DeltaPolicy(store).verdict(memoryview(new).cast("B"), 4, delta_base,
                                                     memoryview(base).cast("B"))
    assert {kind for kind, _n in calls} == sampled
    assert all(size < n // 8 for _kind, size in calls)  # samples, not the chunk
    assert verdict == (True, want)


def test_xor_deltas_of_a_store_written_before_zdelta_still_load(tmp_path, monkeypatch):
    """A store whose deltas are all XOR (as every writer before ``zigzag-delta`` made them) loads, and this
    code's next delta at a place where XOR paid off stays XOR (its history), while new places may use zdelta."""
    monkeypatch.setattr(deltapolicy, "DEFAULT_DELTA_CODEC", codec.DELTA)
    monkeypatch.setattr(deltapolicy, "_sample_prefers_delta",
                        lambda *a: deltapolicy.Verdict(True, codec.DELTA))  # the old writer: XOR only
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=16384)
    w0, w1 = _ulp_moves(20_000, 4)
    store.save("c0", {"w": w0})
    store.save("c1", {"w": w1})
    assert {store.index.lookup(r.id).codec for r in store.read_manifest("c1").item_map()["w"].chunks} \
        == {codec.DELTA}
    monkeypatch.undo()
    reopened = Store.open(store.backend, cache_dir=tmp_path / "cache")
    assert reopened.load("c1")["w"].tobytes() == w1.tobytes()
    w2 = (w1.view(np.uint32) + np.uint32(1)).view(np.float32)
    reopened.save("c2", {"w": w2})
    assert {reopened.index.lookup(r.id).codec for r in reopened.read_manifest("c2").item_map()["w"].chunks} \
        == {codec.DELTA}
    assert reopened.load("c2")["w"].tobytes() == w2.tobytes()

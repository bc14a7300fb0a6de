"""Parity and property tests for deltackpt.kernels (native C vs numpy fallback).

Native-parity tests are skipped when ``deltackpt._native`` is not built, unless
``DELTACKPT_REQUIRE_NATIVE=1``, in which case they fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltackpt import kernels
from deltackpt.kernels import twins
from deltackpt.errors import NativeKernelUnavailable

REQUIRE_NATIVE = os.environ.get("DELTACKPT_REQUIRE_NATIVE", "").strip() == "1"
ELEM_SIZES = (1, 2, 4, 8)
REPO_ROOT = Path(__file__).resolve().parents[1]
U64 = (1 << 64) - 1


def native():
    """The native implementation, or skip (fail under DELTACKPT_REQUIRE_NATIVE=1)."""
    if kernels.native_impl is None:
        msg = f"deltackpt._native is not importable ({kernels._native_error})"
        if REQUIRE_NATIVE:
            pytest.fail(f"DELTACKPT_REQUIRE_NATIVE=1 but {msg}")
        pytest.skip(f"{msg}; build it with `python setup.py build_ext --inplace`")
    return kernels.native_impl


def impls():
    """Both implementations as pytest params (native skipped/failed when missing)."""
    return [
        pytest.param("numpy", id="numpy"),
        pytest.param("native", id="native"),
    ]


def get_impl(name):
    return kernels.numpy_impl if name == "numpy" else native()


# ---------------------------------------------------------------------------
# pure-Python references
# ---------------------------------------------------------------------------


def ref_shuffle(data: bytes, k: int) -> bytes:
    n = len(data) // k
    out = bytearray(len(data))
    for i in range(n):
        for j in range(k):
            out[j * n + i] = data[i * k + j]
    out[n * k :] = data[n * k :]
    return bytes(out)


def ref_zigzag_shuffle(a: bytes, b: bytes, k: int) -> bytes:
    """shuffle(zigzag(a - b)) element by element in Python integers; the partial tail is a XOR b."""
    n, bits = len(a) // k, 8 * k
    mask = (1 << bits) - 1
    out = bytearray(len(a))
    for i in range(n):
        d = (int.from_bytes(a[i * k:i * k + k], "little") - int.from_bytes(b[i * k:i * k + k], "little")) & mask
        signed = d - (1 << bits) if d >> (bits - 1) else d
        z = ((signed << 1) ^ (signed >> (bits - 1))) & mask  # Python's >> on ints is arithmetic
        for j, byte in enumerate(z.to_bytes(k, "little")):
            out[j * n + i] = byte
    out[n * k:] = bytes(p ^ q for p, q in zip(a[n * k:], b[n * k:]))
    return bytes(out)


def ref_gear() -> list[int]:
    state, vals = 0x64656C7461636B70, []
    for _ in range(256):
        state = (state + 0x9E3779B97F4A7C15) & U64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
        vals.append(z ^ (z >> 31))
    return vals


GEAR_REF = ref_gear()


def ref_fastcdc(data: bytes, mn: int, avg: int, mx: int) -> list[int]:
    """Literal transcription of the spec: rolling hash from offset 0, per-byte scan."""
    hs, h = [], 0
    for byte in data:
        h = ((h << 1) + GEAR_REF[byte]) & U64
        hs.append(h)
    bits = round(np.log2(avg))
    mask_s = ((1 << (bits + 2)) - 1) << (64 - (bits + 2))
    mask_l = ((1 << (bits - 2)) - 1) << (64 - (bits - 2))
    n, s, cuts = len(data), 0, []
    while s < n:
        if n - s <= mn:
            cut = n
        else:
            end = min(s + mx, n)
            cut = end
            i = s + mn - 1
            while i < end:
                mask = mask_s if i < s + avg - 1 else mask_l
                if hs[i] & mask == 0:
                    cut = i + 1
                    break
                i += 1
        cuts.append(cut)
        s = cut
    return cuts


def rand_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def rng_steps(n: int, seed: int) -> np.ndarray:
    """n small signed steps (-2..2) as int8: added to bytes they move elements by a few units."""
    return np.random.default_rng(seed).integers(-2, 3, n).astype(np.int8)


def unaligned(data: bytes, offset: int) -> memoryview:
    """A memoryview of ``data`` starting ``offset`` bytes into a bytearray."""
    buf = bytearray(offset) + bytearray(data)
    return memoryview(buf)[offset:]


# ---------------------------------------------------------------------------
# shuffle family
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("k", ELEM_SIZES)
@settings(deadline=None, max_examples=60)
@given(data=st.binary(max_size=300))
def test_shuffle_matches_reference(impl, k, data):
    im = get_impl(impl)
    expected = ref_shuffle(data, k)
    got = im.shuffle(data, k)
    assert got.dtype == np.uint8 and got.ndim == 1
    assert got.tobytes() == expected
    assert im.unshuffle(expected, k).tobytes() == data


@pytest.mark.parametrize("k", ELEM_SIZES)
@settings(deadline=None, max_examples=80)
@given(
    data=st.binary(max_size=4096),
    other_seed=st.integers(0, 2**32 - 1),
    off_a=st.integers(0, 7),
    off_b=st.integers(0, 7),
)
def test_native_matches_numpy(k, data, other_seed, off_a, off_b):
    nat, npy = native(), kernels.numpy_impl
    other = rand_bytes(len(data), other_seed).tobytes()
    a, b = unaligned(data, off_a), unaligned(other, off_b)
    a_arr = np.frombuffer(data, dtype=np.uint8)

    for fn, args in (
        ("shuffle", (a,)),
        ("unshuffle", (a,)),
        ("xor_shuffle", (a, b)),
        ("unshuffle_xor", (a, b)),
        ("zigzag_shuffle", (a, b)),
        ("unshuffle_zigzag", (a, b)),
    ):
        want = getattr(npy, fn)(*args, k)
        got = getattr(nat, fn)(*args, k)
        assert got.tobytes() == want.tobytes(), fn

    for im in (nat, npy):
        assert im.unshuffle(im.shuffle(a, k), k).tobytes() == data
        planes = im.xor_shuffle(a, b, k)
        assert planes.tobytes() == im.shuffle(a_arr ^ np.frombuffer(other, np.uint8), k).tobytes()
        assert im.unshuffle_xor(planes, b, k).tobytes() == data
        assert im.unshuffle_zigzag(im.zigzag_shuffle(a, b, k), b, k).tobytes() == data


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("k", ELEM_SIZES)
@settings(deadline=None, max_examples=60)
@given(data=st.binary(max_size=300), seed=st.integers(0, 2**32 - 1), near=st.booleans())
def test_zigzag_matches_reference(impl, k, data, seed, near):
    im = get_impl(impl)
    if near:  # the case it is for: elements a few units apart (and the odd wrap at 0 / 2**(8k))
        steps = np.random.default_rng(seed).integers(-3, 4, len(data) // k + 1)
        base = bytearray(data)
        for i in range(len(data) // k):
            v = (int.from_bytes(data[i * k:i * k + k], "little") + int(steps[i])) % (1 << 8 * k)
            base[i * k:i * k + k] = v.to_bytes(k, "little")
        other = bytes(base)
    else:
        other = rand_bytes(len(data), seed).tobytes()
    expected = ref_zigzag_shuffle(data, other, k)
    got = im.zigzag_shuffle(data, other, k)
    assert got.dtype == np.uint8 and got.tobytes() == expected
    assert im.unshuffle_zigzag(expected, other, k).tobytes() == data


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("k", ELEM_SIZES)
def test_zigzag_maps_small_differences_to_small_low_bytes(impl, k):
    """+-1 in the bit pattern is 2 / 1 in plane 0 and zero above (XOR makes a carry chain of it); the extremes
    of the signed difference land on all-ones / all-ones-but-one."""
    im = get_impl(impl)
    bits, top = 8 * k, 1 << (8 * k - 1)
    same = 0x0123456789ABCDEF & ((1 << bits) - 1)
    # differences: +1, -1, -1, +1, -1, +1 (wrapping), 0, then the extremes -2**(bits-1) (top - 0) and 2**(bits-1) - 1
    base = [0, 1, 0x80, top - 1, top, (1 << bits) - 1, same, 0, 1]
    new = [1, 0, 0x7F, top, top - 1, 0, same, top, top]
    want = [2, 1, 1, 2, 1, 2, 0, (1 << bits) - 1, (1 << bits) - 2]
    dt = np.dtype(f"<u{k}")
    a, b = np.array(new, dtype=np.uint64).astype(dt), np.array(base, dtype=np.uint64).astype(dt)
    planes = im.zigzag_shuffle(a, b, k)
    assert planes.tobytes() == im.shuffle(np.array(want, dtype=np.uint64).astype(dt), k).tobytes()
    assert im.unshuffle_zigzag(planes, b, k).tobytes() == a.tobytes()
    assert not im.zigzag_shuffle(a[:7], b[:7], k)[7:].any()  # the seven small moves: every plane above 0 zero


def _block_lengths(k):
    # around the 16-element SIMD blocks and the scalar / tail paths
    base = [0, 1, k - 1, k, k + 1, 15 * k, 16 * k - 1, 16 * k, 16 * k + 1, 32 * k + k - 1, 1000 * k + 3]
    return sorted({n for n in base if n >= 0})


@pytest.mark.parametrize("k", ELEM_SIZES)
def test_block_boundaries_parity(k):
    nat = native()
    for n in _block_lengths(k):
        a = rand_bytes(n, n).tobytes()
        b = rand_bytes(n, n + 1).tobytes()
        ref = ref_shuffle(a, k)
        assert nat.shuffle(a, k).tobytes() == ref
        assert nat.unshuffle(ref, k).tobytes() == a
        x = bytes(p ^ q for p, q in zip(a, b))
        assert nat.xor_shuffle(a, b, k).tobytes() == ref_shuffle(x, k)
        assert nat.unshuffle_xor(ref_shuffle(x, k), b, k).tobytes() == a
        z = ref_zigzag_shuffle(a, b, k)
        assert nat.zigzag_shuffle(a, b, k).tobytes() == z
        assert nat.unshuffle_zigzag(z, b, k).tobytes() == a


@pytest.mark.parametrize("k", ELEM_SIZES)
def test_large_parity(k):
    nat, npy = native(), kernels.numpy_impl
    n = (3 << 20) + 5  # crosses the GIL-release threshold, odd tail
    a, b = rand_bytes(n, 10), rand_bytes(n, 11)
    s = nat.shuffle(a, k)
    assert np.array_equal(s, npy.shuffle(a, k))
    assert np.array_equal(nat.unshuffle(s, k), a)
    x = nat.xor_shuffle(a, b, k)
    assert np.array_equal(x, npy.xor_shuffle(a, b, k))
    assert np.array_equal(nat.unshuffle_xor(x, b, k), a)
    assert np.array_equal(npy.unshuffle_xor(x, b, k), a)
    near = (a.view(np.int8) + rng_steps(n, 12)).view(np.uint8)  # elements a few units apart
    for other in (b, near):
        z = nat.zigzag_shuffle(a, other, k)
        assert np.array_equal(z, npy.zigzag_shuffle(a, other, k))
        assert np.array_equal(nat.unshuffle_zigzag(z, other, k), a)
        assert np.array_equal(npy.unshuffle_zigzag(z, other, k), a)


@pytest.mark.parametrize("impl", impls())
def test_typed_and_multidim_inputs_are_raw_bytes(impl):
    im = get_impl(impl)
    f32 = np.random.default_rng(3).standard_normal((17, 5)).astype(np.float32)
    raw = f32.tobytes()
    assert im.shuffle(f32, 4).tobytes() == ref_shuffle(raw, 4)
    assert im.shuffle(memoryview(f32), 4).tobytes() == ref_shuffle(raw, 4)
    u16 = np.arange(1001, dtype=np.uint16)
    assert im.shuffle(u16, 2).tobytes() == ref_shuffle(u16.tobytes(), 2)
    assert im.shuffle(bytearray(raw), 8).tobytes() == ref_shuffle(raw, 8)
    assert im.xor_shuffle(f32, np.zeros_like(f32), 4).tobytes() == ref_shuffle(raw, 4)
    assert im.shuffle(np.float64(1.5), 8).tobytes() == ref_shuffle(np.float64(1.5).tobytes(), 8)


@pytest.mark.parametrize("impl", impls())
def test_out_parameter(impl):
    im = get_impl(impl)
    a, b = rand_bytes(1003, 1), rand_bytes(1003, 2)
    out = np.full(1003, 7, dtype=np.uint8)
    assert im.shuffle(a, 4, out=out) is out
    assert out.tobytes() == ref_shuffle(a.tobytes(), 4)
    assert im.xor_shuffle(a, b, 2, out=out) is out
    assert im.unshuffle_xor(out, b, 2, out=out) is out  # aliased out is handled
    assert np.array_equal(out, a)
    c = a.copy()
    im.shuffle(c, 8, out=c)  # in place through a temporary
    assert c.tobytes() == ref_shuffle(a.tobytes(), 8)
    empty = np.empty(0, np.uint8)
    assert im.shuffle(b"", 4, out=empty) is empty


@pytest.mark.parametrize("impl", impls())
def test_out_validation(impl):
    im = get_impl(impl)
    a = rand_bytes(64)
    ro = np.zeros(64, np.uint8)
    ro.flags.writeable = False
    bad_outs = [
        np.zeros(63, np.uint8),  # wrong length
        np.zeros(65, np.uint8),
        np.zeros(16, np.uint32),  # right byte count, wrong dtype
        np.zeros(128, np.uint8)[::2],  # not contiguous
        ro,  # read-only
        bytearray(64),  # not a numpy array
    ]
    for out in bad_outs:
        for call in (
            lambda: im.shuffle(a, 4, out=out),
            lambda: im.unshuffle(a, 4, out=out),
            lambda: im.xor_shuffle(a, a, 4, out=out),
            lambda: im.unshuffle_xor(a, a, 4, out=out),
            lambda: im.zigzag_shuffle(a, a, 4, out=out),
            lambda: im.unshuffle_zigzag(a, a, 4, out=out),
        ):
            with pytest.raises(ValueError):
                call()


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("bad", [0, 3, 5, 16, -1, 2.0, "4", None])
def test_elem_size_validation(impl, bad):
    im = get_impl(impl)
    a = rand_bytes(32)
    for call in (
        lambda: im.shuffle(a, bad),
        lambda: im.unshuffle(a, bad),
        lambda: im.xor_shuffle(a, a, bad),
        lambda: im.unshuffle_xor(a, a, bad),
        lambda: im.zigzag_shuffle(a, a, bad),
        lambda: im.unshuffle_zigzag(a, a, bad),
    ):
        with pytest.raises(ValueError, match="elem_size"):
            call()


@pytest.mark.parametrize("impl", impls())
def test_input_validation(impl):
    im = get_impl(impl)
    with pytest.raises(ValueError):
        im.xor_shuffle(b"abcd", b"abc", 2)
    with pytest.raises(ValueError):
        im.unshuffle_xor(b"abcd", b"abcde", 2)
    with pytest.raises(ValueError):
        im.zigzag_shuffle(b"abcd", b"abc", 2)
    with pytest.raises(ValueError):
        im.unshuffle_zigzag(b"abcd", b"abcde", 2)
    with pytest.raises(ValueError):
        im.shuffle(np.zeros(16, np.uint8)[::2], 2)
    with pytest.raises(ValueError):
        im.shuffle(memoryview(bytearray(16))[::2], 2)
    with pytest.raises(TypeError):
        im.shuffle([1, 2, 3, 4], 2)


def test_native_module_rejects_bad_raw_calls():
    mod = native()._raw._mod
    a = np.zeros(32, np.uint8)
    with pytest.raises(ValueError):
        mod.shuffle(a, 3, np.zeros(32, np.uint8))
    with pytest.raises(ValueError):
        mod.shuffle(a, 4, np.zeros(31, np.uint8))
    with pytest.raises(ValueError):
        mod.xor_shuffle(a, np.zeros(31, np.uint8), 4, np.zeros(32, np.uint8))
    with pytest.raises(ValueError):
        mod.zigzag_shuffle(a, np.zeros(31, np.uint8), 4, np.zeros(32, np.uint8))
    with pytest.raises(ValueError):
        mod.unshuffle_zigzag(a, a, 3, np.zeros(32, np.uint8))
    with pytest.raises(ValueError):
        mod.shuffle(a, 4, b"\0" * 32)  # read-only out
    with pytest.raises(ValueError):
        mod.fastcdc_cuts(a, 64, 64, 64, np.zeros(1, np.int64))  # cuts too small
    with pytest.raises(ValueError):
        mod.fastcdc_cuts(a, 64, 96, 128, np.zeros(8, np.int64))  # avg not pow2


def test_threads_release_gil_and_stay_correct():
    nat = native()
    a = rand_bytes(1 << 20, 5)
    want = nat.shuffle(a, 4)
    results, errors = [], []

    def work():
        try:
            for _ in range(4):
                results.append(np.array_equal(nat.unshuffle(nat.shuffle(a, 4), 4), a))
            results.append(np.array_equal(nat.shuffle(a, 4), want))
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 20 and all(results)


# ---------------------------------------------------------------------------
# zero-sparse split / merge
# ---------------------------------------------------------------------------


def ref_sparse_split(data: bytes) -> tuple[bytes, bytes]:
    bitmap = bytearray((len(data) + 7) // 8)
    for i, v in enumerate(data):
        if v:
            bitmap[i // 8] |= 1 << (i % 8)
    return bytes(bitmap), bytes(v for v in data if v)


def sparse_bytes(n: int, density: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vals = rng.integers(1, 256, n, dtype=np.uint8)
    return np.where(rng.random(n) < density, vals, 0).astype(np.uint8)


@pytest.mark.parametrize("impl", impls())
@settings(deadline=None, max_examples=80)
@given(n=st.integers(0, 300), density=st.sampled_from([0.0, 0.05, 0.5, 0.95, 1.0]), seed=st.integers(0, 2**32 - 1),
       offset=st.integers(0, 7))
def test_sparse_split_matches_reference_and_merges_back(impl, n, density, seed, offset):
    m = get_impl(impl)
    data = sparse_bytes(n, density, seed).tobytes()
    bitmap, vals = m.sparse_split(unaligned(data, offset))
    assert (bitmap.tobytes(), vals.tobytes()) == ref_sparse_split(data)
    assert m.sparse_merge(unaligned(bitmap.tobytes(), offset), vals, n).tobytes() == data


@pytest.mark.parametrize("density", [0.0, 0.001, 0.1, 0.5, 1.0])
def test_sparse_native_matches_numpy_on_large_planes(density):
    nat = native()
    data = sparse_bytes((1 << 20) + 13, density, 11)
    data[-20:] = 0  # a zero stretch at the end: the SIMD merge runs out of values before the output ends
    nb, nv = nat.sparse_split(data)
    rb, rv = kernels.numpy_impl.sparse_split(data)
    assert np.array_equal(nb, rb) and np.array_equal(nv, rv)
    assert np.array_equal(nat.sparse_merge(nb, nv, data.size), data)


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("damage", ["extra_bit", "missing_bit", "padding_bit", "zero_value", "short_vals",
                                    "long_vals", "bitmap_size"])
def test_sparse_merge_rejects_inconsistent_input(impl, damage):
    m = get_impl(impl)
    n = 1003  # not a multiple of 8: the last bitmap byte has padding bits
    data = sparse_bytes(n, 0.3, 5)
    bitmap, vals = m.sparse_split(data)
    bitmap, vals = bitmap.copy(), vals.copy()
    zero_at = int(np.flatnonzero(data == 0)[0])
    if damage == "extra_bit":
        bitmap[zero_at // 8] |= 1 << (zero_at % 8)
    elif damage == "missing_bit":
        one_at = int(np.flatnonzero(data)[-1])
        bitmap[one_at // 8] &= ~(1 << (one_at % 8)) & 0xFF
    elif damage == "padding_bit":
        bitmap[-1] |= 0x80
        vals = np.append(vals, np.uint8(7))
    elif damage == "zero_value":
        vals[len(vals) // 2] = 0
    elif damage == "short_vals":
        vals = vals[:-1]
    elif damage == "long_vals":
        vals = np.append(vals, np.uint8(9))
    else:
        bitmap = bitmap[:-1]
    with pytest.raises(ValueError):
        m.sparse_merge(bitmap, vals, n)


@pytest.mark.parametrize("impl", impls())
def test_sparse_merge_out_parameter(impl):
    m = get_impl(impl)
    data = sparse_bytes(4096, 0.2, 3)
    bitmap, vals = m.sparse_split(data)
    out = np.full(4096, 0xEE, dtype=np.uint8)
    assert m.sparse_merge(bitmap, vals, 4096, out=out) is out and np.array_equal(out, data)
    with pytest.raises(ValueError):
        m.sparse_merge(bitmap, vals, 4096, out=np.zeros(4095, np.uint8))
    # out aliasing an input is routed through a temporary
    buf = np.zeros(4096 + len(vals), dtype=np.uint8)
    buf[:len(vals)] = vals
    assert np.array_equal(m.sparse_merge(bitmap, buf[:len(vals)], 4096, out=buf[:4096]), data)


def sparse_delta(k: int, n: int, density: float, seed: int, zigzag: bool):
    """(base, new, bitmaps, vals, counts): ``n`` elements of ``k`` bytes, ``density`` of them changed (by one
    unit of the bit pattern, or to random bytes), and the all-zero-sparse delta between them as sparse_apply
    takes it."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * k, dtype=np.uint8)
    new = base.copy().reshape(n, k)
    pick = rng.random(n) < density
    new[pick] = rng.integers(0, 256, (int(pick.sum()), k), dtype=np.uint8)
    if k in (2, 4, 8):  # a carry across bytes: +1 at the all-ones low byte
        ones = np.flatnonzero(rng.random(n) < density)
        new[ones, 0] = 0xFF
        new[ones].view(f"<u{k}")[:] += 1
    new = new.reshape(-1)
    planes = (kernels.numpy_impl.zigzag_shuffle if zigzag else kernels.numpy_impl.xor_shuffle)(new, base, k)
    vals = np.zeros(n * k, dtype=np.uint8)
    bitmaps, counts = [], []
    for j in range(k):
        bm, v = kernels.numpy_impl.sparse_split(planes[j * n:(j + 1) * n])
        bitmaps.append(bm)
        vals[j * n:j * n + v.size] = v
        counts.append(v.size)
    return base, new, np.concatenate(bitmaps), vals, counts


@pytest.mark.parametrize("impl", impls())
@settings(deadline=None, max_examples=80)
@given(k=st.sampled_from(ELEM_SIZES), n=st.integers(0, 300), density=st.sampled_from([0.0, 0.02, 0.3, 1.0]),
       seed=st.integers(0, 2**32 - 1), zigzag=st.booleans())
def test_sparse_apply_turns_the_base_into_the_new_bytes(impl, k, n, density, seed, zigzag):
    m = get_impl(impl)
    base, new, bitmaps, vals, counts = sparse_delta(k, n, density, seed, zigzag)
    m.sparse_apply(bitmaps, vals, counts, base, k, zigzag)
    assert base.tobytes() == new.tobytes()


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("k", ELEM_SIZES)
@pytest.mark.parametrize("density", [0.001, 0.05, 0.6, 1.0])
def test_sparse_apply_native_matches_numpy_on_large_chunks(density, k, zigzag):
    # 1.0: the last plane's values reach the end of vals, where the native kernel leaves its 8-element blocks
    nat = native()
    base, new, bitmaps, vals, counts = sparse_delta(k, (1 << 16) + 13, density, 7, zigzag)
    a, b = base.copy(), base.copy()
    nat.sparse_apply(bitmaps, vals, counts, a, k, zigzag)
    kernels.numpy_impl.sparse_apply(bitmaps, vals, counts, b, k, zigzag)
    assert np.array_equal(a, new) and np.array_equal(b, new)


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("damage", ["extra_bit", "missing_bit", "padding_bit", "zero_value", "count_low",
                                    "count_over_n"])
@pytest.mark.parametrize("zigzag", [False, True])
def test_sparse_apply_rejects_inconsistent_input(impl, damage, zigzag):
    m = get_impl(impl)
    k, n = 4, 1003  # not a multiple of 8: the last bitmap byte of each plane has padding bits
    base, _new, bitmaps, vals, counts = sparse_delta(k, n, 0.3, 5, zigzag)
    b = (n + 7) // 8
    plane0 = np.unpackbits(bitmaps[:b], bitorder="little")[:n]
    if damage == "extra_bit":
        zero_at = int(np.flatnonzero(plane0 == 0)[0])
        bitmaps[zero_at // 8] |= 1 << (zero_at % 8)
    elif damage == "missing_bit":
        one_at = int(np.flatnonzero(plane0)[-1])
        bitmaps[one_at // 8] &= ~(1 << (one_at % 8)) & 0xFF
    elif damage == "padding_bit":
        bitmaps[b - 1] |= 0x80
        counts[0] += 1
        vals[counts[0] - 1] = 7
    elif damage == "zero_value":
        vals[counts[1] // 2 + n] = 0
    elif damage == "count_low":
        counts[2] -= 1
    else:
        counts[3] = n + 1
    with pytest.raises(ValueError, match="damaged"):
        m.sparse_apply(bitmaps, vals, counts, base, k, zigzag)


@pytest.mark.parametrize("impl", impls())
def test_sparse_apply_validates_its_buffers(impl):
    m = get_impl(impl)
    base, _new, bitmaps, vals, counts = sparse_delta(4, 256, 0.1, 1, False)
    for args in ((bitmaps[:-1], vals, counts, base), (bitmaps, vals[:-1], counts, base),
                 (bitmaps, vals, counts[:3], base), (bitmaps, vals, counts, base[:-4])):
        with pytest.raises(ValueError, match="do not fit"):
            m.sparse_apply(*args, 4)
    with pytest.raises(ValueError, match="writable"):
        m.sparse_apply(bitmaps, vals, counts, base.tobytes(), 4)
    joined = np.concatenate([base, vals])
    with pytest.raises(ValueError, match="overlap"):
        m.sparse_apply(bitmaps, joined[4:4 + base.size], counts, joined[:base.size], 4)


def test_native_sparse_rejects_bad_raw_calls():
    mod = native()._raw._mod
    src = np.ones(32, np.uint8)
    with pytest.raises(ValueError):
        mod.sparse_split(src, np.zeros(3, np.uint8), np.zeros(32, np.uint8))  # bitmap too small
    with pytest.raises(ValueError):
        mod.sparse_split(src, np.zeros(4, np.uint8), np.zeros(31, np.uint8))  # vals too small
    with pytest.raises(ValueError):
        mod.sparse_merge(np.zeros(3, np.uint8), b"", np.zeros(32, np.uint8))


# ---------------------------------------------------------------------------
# FastCDC
# ---------------------------------------------------------------------------


def check_cut_invariants(cuts, n, mn, mx):
    assert cuts.dtype == np.int64 and cuts.ndim == 1
    if n == 0:
        assert cuts.size == 0
        return
    assert cuts[-1] == n
    sizes = np.diff(np.concatenate([[0], cuts]))
    assert (sizes > 0).all(), "cuts must be strictly ascending"
    assert (sizes <= mx).all()
    assert (sizes[:-1] >= mn).all()


def test_gear_table():
    assert kernels.GEAR.tolist() == GEAR_REF
    if kernels.native_impl is not None:
        raw = kernels.native_impl._raw._mod.gear_table()
        assert np.frombuffer(raw, dtype=np.uint64).tolist() == GEAR_REF


@pytest.mark.parametrize("impl", impls())
@settings(deadline=None, max_examples=40)
@given(
    data=st.one_of(
        st.binary(max_size=3000),
        st.integers(0, 3000).map(lambda n: bytes(n)),  # zeros: never cuts, hits max
        st.integers(0, 2**32 - 1).flatmap(
            lambda seed: st.integers(0, 3000).map(lambda n: rand_bytes(n, seed).tobytes())
        ),
    ),
    params=st.sampled_from([(64, 64, 64), (64, 64, 256), (64, 128, 512), (100, 256, 300), (128, 256, 2048)]),
    offset=st.integers(0, 7),
)
def test_fastcdc_matches_reference(impl, data, params, offset):
    im = get_impl(impl)
    mn, avg, mx = params
    cuts = im.fastcdc_cuts(unaligned(data, offset), mn, avg, mx)
    assert cuts.tolist() == ref_fastcdc(data, mn, avg, mx)
    check_cut_invariants(cuts, len(data), mn, mx)


@pytest.mark.parametrize(
    "params", [(64, 64, 64), (64, 128, 1024), (2048, 8192, 32768), (16384, 65536, 262144)]
)
def test_fastcdc_large_parity(params):
    nat, npy = native(), kernels.numpy_impl
    n = 8 << 20
    data = rand_bytes(n, 42)
    a = nat.fastcdc_cuts(data, *params)
    b = npy.fastcdc_cuts(data, *params)
    assert np.array_equal(a, b)
    check_cut_invariants(a, n, params[0], params[2])
    if params[0] < params[2]:
        assert len(a) > n // params[2]  # content actually drives the cuts


@pytest.mark.parametrize("impl", impls())
def test_fastcdc_invariants_and_typed_input(impl):
    im = get_impl(impl)
    data = rand_bytes((1 << 20) + 123, 7)
    cuts = im.fastcdc_cuts(data, 1024, 4096, 16384)
    check_cut_invariants(cuts, data.size, 1024, 16384)
    sizes = np.diff(np.concatenate([[0], cuts]))
    assert 2048 < sizes.mean() < 8192  # normalized chunking centres around avg
    whole = data[: data.size // 16 * 16]
    as_f32 = whole.view(np.float32).reshape(-1, 4)
    assert np.array_equal(
        im.fastcdc_cuts(as_f32, 1024, 4096, 16384),
        im.fastcdc_cuts(whole.tobytes(), 1024, 4096, 16384),
    )


@pytest.mark.parametrize("impl", impls())
def test_fastcdc_edge_inputs(impl):
    im = get_impl(impl)
    e = im.fastcdc_cuts(b"", 64, 128, 256)
    assert e.dtype == np.int64 and e.size == 0
    assert im.fastcdc_cuts(b"x", 64, 128, 256).tolist() == [1]
    assert im.fastcdc_cuts(bytes(64), 64, 128, 256).tolist() == [64]
    assert im.fastcdc_cuts(bytes(1000), 64, 128, 256).tolist() == [256, 512, 768, 1000]


@pytest.mark.parametrize("impl", impls())
def test_fastcdc_content_defined(impl):
    im = get_impl(impl)
    mn, avg, mx = 1024, 4096, 16384
    data = rand_bytes(2 << 20, 99)
    base = im.fastcdc_cuts(data, mn, avg, mx)
    for insert_len in (1, 100, 5000):
        ins = rand_bytes(insert_len, insert_len)
        shifted = im.fastcdc_cuts(np.concatenate([ins, data]), mn, avg, mx) - insert_len
        later = base[base > 4 * mx]
        preserved = np.isin(later, shifted).mean()
        assert preserved > 0.99, (insert_len, preserved)
        # and the same for a modification in the middle: cuts well before it are untouched
        mod = data.copy()
        mod[1 << 20] ^= 0xFF
        cuts_mod = im.fastcdc_cuts(mod, mn, avg, mx)
        before = base[base < (1 << 20) - mx]
        assert np.array_equal(cuts_mod[: before.size], before)


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize(
    "params",
    [(32, 64, 128), (63, 64, 128), (128, 64, 256), (64, 256, 128), (64, 96, 256), (64, 100, 100), (64, 64, 1 << 62)],
)
def test_fastcdc_param_validation(impl, params):
    with pytest.raises(ValueError):
        get_impl(impl).fastcdc_cuts(b"abc" * 100, *params)


# ---------------------------------------------------------------------------
# backend selection
# ---------------------------------------------------------------------------


def _run_import(env_extra: dict[str, str], block_native: bool = False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTACKPT_")}
    env.update(env_extra)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    code = textwrap.dedent(
        f"""
        import sys
        if {block_native!r}:
            sys.modules["deltackpt._native"] = None  # makes the import fail
        try:
            from deltackpt import kernels
        except BaseException as exc:
            print("ERR", type(exc).__name__, isinstance(exc, ImportError))
        else:
            print("OK", kernels.BACKEND, kernels.native_impl is None)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_backend_selection_without_extension():
    assert _run_import({}, block_native=True) == ["OK", "numpy", "True"]
    assert _run_import({"DELTACKPT_KERNELS": "native"}, block_native=True) == [
        "ERR",
        "NativeKernelUnavailable",
        "True",
    ]
    assert _run_import({"DELTACKPT_REQUIRE_NATIVE": "1"}, block_native=True)[:2] == [
        "ERR",
        "NativeKernelUnavailable",
    ]
    assert _run_import({"DELTACKPT_KERNELS": "bogus"}, block_native=True) == ["ERR", "ValueError", "False"]


def test_backend_selection_with_extension():
    native()
    assert _run_import({}) == ["OK", "native", "False"]
    assert _run_import({"DELTACKPT_KERNELS": "numpy"}) == ["OK", "numpy", "False"]
    assert _run_import({"DELTACKPT_KERNELS": "native"}) == ["OK", "native", "False"]


def test_public_api_uses_live_backend():
    live = kernels.native_impl if kernels.BACKEND == "native" else kernels.numpy_impl
    assert kernels.BACKEND in ("native", "numpy")
    assert live is not None
    for name in ("shuffle", "unshuffle", "xor_shuffle", "unshuffle_xor", "fastcdc_cuts"):
        assert getattr(kernels, name) == getattr(live, name)
    assert issubclass(NativeKernelUnavailable, ImportError)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8193])
def test_unshuffle_into_matches_unshuffle(k, n):
    from deltackpt import kernels
    src = np.random.default_rng(n * 10 + k).integers(0, 256, n, dtype=np.uint8)
    want = kernels.numpy_impl.unshuffle(src, k)
    for fn in [kernels.unshuffle_into, kernels._numpy_unshuffle_into] + \
            ([kernels.native_impl._raw.unshuffle] if kernels.native_impl else []):
        out = np.full(n, 0xAB, np.uint8)
        fn(src, k, out)
        assert out.tobytes() == want.tobytes()
    if n:
        with pytest.raises(ValueError):
            kernels.unshuffle_into(src, k, np.empty(n + 1, np.uint8))


# -- unshuffle_check / xxh3_64_rows: the read path's batch of chunks checked in one call -----------------------

_CHECKERS = [twins.unshuffle_check] + (
    [kernels._native.unshuffle_check] if kernels._native is not None and hasattr(kernels._native, "unshuffle_check")
    else [])


@pytest.mark.parametrize("check", _CHECKERS)
@pytest.mark.parametrize("k", ELEM_SIZES)
def test_unshuffle_check_unshuffles_and_hashes_as_the_xxhash_package_does(check, k):
    """Planes from a buffer (at odd offsets) and from frames, every length 0..300 and a few large ones: the
    bytes out are unshuffle's, and a chunk passes exactly when xxhash.xxh3_128_digest of its bytes is its id."""
    import xxhash
    rng = np.random.default_rng(k)
    lengths = list(range(301)) + [4095, 8192, 8193, 65537]
    raws = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    parts, src, frames, at = [], [], [], 3
    for j, raw in enumerate(raws):
        planes, per = kernels.numpy_impl.shuffle(raw, k), raw.size // k
        for s in range(k + 1):
            seg = planes[s * per:(s + 1) * per] if s < k else planes[k * per:]
            if j % 3 == 1 and s == k - 1:  # one plane of every third chunk comes from a "zstd frame"
                frames.append(seg.tobytes())
                src.append(-len(frames))
            else:
                parts.append(seg)
                src.append(at)
                at += seg.size
    buf = np.concatenate([np.zeros(3, np.uint8)] + parts)
    ids = bytearray(b"".join(xxhash.xxh3_128_digest(r) for r in raws))
    ids[16 * 5 + 3] ^= 1
    outs = [np.full(r.size, 0xEE, np.uint8) for r in raws]
    ok = np.zeros(len(raws), np.uint8)
    assert check(buf, frames, k, np.array(src, np.int64), outs, bytes(ids), ok) == len(raws) - 1
    assert ok.tolist() == [int(j != 5) for j in range(len(raws))]
    assert all(np.array_equal(o, r) for o, r in zip(outs, raws))


@pytest.mark.parametrize("check", _CHECKERS)
def test_unshuffle_check_refuses_segments_out_of_bounds_and_writes_nothing(check):
    buf = np.arange(64, dtype=np.uint8)
    ids = bytes(32)
    for src, frames in (([0, 0, 0, 0, 0, 63, 0, 0, 0, 0], []),  # chunk 1's plane 0 runs past the buffer
                        ([0, 0, 0, 0, 0, -2, 0, 0, 0, 0], [b"x" * 2]),  # a frame that is not there
                        ([0, 0, 0, 0, 0, -1, 0, 0, 0, 0], [b"x" * 3]),  # a frame of the wrong length
                        ([0, 0, 0, 0, 0, -1, 0, 0, 0, 0], None)):  # a frame, where there are none
        outs = [np.full(8, 0xEE, np.uint8), np.full(8, 0xEE, np.uint8)]
        with pytest.raises(ValueError):
            check(buf, frames, 4, np.array(src, np.int64), outs, ids, np.zeros(2, np.uint8))
        assert all((o == 0xEE).all() for o in outs)


@pytest.mark.skipif(kernels._native is None or not hasattr(kernels._native, "xxh3_64_rows"),
                    reason="the native extension is not built")
def test_xxh3_64_rows_native_and_twin_agree_with_xxhash():
    import xxhash
    rows = np.random.default_rng(3).integers(0, 256, 64 * 9, dtype=np.uint8)
    for nbytes in (0, 1, 17, 56, 64):
        got = [np.empty(9, np.uint64) for _ in range(2)]
        kernels._native.xxh3_64_rows(rows, 64, nbytes, got[0])
        twins.xxh3_64_rows(rows, 64, nbytes, got[1])
        want = [xxhash.xxh3_64_intdigest(rows[i * 64:i * 64 + nbytes].tobytes()) for i in range(9)]
        assert got[0].tolist() == got[1].tolist() == want
    for fn in (kernels._native.xxh3_64_rows, twins.xxh3_64_rows):  # rows past the end, however far
        with pytest.raises(ValueError):
            fn(rows, 2**62, 8, np.empty(9, np.uint64))


# -- hash_spans / wait_hashed: a save's chunk ids hashed by a thread ahead of the writer ----------------------

_HASHERS = [(twins.hash_spans, twins.wait_hashed)] + (
    [(kernels._native.hash_spans, kernels._native.wait_hashed)]
    if kernels._native is not None and hasattr(kernels._native, "hash_spans") else [])


@pytest.mark.parametrize("hasher", _HASHERS, ids=lambda h: h[0].__module__)
def test_hash_spans_gives_xxhash_digests_and_counts_its_progress(hasher):
    import xxhash
    hash_spans, wait_hashed = hasher
    rng = np.random.default_rng(7)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 255, 4096, 1 << 20)] + [memoryview(b"abc")]
    spans = [(b, s, e) for b, buf in enumerate(bufs) for s, e in ((0, len(buf)), (0, 0), (len(buf) // 3, len(buf)))]
    out, state = np.full(16 * len(spans), 0xEE, np.uint8), np.zeros(3, np.int64)
    assert hash_spans(bufs, np.array(spans, np.int64), out, state) == len(spans)
    assert state.tolist() == [len(spans), 0, 1]
    assert [out[16 * i:16 * i + 16].tobytes() for i in range(len(spans))] == [
        xxhash.xxh3_128_digest(memoryview(bufs[b])[s:e]) for b, s, e in spans]
    assert wait_hashed(state, len(spans), 1000) == len(spans)
    assert wait_hashed(state, len(spans) + 5, 1000) == len(spans)  # returned: no wait for more
    out[:] = 0xEE
    state[:] = [0, 1, 0]  # cancelled before it starts: nothing hashed, and it says it returned
    assert hash_spans(bufs, np.array(spans, np.int64), out, state) == 0
    assert state.tolist() == [0, 1, 1] and (out == 0xEE).all()


@pytest.mark.parametrize("hasher", _HASHERS, ids=lambda h: h[0].__module__)
def test_hash_spans_refuses_what_the_other_implementation_refuses(hasher):
    hash_spans, wait_hashed = hasher
    bufs = [np.arange(64, dtype=np.uint8)]
    good = np.array([[0, 0, 64]], np.int64)
    cases = [
        (bufs, np.array([[0, 0, 65]], np.int64), np.zeros(16, np.uint8), np.zeros(3, np.int64)),  # past the end
        (bufs, np.array([[1, 0, 1]], np.int64), np.zeros(16, np.uint8), np.zeros(3, np.int64)),  # no buffer 1
        (bufs, np.array([[0, 5, 4]], np.int64), np.zeros(16, np.uint8), np.zeros(3, np.int64)),  # end before start
        (bufs, np.array([[0, -1, 4]], np.int64), np.zeros(16, np.uint8), np.zeros(3, np.int64)),
        (bufs, good, np.zeros(15, np.uint8), np.zeros(3, np.int64)),  # out too small
        (bufs, np.zeros(4, np.int64), np.zeros(16, np.uint8), np.zeros(3, np.int64)),  # not triples
        (bufs, good, np.zeros(16, np.uint8), np.zeros(2, np.int64)),  # state too small
        (bufs, good, bytes(16), np.zeros(3, np.int64)),  # out read-only
        (bufs, good, bufs[0][:16], np.zeros(3, np.int64)),  # out overlaps a buffer
        (bufs, good, np.zeros(16, np.uint8), np.zeros(33, np.uint8)[1:25]),  # state not aligned
        (bufs, good, np.zeros(16, np.uint8), bytes(24)),  # state read-only
    ]
    for args in cases:
        out = args[2]
        before = bytes(out)
        with pytest.raises((ValueError, TypeError)):
            hash_spans(*args)
        assert bytes(out) == before
    for state, n in ((np.zeros(2, np.int64), 1), (np.zeros(33, np.uint8)[1:25], 1), (bytes(24), 1)):
        with pytest.raises(ValueError):
            wait_hashed(state, n, 10)
    with pytest.raises(TypeError):
        wait_hashed(np.zeros(3, np.int64), 1.5, 10)
    assert hash_spans(None, np.zeros((0, 3), np.int64), np.zeros(0, np.uint8), np.zeros(3, np.int64)) == 0


@pytest.mark.skipif(kernels._native is None or not hasattr(kernels._native, "hash_spans"),
                    reason="the native extension is not built")
def test_hash_spans_runs_without_the_gil_and_its_progress_is_seen_while_it_runs():
    """Another thread hashes 64 MiB in 1 MiB spans while this one waits for each span in turn: the waits see
    the digests as they come (the last span's progress only after it is written) and return in order."""
    import threading
    import xxhash
    data = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    spans = np.array([(0, s, s + (1 << 20)) for s in range(0, 64 << 20, 1 << 20)], np.int64)
    out, state = np.zeros(16 * len(spans), np.uint8), np.zeros(3, np.int64)
    t = threading.Thread(target=kernels._native.hash_spans, args=([data], spans, out, state))
    t.start()
    seen = []
    for i in range(1, len(spans) + 1):
        got = kernels._native.wait_hashed(state, i, 10_000_000)
        assert got >= i
        seen.append(out[16 * (i - 1):16 * i].tobytes() == xxhash.xxh3_128_digest(data[(i - 1) << 20:i << 20]))
    t.join()
    assert all(seen) and state.tolist() == [len(spans), 0, 1]


_STATS = [twins.plane_stats] + (
    [kernels._native.plane_stats] if kernels._native is not None and hasattr(kernels._native, "plane_stats") else [])


@pytest.mark.parametrize("stats", _STATS)
@given(data=st.binary(max_size=3000), offset=st.integers(0, 7))
@settings(max_examples=60, deadline=None)
def test_plane_stats_counts_nonzero_bytes_and_equal_pairs(stats, data, offset):
    """(nonzero bytes, ordered pairs of distinct positions with equal bytes) against a count by hand, at any
    alignment (the native kernel reads 8 bytes at a time, then the tail)."""
    buf = np.frombuffer(b"\x00" * offset + data, dtype=np.uint8)[offset:]
    counts = [data.count(bytes([b])) for b in range(256)]
    assert stats(buf) == (len(data) - counts[0], sum(c * (c - 1) for c in counts))


@pytest.mark.skipif(kernels._native is None or not hasattr(kernels._native, "plane_stats"),
                    reason="the native extension is not built")
def test_plane_stats_native_and_twin_agree_on_large_planes():
    rng = np.random.default_rng(5)
    for buf in (rng.integers(0, 256, (1 << 20) + 5, dtype=np.uint8), np.zeros(1 << 20, np.uint8),
                np.full(77_777, 9, np.uint8), rng.integers(0, 3, 1 << 16, dtype=np.uint8)):
        assert kernels._native.plane_stats(buf) == twins.plane_stats(buf)
    assert kernels._native.plane_stats(b"") == (0, 0)


_FINDERS = [twins.find_sorted] + (
    [kernels._native.find_sorted] if kernels._native is not None and hasattr(kernels._native, "find_sorted") else [])


@pytest.mark.parametrize("find", _FINDERS)
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_find_sorted_finds_every_key_in_any_order(find, n):
    """The index of each key in a sorted set of 16-byte ids, -1 where absent: sorted keys (the fast path),
    repeats, keys past either end, ids that differ only in their last byte, and keys in random order."""
    rng = np.random.default_rng(n)
    raw = rng.integers(0, 4, (n, 16), dtype=np.uint8)  # few values a byte: many shared prefixes
    ids = np.unique(raw.view("V16").ravel())
    absent = rng.integers(0, 4, (300, 16), dtype=np.uint8).view("V16").ravel()
    extremes = np.array([bytes(16), b"\xff" * 16], dtype="V16")
    keys = np.concatenate([ids, ids[: n // 2], absent, extremes])
    want = {k.tobytes(): i for i, k in enumerate(ids)}
    for order in (np.argsort(keys, kind="stable"), rng.permutation(keys.size)):
        q = np.ascontiguousarray(keys[order])
        out = np.empty(q.size, np.int64)
        find(ids, q, out)
        assert out.tolist() == [want.get(k.tobytes(), -1) for k in q]


_BUCKETED = [twins.find_bucketed] + (
    [kernels._native.find_bucketed] if kernels._native is not None and hasattr(kernels._native, "find_bucketed")
    else [])


@pytest.mark.parametrize("find", _BUCKETED)
@pytest.mark.parametrize("n,spread", [(1, True), (2, True), (1000, True), (20_000, True), (1000, False)])
def test_find_bucketed_finds_every_key_through_the_bucket_table(find, n, spread):
    """find_sorted's answers, keys in any order, through idset.bucket_starts' table: ids spread as hashes
    are, and ids crowded into a few buckets (few values a byte)."""
    from deltackpt.store import idset

    rng = np.random.default_rng(n)
    raw = rng.integers(0, 256 if spread else 4, (n, 16), dtype=np.uint8)
    ids = np.unique(raw.view("V16").ravel())
    absent = rng.integers(0, 256 if spread else 4, (300, 16), dtype=np.uint8).view("V16").ravel()
    keys = np.ascontiguousarray(rng.permutation(np.concatenate(
        [ids, ids[: n // 2], absent, np.array([bytes(16), b"\xff" * 16], dtype="V16")])))
    starts, bits = idset.bucket_starts(ids)
    assert starts.size == (1 << bits) + 1 and starts[0] == 0 and starts[-1] == ids.size
    out = np.empty(keys.size, np.int64)
    find(ids, starts, bits, keys, out)
    want = {k.tobytes(): i for i, k in enumerate(ids)}
    assert out.tolist() == [want.get(k.tobytes(), -1) for k in keys]


@pytest.mark.parametrize("find", _BUCKETED)
def test_find_bucketed_refuses_bad_lengths(find):
    ids = np.zeros(2, "V16")
    starts = np.zeros(3, np.uint32)
    for args in ((ids, starts, 1, ids, np.empty(3, np.int64)),  # out of the wrong size
                 (ids, starts[:2], 1, ids, np.empty(2, np.int64)),  # a table not of 2**bits + 1
                 (ids, starts, 0, ids, np.empty(2, np.int64))):  # bits out of range
        with pytest.raises(ValueError):
            find(*args)


@pytest.mark.parametrize("find", _FINDERS)
def test_find_sorted_refuses_bad_lengths(find):
    ids = np.zeros(2, "V16")
    for args in ((ids.view(np.uint8)[:20], ids, np.empty(2, np.int64)),  # ids not whole
                 (ids, ids, np.empty(3, np.int64))):  # out of the wrong size
        with pytest.raises(ValueError):
            find(*args)


@pytest.mark.parametrize("n,m", [(0, 5), (5, 0), (1000, 10), (20_000, 20_000), (10, 30_000)])
def test_idset_union_find_and_order_agree_with_numpy(n, m):
    """union merges new ids into the sorted set (the few-new case inserts, no full sort), find goes through a
    bucket table for a large query: both give numpy's answers, ids sharing prefixes and trailing NULs too."""
    from deltackpt.store import idset

    rng = np.random.default_rng(n + m)
    raw = rng.integers(0, 256, (n + m, 16), dtype=np.uint8)
    raw[::3, 8:] = 0  # trailing NULs, which S16 would strip
    raw[::5, :8] = 0
    base = np.unique(raw[:n].view("V16").ravel())
    more = np.concatenate([raw[n:].view("V16").ravel(), base[: m // 2]])
    merged = idset.union(base, rng.permutation(more))
    assert merged.tolist() == np.unique(np.concatenate([base, more])).tolist()
    assert idset.is_sorted_unique(merged)
    if merged.size > 1:
        assert not idset.is_sorted_unique(merged[::-1])
        assert not idset.is_sorted_unique(np.concatenate([merged[:1], merged]))
    query = rng.permutation(np.concatenate([more, raw[:n].view("V16").ravel()]))
    want = {k.tobytes(): i for i, k in enumerate(base)}
    assert idset.find(base, query).tolist() == [want.get(k.tobytes(), -1) for k in query]


_SORTERS = [twins.sort_ids] + (
    [kernels._native.sort_ids] if kernels._native is not None and hasattr(kernels._native, "sort_ids") else [])


@pytest.mark.parametrize("sort", _SORTERS)
@pytest.mark.parametrize("n,values", [(0, 256), (1, 256), (31, 256), (33, 2), (5000, 256), (5000, 3), (300, 1)])
def test_sort_ids_sorts_in_place_in_numpys_order(sort, n, values):
    """16-byte ids sorted in place as numpy sorts V16 (memcmp order): hashes, ids crowded into few byte
    values (every radix level used, down to repeats that differ in no byte), trailing NULs."""
    rng = np.random.default_rng(n * 7 + values)
    raw = rng.integers(0, values, (n, 16), dtype=np.uint8)
    raw[::4, 10:] = 0
    ids = np.ascontiguousarray(raw).view("V16").ravel()
    want = np.sort(ids.copy())
    sort(ids)
    assert ids.tobytes() == want.tobytes()


@pytest.mark.parametrize("sort", _SORTERS)
def test_sort_ids_refuses_a_buffer_of_no_whole_ids(sort):
    with pytest.raises(ValueError):
        sort(bytearray(17))
    with pytest.raises(ValueError):  # a payload of another length than the ids'
        sort(bytearray(32), np.zeros(3, dtype=np.uint32))


@pytest.mark.parametrize("sort", _SORTERS)
@pytest.mark.parametrize("n,values", [(0, 256), (1, 256), (31, 256), (33, 2), (5000, 256), (5000, 3), (300, 1)])
def test_sort_ids_moves_a_payload_with_its_id(sort, n, values):
    """Each uint32 of ``pay`` goes where its id goes (among repeated ids in any order): ids sorted as without."""
    rng = np.random.default_rng(n * 7 + values)
    raw = rng.integers(0, values, (n, 16), dtype=np.uint8)
    raw[::4, 10:] = 0
    ids = np.ascontiguousarray(raw).view("V16").ravel()
    pay = rng.integers(0, 2**32, n, dtype=np.uint32)
    pairs = sorted(zip([i.tobytes() for i in ids], pay.tolist()))
    sort(ids, pay)
    assert ids.tobytes() == np.sort(ids.copy()).tobytes()
    assert sorted(zip([i.tobytes() for i in ids], pay.tolist())) == pairs


_GUARD_PAGE = textwrap.dedent("""
    import ctypes, mmap, sys
    import numpy as np
    from deltackpt import kernels
    from deltackpt.kernels import numpy_impl
    libc = ctypes.CDLL(None, use_errno=True)
    PAGE = mmap.PAGESIZE
    m = mmap.mmap(-1, 16 * PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    buf = np.frombuffer(m, np.uint8)
    assert libc.mprotect(ctypes.c_void_p(buf.ctypes.data + 15 * PAGE), PAGE, 0) == 0  # nothing past it is ours
    for k in (1, 2, 4, 8):
        for n in (121, 1081, 4153):  # n % 64 in 57..63: the last window's last step
            for zig in (False, True):
                dst = buf[15 * PAGE - n * k:15 * PAGE]  # ends at the guard page
                dst[:] = 0
                b = (n + 7) // 8
                bitmaps = np.zeros(k * b, np.uint8)
                bitmaps[(n - 1) // 8] = 1 << ((n - 1) % 8)  # the last element of plane 0 changes
                vals = np.zeros(k * n, np.uint8)
                vals[0] = 1
                kernels.sparse_apply(bitmaps, vals, [1] + [0] * (k - 1), dst, k, zig)
                want = np.zeros(n * k, np.uint8)
                numpy_impl.sparse_apply(bitmaps, vals, [1] + [0] * (k - 1), want, k, zig)
                assert dst.tobytes() == want.tobytes(), (k, n, zig)
    print("ok")
""")


def test_sparse_apply_never_touches_bytes_past_its_destination():
    """The 8-element steps of a full 64-element window loaded and stored whole blocks: when n % 64 was 57-63
    the last window ran up to 56 bytes past the destination (a read-modify-write of the next chunk's bytes,
    another thread's to write; a SIGSEGV where the destination ends a mapping). Here it ends at a guard page,
    in a process of its own."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    r = subprocess.run([sys.executable, "-c", _GUARD_PAGE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@pytest.mark.skipif(kernels.walk_refs is None, reason="the native kernels are not in use")
def test_walk_refs_refuses_a_state_that_is_not_a_walkers():
    """The state buffer is the caller's: a depth past the walker's stacks indexed them out of bounds."""
    from deltackpt import _native

    state = np.zeros(_native.WALKER_BYTES, np.uint8)
    depth_at = 5 * 8 + 9 * 8 + 64 * 8 + 64  # after the pointers (top, items, ids, ends, recs), sizes, left, kind
    state[depth_at:depth_at + 4] = np.frombuffer(np.uint32(100_000).tobytes(), np.uint8)
    out = [np.zeros(64, np.uint8) for _ in range(3)]
    with pytest.raises(ValueError, match="not a walker's"):
        _native.walk_refs(state, np.frombuffer(b"\xc0", np.uint8).copy(), *out, np.zeros(8, np.uint64),
                          np.zeros(5, np.int64))
    with pytest.raises(ValueError, match="aligned"):
        _native.walk_refs(np.zeros(_native.WALKER_BYTES + 1, np.uint8)[1:], np.zeros(1, np.uint8), *out,
                          np.zeros(8, np.uint64), np.zeros(5, np.int64))


@pytest.mark.skipif(kernels.walk_refs is None, reason="the native kernels are not in use")
def test_walk_refs_never_writes_past_its_outputs_for_a_forged_state():
    """Found by fuzzing under AddressSanitizer: a state with two items about to end wrote two records into room
    for one, and one in the middle of refs but not of items wrote past a full ``top``. The walk fails instead,
    and the bytes after each output stay as they were."""
    from deltackpt import _native

    left_at, kind_at, depth_at, refs_left_at = 112, 624, 688, 704  # walker fields (see native/refs.c)
    state = np.zeros(_native.WALKER_BYTES, np.uint8)
    state[depth_at:depth_at + 4] = np.frombuffer(np.uint32(2).tobytes(), np.uint8)
    state[kind_at] = state[kind_at + 1] = 3  # two DC_ITEM frames, one value from their end each
    state[left_at:left_at + 16] = np.frombuffer(np.array([1, 1], np.uint64).tobytes(), np.uint8)
    recs = np.full((2, 2), 7, np.uint64)  # room for one record, then a guard row
    out = [np.zeros(64, np.uint8), np.zeros(64, np.uint8), np.zeros(16, np.uint8)]
    assert _native.walk_refs(state, b"\x01", *out, recs[:1], np.zeros(5, np.int64))[0] == -1
    assert recs[1].tolist() == [7, 7]

    state = np.zeros(_native.WALKER_BYTES, np.uint8)
    state[refs_left_at:refs_left_at + 8] = np.frombuffer(np.uint64(1).tobytes(), np.uint8)  # refs, not in items
    top = np.full(9, 0xEE, np.uint8)  # 8 bytes, full, then a guard byte
    body = bytes([0x92, 0xC4, 16]) + bytes(16) + b"\x01"
    got = _native.walk_refs(state, body, top[:8], np.zeros(8, np.uint8), np.zeros(16, np.uint8),
                            np.zeros((1, 2), np.uint64), np.array([8, 0, 0, 0, 0], np.int64))
    assert got[0] == -1 and top[8] == 0xEE


@pytest.mark.skipif(kernels._native is None, reason="the native extension is not built")
def test_native_outputs_at_any_alignment_hold_the_same_values():
    """int64 outputs and inputs at an odd address (undefined behaviour in C before; UBSan's report): stored and
    read through memcpy, the values are those of an aligned buffer."""
    from deltackpt import _native

    def odd(n: int) -> np.ndarray:
        return np.zeros(n * 8 + 1, np.uint8)[1:]

    data = np.random.default_rng(9).integers(0, 256, 5000, dtype=np.uint8)
    cuts, aligned = odd(160), np.zeros(160, np.int64)
    count = _native.fastcdc_cuts(data, 64, 128, 256, cuts)
    assert count == _native.fastcdc_cuts(data, 64, 128, 256, aligned) > 1
    assert cuts[:8 * count].view(np.int64).tolist() == aligned[:count].tolist()
    ids = np.sort(np.random.default_rng(2).integers(0, 256, (40, 16), dtype=np.uint8).view("V16").ravel())
    keys = np.ascontiguousarray(ids[::3])
    pos = odd(keys.size)
    _native.find_sorted(ids, keys, pos)
    assert pos.view(np.int64).tolist() == list(range(0, ids.size, 3))


# -- found by differential fuzzing under ASan (native vs twin) ------------------------------------------------
_WALK_INTO_ITS_OWN_STATE = textwrap.dedent("""
    import numpy as np
    from deltackpt import _native as C
    state = np.zeros(C.WALKER_BYTES, np.uint8)
    top, ids, recs = np.zeros(64, np.uint8), np.zeros(64, np.uint8), np.zeros(8, np.uint64)
    # {"items": [{"x": "A" * 24}, {"x": 1}]}: the first item's bytes land on the state's own output pointers
    body = b"\\x81\\xa5items\\x92\\x81\\xa1x\\xb8" + b"\\x41" * 24 + b"\\x81\\xa1x\\x01"
    print(C.walk_refs(state, np.frombuffer(body, np.uint8), top, state, ids, recs, np.array([0, 4, 4, 0, 0], np.int64)))
""")


@pytest.mark.skipif(kernels.native_impl is None, reason="native kernels not built")
def test_walk_refs_whose_state_is_also_an_output_writes_nowhere_wild():
    """The walker kept its output pointers in the caller's state buffer: an output overlapping it let
    manifest bytes choose where the next item was written (a crash, at best). An optimized build may keep
    the pointers in registers and write nowhere wild by chance: `make asan` (-O1) catches it."""
    r = subprocess.run([sys.executable, "-c", _WALK_INTO_ITS_OWN_STATE], capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-1500:]


@pytest.mark.skipif(kernels.native_impl is None, reason="native kernels not built")
@pytest.mark.parametrize("shape,k", [((8, 3), 2), ((6, 4), 8)])
def test_sparse_apply_into_a_multidimensional_dst_is_the_same_on_both_backends(shape, k):
    dst = (np.arange(np.prod(shape)) * 37 % 251).astype(np.uint8).reshape(shape)
    n = dst.size // k
    delta = np.zeros(dst.size, np.uint8)
    delta[::3] = 5
    planes = kernels.numpy_impl.shuffle(delta, k)
    bms, vals, counts = b"", np.zeros(dst.size, np.uint8), []
    for j in range(k):
        bm, v = kernels.numpy_impl.sparse_split(planes[j * n:(j + 1) * n])
        bms += bytes(bm)
        vals[j * n:j * n + v.size] = v
        counts.append(v.size)
    a, b = dst.copy(), dst.copy()
    kernels.native_impl.sparse_apply(bms, vals, counts, a, k, True)
    kernels.numpy_impl.sparse_apply(bms, vals, counts, b, k, True)
    assert bytes(a) == bytes(b)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except ValueError:
        return "ValueError"


@pytest.mark.skipif(kernels.native_impl is None, reason="native kernels not built")
def test_raw_kernels_and_twins_refuse_the_same_arguments():
    from deltackpt import _native

    assert _outcome(_native.xxh3_64_rows, b"x" * 64, 8, 8, bytearray(12)) == "ValueError"  # part of a uint64
    assert _outcome(twins.xxh3_64_rows, b"x" * 64, 8, 8, bytearray(12)) == "ValueError"
    ids = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes()
    misaligned = memoryview(bytearray(17))[1:]
    assert _outcome(_native.sort_ids, bytearray(ids), misaligned) == "ValueError"
    assert _outcome(twins.sort_ids, bytearray(ids), misaligned) == "ValueError"
    args = (b"a" * 16, None, 1, np.array([0, 8]), [bytearray(8)], np.zeros(1, "V16"), bytearray(1))
    assert _native.unshuffle_check(*args) == twins.unshuffle_check(*args)  # lengths in bytes, not items
    with pytest.raises((ValueError, OverflowError)):  # 2**64 + 64 was read as 64
        _native.fastcdc_cuts(bytes(1000), 2**64 + 64, 64, 64, np.zeros(20, np.int64))

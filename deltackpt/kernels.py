"""Byte-plane shuffle, fused XOR and zigzag-difference deltas, and FastCDC chunking.

Public API (all inputs are any C-contiguous buffer, read as raw bytes)::

    shuffle(src, elem_size, out=None)          -> uint8 array (byte planes)
    unshuffle(src, elem_size, out=None)        -> uint8 array (inverse)
    xor_shuffle(a, b, elem_size, out=None)     -> shuffle(a XOR b)
    unshuffle_xor(planes, base, elem_size, out=None) -> unshuffle(planes) XOR base
    zigzag_shuffle(a, b, elem_size, out=None)  -> shuffle(zigzag(a - b)) over integer elements
    unshuffle_zigzag(planes, base, elem_size, out=None) -> base + unzigzag(unshuffle(planes))
    sparse_split(src)                          -> (bitmap, nonzero bytes) of a mostly-zero plane
    sparse_merge(bitmap, vals, n, out=None)    -> inverse of sparse_split (ValueError if they disagree)
    sparse_apply(bitmaps, vals, counts, dst, elem_size, zigzag=False) -> dst updated in place by a delta
                                               whose planes are all zero-sparse (only where it is nonzero)
    fastcdc_cuts(data, min_size, avg_size, max_size) -> int64 chunk end offsets

Byte planes: with ``n = len // k`` full elements, ``out[j*n + i] = src[i*k + j]``;
the trailing ``len % k`` bytes are copied unchanged to the end.

Zigzag difference: each full element of ``a`` and ``b`` is read as a little-endian k-byte unsigned integer,
``d = a - b`` modulo ``2**(8k)`` and ``zigzag(d) = (d << 1) ^ (d >> (8k - 1))`` (arithmetic shift), so a change
of -1, +1, -2 ... in the bit pattern becomes 1, 2, 3 ...; the trailing partial element is ``a XOR b``.

Two interchangeable implementations exist: the C extension ``deltackpt._native``
(:data:`native_impl`, ``None`` when it cannot be imported) and a numpy fallback
(:data:`numpy_impl`). They produce byte-identical results. The live one is
chosen once, at import, from the environment:

* ``DELTACKPT_KERNELS=auto`` (default): native if it imports, else numpy.
* ``DELTACKPT_KERNELS=native`` or ``DELTACKPT_REQUIRE_NATIVE=1``: native, raising
  :class:`~deltackpt.errors.NativeKernelUnavailable` if the extension is missing.
* ``DELTACKPT_KERNELS=numpy``: numpy.

:data:`BACKEND` names the live backend (``"native"`` or ``"numpy"``).
"""

from __future__ import annotations

import operator

import numpy as np
import xxhash

from deltackpt import settings
from deltackpt.errors import NativeKernelUnavailable

__all__ = [
    "BACKEND",
    "ELEM_SIZES",
    "fastcdc_cuts",
    "find_bucketed",
    "find_sorted",
    "native_impl",
    "numpy_impl",
    "shuffle",
    "sort_ids",
    "sparse_apply",
    "sparse_merge",
    "sparse_split",
    "unshuffle",
    "unshuffle_check",
    "unshuffle_into",
    "unshuffle_xor",
    "unshuffle_zigzag",
    "xor_shuffle",
    "xxh3_64_rows",
    "zigzag_shuffle",
]

ELEM_SIZES = (1, 2, 4, 8)
_BACKEND_CHOICES = settings.KERNEL_CHOICES
_U64 = (1 << 64) - 1
_UINTS = {k: np.dtype(f"<u{k}") for k in ELEM_SIZES}  # element bit patterns, little-endian
_SINTS = {k: np.dtype(f"<i{k}") for k in ELEM_SIZES}

# --------------------------------------------------------------------------
# argument normalisation (shared by both implementations)
# --------------------------------------------------------------------------


def _as_u8(obj, name: str) -> np.ndarray:
    """A 1-D uint8 view (no copy) of a C-contiguous buffer-protocol object."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        if obj.dtype.hasobject:
            raise TypeError(f"{name} must not be an object array")
        return obj.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{name} must be a buffer-protocol object (bytes, bytearray, memoryview, numpy array), "
            f"got {type(obj).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if mv.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(mv, dtype=np.uint8)


def _elem_size(elem_size) -> int:
    try:
        k = operator.index(elem_size)
    except TypeError:
        raise ValueError(f"elem_size must be one of 1, 2, 4 or 8, got {elem_size!r}") from None
    if k not in ELEM_SIZES:
        raise ValueError(f"elem_size must be one of 1, 2, 4 or 8, got {elem_size!r}")
    return k


def _prep_out(out, nbytes: int) -> np.ndarray:
    if out is None:
        return np.empty(nbytes, dtype=np.uint8)
    if not isinstance(out, np.ndarray):
        raise ValueError("out must be a numpy uint8 array")
    if out.dtype != np.uint8:
        raise ValueError(f"out must have dtype uint8, got {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be a writable C-contiguous array")
    if out.nbytes != nbytes:
        raise ValueError(f"out has {out.nbytes} bytes, expected {nbytes}")
    return out


def _fastcdc_params(min_size, avg_size, max_size) -> tuple[int, int, int]:
    try:
        mn, avg, mx = (operator.index(v) for v in (min_size, avg_size, max_size))
    except TypeError:
        raise ValueError("min_size, avg_size and max_size must be integers") from None
    if not (64 <= mn <= avg <= mx):
        raise ValueError(
            f"FastCDC sizes must satisfy 64 <= min_size <= avg_size <= max_size, "
            f"got min={mn} avg={avg} max={mx}"
        )
    if avg & (avg - 1):
        raise ValueError(f"avg_size must be a power of two, got {avg}")
    if mx >= 1 << 62:
        raise ValueError(f"max_size must be < 2**62, got {mx}")
    return mn, avg, mx


def _top_bits(nbits: int) -> int:
    if nbits <= 0:
        return 0
    return ((1 << nbits) - 1) << (64 - nbits)


def _gear_table() -> np.ndarray:
    state = 0x64656C7461636B70
    vals = []
    for _ in range(256):
        state = (state + 0x9E3779B97F4A7C15) & _U64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
        vals.append(z ^ (z >> 31))
    table = np.array(vals, dtype=np.uint64)
    table.flags.writeable = False
    return table


GEAR = _gear_table()

# --------------------------------------------------------------------------
# implementations
# --------------------------------------------------------------------------


class _Impl:
    """Public, validating wrapper around one backend's raw kernels.

    The raw kernels take 1-D uint8 arrays and a preallocated, non-overlapping
    ``out``; this class normalises inputs, allocates/validates ``out`` and routes
    an ``out`` that aliases an input through a temporary.
    """

    def __init__(self, name: str, raw):
        self.name = name
        self._raw = raw

    def __repr__(self) -> str:
        return f"<deltackpt.kernels {self.name} implementation>"

    def _run(self, fn, inputs, k, out):
        return self._into(fn, inputs, inputs[0].nbytes, out, k)

    def _into(self, fn, inputs, n: int, out, *args):
        """``fn(*inputs, *args, dest)`` into ``out`` (``n`` bytes; a new array when None), through a
        temporary when ``out`` aliases an input."""
        res = _prep_out(out, n)
        if n == 0:
            return res
        if out is not None and any(np.may_share_memory(res, x) for x in inputs):
            tmp = np.empty(n, dtype=np.uint8)
            fn(*inputs, *args, tmp)
            res[...] = tmp
        else:
            fn(*inputs, *args, res.reshape(-1))
        return res

    def shuffle(self, src, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """Split ``src`` into ``elem_size`` byte planes (trailing partial element kept as is)."""
        k = _elem_size(elem_size)
        return self._run(self._raw.shuffle, (_as_u8(src, "src"),), k, out)

    def unshuffle(self, src, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """Inverse of :meth:`shuffle`."""
        k = _elem_size(elem_size)
        return self._run(self._raw.unshuffle, (_as_u8(src, "src"),), k, out)

    def xor_shuffle(self, a, b, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """``shuffle(a XOR b)`` in one pass; ``a`` and ``b`` must have equal byte length."""
        k = _elem_size(elem_size)
        a8, b8 = _as_u8(a, "a"), _as_u8(b, "b")
        if a8.nbytes != b8.nbytes:
            raise ValueError(f"a and b must have equal byte length ({a8.nbytes} != {b8.nbytes})")
        return self._run(self._raw.xor_shuffle, (a8, b8), k, out)

    def unshuffle_xor(self, planes, base, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """``unshuffle(planes) XOR base`` in one pass (inverse of :meth:`xor_shuffle` given ``base``)."""
        k = _elem_size(elem_size)
        p8, b8 = _as_u8(planes, "planes"), _as_u8(base, "base")
        if p8.nbytes != b8.nbytes:
            raise ValueError(f"planes and base must have equal byte length ({p8.nbytes} != {b8.nbytes})")
        return self._run(self._raw.unshuffle_xor, (p8, b8), k, out)

    def zigzag_shuffle(self, a, b, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """``shuffle(zigzag(a - b))`` over little-endian ``elem_size``-byte integers in one pass (trailing
        partial element: ``a XOR b``); ``a`` and ``b`` must have equal byte length."""
        k = _elem_size(elem_size)
        a8, b8 = _as_u8(a, "a"), _as_u8(b, "b")
        if a8.nbytes != b8.nbytes:
            raise ValueError(f"a and b must have equal byte length ({a8.nbytes} != {b8.nbytes})")
        return self._run(self._raw.zigzag_shuffle, (a8, b8), k, out)

    def unshuffle_zigzag(self, planes, base, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """``base + unzigzag(unshuffle(planes))`` in one pass (inverse of :meth:`zigzag_shuffle` given
        ``base``)."""
        k = _elem_size(elem_size)
        p8, b8 = _as_u8(planes, "planes"), _as_u8(base, "base")
        if p8.nbytes != b8.nbytes:
            raise ValueError(f"planes and base must have equal byte length ({p8.nbytes} != {b8.nbytes})")
        return self._run(self._raw.unshuffle_zigzag, (p8, b8), k, out)

    def sparse_split(self, src) -> tuple[np.ndarray, np.ndarray]:
        """(bitmap, vals): bit i of the bitmap (LSB first, ``ceil(n / 8)`` bytes) is set where ``src[i]`` is
        nonzero, and ``vals`` are those nonzero bytes in order."""
        s = _as_u8(src, "src")
        n = s.nbytes
        bitmap = np.empty((n + 7) // 8, dtype=np.uint8)
        vals = np.empty(n, dtype=np.uint8)
        if n == 0:
            return bitmap, vals
        return bitmap, vals[:self._raw.sparse_split(s, bitmap, vals)]

    def sparse_merge(self, bitmap, vals, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """The ``n`` bytes whose :meth:`sparse_split` is ``(bitmap, vals)``; ``ValueError`` when the bitmap
        does not name exactly ``len(vals)`` positions below ``n`` or a value is zero."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        bm, v = _as_u8(bitmap, "bitmap"), _as_u8(vals, "vals")
        if bm.nbytes != (n + 7) // 8 or v.nbytes > n:
            raise ValueError(f"bitmap has {bm.nbytes} bytes and vals {v.nbytes} for {n} output bytes")
        return self._into(self._raw.sparse_merge, (bm, v), n, out)

    def sparse_apply(self, bitmaps, vals, counts, dst: np.ndarray, elem_size: int, zigzag: bool = False) -> None:
        """Apply a delta whose ``elem_size`` byte planes are all zero-sparse to ``dst`` (a writable uint8 array of
        full elements) in place: ``dst`` becomes ``unshuffle_xor(planes, dst)`` (``unshuffle_zigzag`` when
        ``zigzag``), where plane j is ``sparse_merge`` of its bitmap (``bitmaps[j * b:(j + 1) * b]``,
        ``b = ceil(n / 8)`` for ``n = dst.size // elem_size``) and its ``counts[j]`` values (from
        ``vals[j * n]``; ``vals`` holds ``dst.size`` bytes). Only the elements the bitmaps name are touched
        (a chain's deltas are applied in place, at the cost of their nonzero bytes). ``ValueError`` as
        :meth:`sparse_merge` for any plane; ``dst`` is then partly updated."""
        k = _elem_size(elem_size)
        if not isinstance(dst, np.ndarray) or dst.dtype != np.uint8 or not dst.flags.c_contiguous \
                or not dst.flags.writeable:
            raise ValueError("dst must be a writable C-contiguous uint8 array")
        n = dst.size // k
        bm, v = _as_u8(bitmaps, "bitmaps"), _as_u8(vals, "vals")
        c = np.ascontiguousarray(counts, dtype=np.uint64)
        if dst.size != n * k or bm.nbytes != k * ((n + 7) // 8) or v.nbytes != k * n or c.size != k:
            raise ValueError(f"bitmaps {bm.nbytes}, vals {v.nbytes}, counts {c.size} do not fit {dst.size} bytes of "
                             f"{k}-byte elements")
        if n and any(np.may_share_memory(dst, x) for x in (bm, v)):
            raise ValueError("dst must not overlap bitmaps or vals")
        if n:
            self._raw.sparse_apply(bm, v, c, dst, k, bool(zigzag))

    def fastcdc_cuts(self, data, min_size: int, avg_size: int, max_size: int) -> np.ndarray:
        """FastCDC chunk END offsets (int64, ascending, last == len(data)); empty input gives []."""
        mn, avg, mx = _fastcdc_params(min_size, avg_size, max_size)
        d = _as_u8(data, "data")
        if d.nbytes == 0:
            return np.empty(0, dtype=np.int64)
        return self._raw.fastcdc_cuts(d, mn, avg, mx)


class _NumpyRaw:
    """Pure numpy kernels (byte-identical to the C ones)."""

    # hash block: positions per vectorised pass (bounds memory to ~3 x 8 B x this)
    _HASH_BLOCK = 1 << 21

    @staticmethod
    def shuffle(src, k, out):
        n = src.nbytes // k
        m = n * k
        if k == 1 or n == 0:
            out[...] = src
            return
        out[:m].reshape(k, n)[...] = src[:m].reshape(n, k).T
        out[m:] = src[m:]

    @staticmethod
    def unshuffle(src, k, out):
        n = src.nbytes // k
        m = n * k
        if k == 1 or n == 0:
            out[...] = src
            return
        out[:m].reshape(n, k)[...] = src[:m].reshape(k, n).T
        out[m:] = src[m:]

    @classmethod
    def xor_shuffle(cls, a, b, k, out):
        cls.shuffle(np.bitwise_xor(a, b), k, out)

    @classmethod
    def unshuffle_xor(cls, planes, base, k, out):
        cls.unshuffle(planes, k, out)
        np.bitwise_xor(out, base, out=out)

    @classmethod
    def zigzag_shuffle(cls, a, b, k, out):
        m = a.nbytes // k * k
        d = a[:m].view(_UINTS[k]) - b[:m].view(_UINTS[k])  # modulo 2**(8k)
        z = (d << 1) ^ (d.view(_SINTS[k]) >> (8 * k - 1)).view(d.dtype)  # arithmetic shift: 0 or all ones
        tmp = np.empty_like(a)
        tmp[:m] = z.astype(_UINTS[k], copy=False).view(np.uint8)
        np.bitwise_xor(a[m:], b[m:], out=tmp[m:])
        cls.shuffle(tmp, k, out)

    @classmethod
    def sparse_apply(cls, bitmaps, vals, counts, dst, k, zigzag):
        n, b = dst.size // k, bitmaps.size // k
        planes = np.empty(n * k, dtype=np.uint8)
        for j in range(k):
            if int(counts[j]) > n:
                raise ValueError("sparse plane is damaged: its bitmap does not match its values")
            cls.sparse_merge(bitmaps[j * b:(j + 1) * b], vals[j * n:j * n + int(counts[j])], planes[j * n:(j + 1) * n])
        res = np.empty_like(dst)
        (cls.unshuffle_zigzag if zigzag else cls.unshuffle_xor)(planes, dst, k, res)
        dst[...] = res

    @classmethod
    def unshuffle_zigzag(cls, planes, base, k, out):
        cls.unshuffle(planes, k, out)
        m = out.nbytes // k * k
        z = out[:m].view(_UINTS[k])
        np.add(base[:m].view(_UINTS[k]), (z >> 1) ^ np.negative(z & 1), out=z)
        np.bitwise_xor(out[m:], base[m:], out=out[m:])

    @staticmethod
    def sparse_split(src, bitmap, vals):
        nz = src != 0
        bitmap[...] = np.packbits(nz, bitorder="little")
        v = src[nz]
        vals[:v.size] = v
        return v.size

    @staticmethod
    def sparse_merge(bitmap, vals, out):
        n = out.size
        bits = np.unpackbits(bitmap, bitorder="little")
        mask = bits[:n].view(bool)
        if bits[n:].any() or np.count_nonzero(mask) != vals.size or not vals.all():
            raise ValueError("sparse plane is damaged: its bitmap does not match its values")
        out[...] = 0
        out[mask] = vals

    @classmethod
    def _candidates(cls, d: np.ndarray, mask_s: int, mask_l: int):
        """Positions i whose windowed gear hash h_i satisfies (h_i & mask) == 0."""
        ms, ml = np.uint64(mask_s), np.uint64(mask_l)
        zero = np.uint64(0)
        out_s, out_l = [], []
        n = d.size
        step = cls._HASH_BLOCK
        for a in range(0, n, step):
            b = min(n, a + step)
            # g covers positions [a - 63, b); positions before 0 contribute 0
            ctx = min(a, 63)
            g = np.zeros(b - a + 63, dtype=np.uint64)
            g[63 - ctx:] = GEAR[d[a - ctx:b]]
            # doubling: S_{2m}[t] = S_m[t] + (S_m[t - m] << m); S_1 = g; S_64 = h
            tmp = np.empty_like(g)
            m = 1
            while m < 64:
                np.left_shift(g[:-m], np.uint64(m), out=tmp[m:])
                g[m:] += tmp[m:]
                m <<= 1
            h = g[63:]
            # mask_l's bits are a subset of mask_s's, so s-candidates are l-candidates
            idx_l = np.flatnonzero((h & ml) == zero)
            idx_s = idx_l[(h[idx_l] & ms) == zero]
            out_l.append(idx_l + a)
            out_s.append(idx_s + a)
        cand_s = np.concatenate(out_s) if out_s else np.empty(0, np.int64)
        cand_l = np.concatenate(out_l) if out_l else np.empty(0, np.int64)
        return cand_s.astype(np.int64, copy=False), cand_l.astype(np.int64, copy=False)

    @classmethod
    def fastcdc_cuts(cls, d, mn, avg, mx):
        n = d.size
        bits = avg.bit_length() - 1
        mask_s, mask_l = _top_bits(bits + 2), _top_bits(bits - 2)
        cand_s, cand_l = cls._candidates(d, mask_s, mask_l)
        ls = cand_s.tolist()
        ll = cand_l.tolist()
        ns, nl = len(ls), len(ll)
        from bisect import bisect_left

        cuts = []
        s = 0
        while s < n:
            rem = n - s
            if rem <= mn:
                cut = n
            else:
                end = s + min(rem, mx)
                i = s + mn - 1
                mid = min(s + avg - 1, end)
                cut = end
                j = bisect_left(ls, i)
                if j < ns and ls[j] < mid:
                    cut = ls[j] + 1
                else:
                    j = bisect_left(ll, mid)
                    if j < nl and ll[j] < end:
                        cut = ll[j] + 1
            cuts.append(cut)
            s = cut
        return np.array(cuts, dtype=np.int64)


class _NativeRaw:
    """Thin adapter over deltackpt._native."""

    def __init__(self, mod):
        self._mod = mod
        self.shuffle = mod.shuffle
        self.unshuffle = mod.unshuffle
        self.xor_shuffle = mod.xor_shuffle
        self.unshuffle_xor = mod.unshuffle_xor
        self.zigzag_shuffle = mod.zigzag_shuffle
        self.unshuffle_zigzag = mod.unshuffle_zigzag
        self.sparse_split = mod.sparse_split
        self.sparse_merge = mod.sparse_merge
        self.sparse_apply = mod.sparse_apply

    def fastcdc_cuts(self, d, mn, avg, mx):
        buf = np.empty(d.nbytes // mn + 2, dtype=np.int64)
        count = self._mod.fastcdc_cuts(d, mn, avg, mx, buf)
        return buf[:count].copy()


numpy_impl = _Impl("numpy", _NumpyRaw)

try:
    from deltackpt import _native  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - depends on the build
    _native = None
    _native_error: ImportError | None = exc
else:
    _native_error = None

native_impl = _Impl("native", _NativeRaw(_native)) if _native is not None else None


def _select_backend() -> str:
    choice = settings.kernels()
    require = settings.require_native()
    if choice == "native" or require:
        if native_impl is None:
            raise NativeKernelUnavailable(
                "native kernels required (DELTACKPT_KERNELS=native or DELTACKPT_REQUIRE_NATIVE=1) "
                f"but deltackpt._native cannot be imported: {_native_error}; "
                "build it with `pip install -e .` or `python setup.py build_ext --inplace`"
            ) from _native_error
    if choice == "numpy":
        return "numpy"
    return "native" if native_impl is not None else "numpy"


BACKEND: str = _select_backend()
_impl = native_impl if BACKEND == "native" else numpy_impl

shuffle = _impl.shuffle
unshuffle = _impl.unshuffle
xor_shuffle = _impl.xor_shuffle
unshuffle_xor = _impl.unshuffle_xor
zigzag_shuffle = _impl.zigzag_shuffle
unshuffle_zigzag = _impl.unshuffle_zigzag
sparse_split = _impl.sparse_split
sparse_merge = _impl.sparse_merge
sparse_apply = _impl.sparse_apply
fastcdc_cuts = _impl.fastcdc_cuts


def _numpy_unshuffle_into(src, elem_size: int, out) -> None:
    numpy_impl.unshuffle(src, elem_size, out=np.frombuffer(out, dtype=np.uint8))


# unshuffle(src, elem_size, out) for a hot path that owns both buffers: C-contiguous, of equal byte length (still
# checked), never overlapping (not checked); the wrapper's checks cost 2 us, 8x the kernel, on an 8 KiB chunk.
unshuffle_into = _native.unshuffle if BACKEND == "native" else _numpy_unshuffle_into

# chunk_refs(refs, out, offset) -> (count, total length) | None: a manifest item's chunk ids read from its
# msgpack in C with no object per ref (native only: store/manifest.py decodes with msgspec where it is None).
# getattr: an extension built before native/refs.c existed lacks it; then refs are read the general way.
chunk_refs = getattr(_native, "chunk_refs", None) if BACKEND == "native" else None
# walk_refs(state, piece, top, items, ids, recs, at) -> (status, consumed): a resumable walk over a whole manifest
# body fed in pieces (native only; store/refstream.py reads manifests whole where it is None). WALKER_BYTES: the
# size of its state.
walk_refs = getattr(_native, "walk_refs", None) if BACKEND == "native" else None
WALKER_BYTES = getattr(_native, "WALKER_BYTES", 0) if BACKEND == "native" else 0


def _python_unshuffle_check(buf, frames, elem_size: int, src, outs, ids, ok) -> int:
    """The twin of the native ``unshuffle_check`` (its docstring in native/binding.c): the same checks, the
    same bytes, one chunk at a time."""
    k = _elem_size(elem_size)
    b, n, frames = _as_u8(buf, "buf"), len(outs), () if frames is None else frames
    src = np.asarray(src)
    okv = np.frombuffer(ok, dtype=np.uint8) if len(memoryview(ok)) else np.zeros(0, np.uint8)
    if okv.size != n or src.dtype != np.int64 or src.size != n * (k + 1) or len(ids) != 16 * n:
        raise ValueError(f"ok, src and ids must hold {n}, {n * (k + 1)} int64 and {16 * n} bytes")
    dests = [np.frombuffer(out, dtype=np.uint8) if len(memoryview(out)) else np.zeros(0, np.uint8) for out in outs]
    planes = []
    for j, (dest, starts) in enumerate(zip(dests, src.reshape(n, k + 1).tolist())):
        per = dest.size // k
        segs = []
        for s, at in enumerate(starts):
            want = per if s < k else dest.size - per * k
            if 0 <= at <= b.size - want:
                segs.append(b[at:at + want])
            elif at < 0 and -1 - at < len(frames) and len(memoryview(frames[-1 - at])) == want:
                segs.append(np.frombuffer(frames[-1 - at], dtype=np.uint8) if want else b[:0])
            else:
                raise ValueError(f"chunk {j}: segment {s} is out of bounds")
        planes.append(np.concatenate(segs))
    for j, (dest, joined) in enumerate(zip(dests, planes)):
        numpy_impl.unshuffle(joined, k, out=dest)
        okv[j] = xxhash.xxh3_128_digest(dest) == bytes(ids[16 * j:16 * j + 16])
    return int(okv.sum())


def _python_xxh3_64_rows(rows, stride: int, nbytes: int, out) -> None:
    """The twin of the native ``xxh3_64_rows``: ``out[i]`` = xxh3-64 of row i's first ``nbytes``."""
    mv, dest = memoryview(rows).cast("B"), np.frombuffer(out, dtype=np.uint64)
    if not 0 <= nbytes <= stride or dest.size and (dest.size - 1) * stride + nbytes > len(mv):
        raise ValueError(f"rows has {len(mv)} bytes, {dest.size} rows of stride {stride} need more")
    dest[:] = [xxhash.xxh3_64_intdigest(mv[i * stride:i * stride + nbytes]) for i in range(dest.size)]


def _batch_kernel(name: str, twin):
    """The native batch kernel ``name``, or its Python twin: with the numpy backend, or under ``auto`` when
    the extension predates it (built before native/chunkcheck.c; same results); where native kernels are
    required, such an extension is refused like a missing one."""
    if BACKEND != "native":
        return twin
    fn = getattr(_native, name, None)
    if fn is None and (settings.kernels() == "native" or settings.require_native()):
        raise NativeKernelUnavailable(f"deltackpt._native has no {name}: an old build; rebuild it with "
                                      "`python setup.py build_ext --inplace`")
    return fn or twin


def _python_find_sorted(ids, keys, out) -> None:
    """The twin of the native ``find_sorted``: ``out[i]`` = the index of ``keys[i]`` in ``ids`` (16-byte ids,
    sorted unique), -1 where absent."""
    nbytes = [memoryview(x).nbytes for x in (ids, keys, out)]
    if nbytes[0] % 16 or nbytes[1] % 16 or nbytes[2] != nbytes[1] // 2:
        raise ValueError("ids and keys must be 16-byte ids, out an int64 per key")
    a, k = (np.frombuffer(x, dtype="V16") if n else np.empty(0, "V16") for x, n in zip((ids, keys), nbytes))
    dest = np.frombuffer(out, dtype=np.int64) if nbytes[2] else np.empty(0, np.int64)
    if not a.size:
        dest[:] = -1
        return
    pos = np.minimum(np.searchsorted(a, k), a.size - 1)
    dest[:] = np.where(a[pos] == k, pos, -1)


def _python_find_bucketed(ids, starts, bits, keys, out) -> None:
    """The twin of the native ``find_bucketed``: the same answers as :func:`_python_find_sorted` for a bucket
    table ``starts`` of ``bits`` bits as idset.bucket_starts makes it (checked for its length only)."""
    if not 1 <= bits <= 32:
        raise ValueError("bits must be 1-32")
    if memoryview(starts).nbytes != ((1 << bits) + 1) * 4:
        raise ValueError("starts must be 2**bits + 1 uint32")
    _python_find_sorted(ids, keys, out)


def _python_sort_ids(ids) -> None:
    """The twin of the native ``sort_ids``: the 16-byte ids of the writable buffer ``ids`` sorted in place."""
    nbytes = memoryview(ids).nbytes
    if nbytes % 16:
        raise ValueError("ids must be 16-byte ids")
    if nbytes:
        np.frombuffer(ids, dtype="V16").sort()


# unshuffle_check(buf, frames, elem_size, src, outs, ids, ok) -> passed: the planes of many chunks unshuffled into
# outs and each hashed against its id in one call (store/planebatch.py; docstring in native/binding.c).
# xxh3_64_rows(rows, stride, nbytes, out): the digests of many entry headers.
unshuffle_check = _batch_kernel("unshuffle_check", _python_unshuffle_check)
xxh3_64_rows = _batch_kernel("xxh3_64_rows", _python_xxh3_64_rows)
# find_sorted(ids, keys, out): where each key is in a sorted set of 16-byte ids (store/idset.py).
find_sorted = _batch_kernel("find_sorted", _python_find_sorted)
# find_bucketed(ids, starts, bits, keys, out): the same, keys in any order, through a bucket table (idset).
find_bucketed = _batch_kernel("find_bucketed", _python_find_bucketed)
# sort_ids(ids): 16-byte ids sorted in place, in memcmp order (idset's sets).
sort_ids = _batch_kernel("sort_ids", _python_sort_ids)

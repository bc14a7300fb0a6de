"""impl: the validating wrapper around one backend's raw kernels, and the two backends it wraps.

:data:`numpy_impl` wraps :class:`~.pure.NumpyRaw`; :data:`native_impl` the C extension ``deltackpt._native``
(``None`` when it cannot be imported: :data:`native_error` says why). Both give byte-identical results.
"""

from __future__ import annotations

import operator

import numpy as np

from .arguments import as_u8, check_elem_size, fastcdc_params, prep_out
from .pure import NumpyRaw


def _same_length(x, y, x_name: str, y_name: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` as uint8 views, which must have equal byte length."""
    x8, y8 = as_u8(x, x_name), as_u8(y, y_name)
    if x8.nbytes != y8.nbytes:
        raise ValueError(f"{x_name} and {y_name} must have equal byte length ({x8.nbytes} != {y8.nbytes})")
    return x8, y8


class Impl:
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
        res = prep_out(out, n)
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
        k = check_elem_size(elem_size)
        return self._run(self._raw.shuffle, (as_u8(src, "src"),), k, out)

    def unshuffle(self, src, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """Inverse of :meth:`shuffle`."""
        k = check_elem_size(elem_size)
        return self._run(self._raw.unshuffle, (as_u8(src, "src"),), k, out)

    def xor_shuffle(self, a, b, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """``shuffle(a XOR b)`` in one pass; ``a`` and ``b`` must have equal byte length."""
        k = check_elem_size(elem_size)
        a8, b8 = _same_length(a, b, "a", "b")
        return self._run(self._raw.xor_shuffle, (a8, b8), k, out)

    def unshuffle_xor(self, planes, base, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """``unshuffle(planes) XOR base`` in one pass (inverse of :meth:`xor_shuffle` given ``base``)."""
        k = check_elem_size(elem_size)
        p8, b8 = _same_length(planes, base, "planes", "base")
        return self._run(self._raw.unshuffle_xor, (p8, b8), k, out)

    def zigzag_shuffle(self, a, b, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """``shuffle(zigzag(a - b))`` over little-endian ``elem_size``-byte integers in one pass (trailing
        partial element: ``a XOR b``); ``a`` and ``b`` must have equal byte length."""
        k = check_elem_size(elem_size)
        a8, b8 = _same_length(a, b, "a", "b")
        return self._run(self._raw.zigzag_shuffle, (a8, b8), k, out)

    def unshuffle_zigzag(self, planes, base, elem_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """``base + unzigzag(unshuffle(planes))`` in one pass (inverse of :meth:`zigzag_shuffle` given
        ``base``)."""
        k = check_elem_size(elem_size)
        p8, b8 = _same_length(planes, base, "planes", "base")
        return self._run(self._raw.unshuffle_zigzag, (p8, b8), k, out)

    def sparse_split(self, src) -> tuple[np.ndarray, np.ndarray]:
        """(bitmap, vals): bit i of the bitmap (LSB first, ``ceil(n / 8)`` bytes) is set where ``src[i]`` is
        nonzero, and ``vals`` are those nonzero bytes in order."""
        s = as_u8(src, "src")
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
        bm, v = as_u8(bitmap, "bitmap"), as_u8(vals, "vals")
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
        k = check_elem_size(elem_size)
        if not isinstance(dst, np.ndarray) or dst.dtype != np.uint8 or not dst.flags.c_contiguous \
                or not dst.flags.writeable:
            raise ValueError("dst must be a writable C-contiguous uint8 array")
        n = dst.size // k
        bm, v = as_u8(bitmaps, "bitmaps"), as_u8(vals, "vals")
        c = np.ascontiguousarray(counts, dtype=np.uint64)
        if dst.size != n * k or bm.nbytes != k * ((n + 7) // 8) or v.nbytes != k * n or c.size != k:
            raise ValueError(f"bitmaps {bm.nbytes}, vals {v.nbytes}, counts {c.size} do not fit {dst.size} bytes of "
                             f"{k}-byte elements")
        if n and any(np.may_share_memory(dst, x) for x in (bm, v)):
            raise ValueError("dst must not overlap bitmaps or vals")
        if n:
            self._raw.sparse_apply(bm, v, c, dst.reshape(-1), k, bool(zigzag))  # a view: any C-contiguous shape

    def fastcdc_cuts(self, data, min_size: int, avg_size: int, max_size: int) -> np.ndarray:
        """FastCDC chunk END offsets (int64, ascending, last == len(data)); empty input gives []."""
        mn, avg, mx = fastcdc_params(min_size, avg_size, max_size)
        d = as_u8(data, "data")
        if d.nbytes == 0:
            return np.empty(0, dtype=np.int64)
        return self._raw.fastcdc_cuts(d, mn, avg, mx)


class NativeRaw:
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


numpy_impl = Impl("numpy", NumpyRaw)

try:
    from deltackpt import _native  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - depends on the build
    _native = None
    native_error: ImportError | None = exc
else:
    native_error = None

native_impl = Impl("native", NativeRaw(_native)) if _native is not None else None

"""arguments: the checks and normalisation both kernel implementations share.

Any C-contiguous buffer is read as raw bytes (:func:`as_u8`, no copy); an element size is 1, 2, 4 or 8; an
``out`` array is a writable C-contiguous uint8 array of exactly the bytes the result needs; FastCDC's sizes
satisfy 64 <= min <= avg (a power of two) <= max < 2**62. Misuse raises ``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

import operator

import numpy as np

ELEM_SIZES = (1, 2, 4, 8)


def as_u8(obj, name: str) -> np.ndarray:
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


def check_elem_size(elem_size) -> int:
    try:
        k = operator.index(elem_size)
    except TypeError:
        raise ValueError(f"elem_size must be one of 1, 2, 4 or 8, got {elem_size!r}") from None
    if k not in ELEM_SIZES:
        raise ValueError(f"elem_size must be one of 1, 2, 4 or 8, got {elem_size!r}")
    return k


def prep_out(out, nbytes: int) -> np.ndarray:
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


def fastcdc_params(min_size, avg_size, max_size) -> tuple[int, int, int]:
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

"""Raw tensor bytes as numbers, and dtype casts, in numpy alone (torch-free).

bfloat16 is the top half of a float32: widening shifts it up, narrowing rounds to nearest even as torch
does (``c10::round_to_nearest_even``; every NaN becomes the quiet NaN 0x7FC0, where torch's vectorized CPU
path gives 0xFFFF); float64 is rounded to float32 first. Float8 and other dtypes numpy lacks have
no numeric view here: ``as_numbers`` returns None and callers compare their bytes only.
"""

from __future__ import annotations

import numpy as np

_NUMPY = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
          "float32", "float64", "complex64", "complex128"}
FLOATS = {"float16", "bfloat16", "float32", "float64"}
CASTS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


def as_numbers(raw: np.ndarray, dtype: str) -> np.ndarray | None:
    """``raw`` (uint8) as an array of float64 (complex128 for complex dtypes), or None for a dtype without a
    numeric view."""
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype not in _NUMPY:
        return None
    values = raw.view(np.dtype(dtype))
    return values.astype(np.complex128 if values.dtype.kind == "c" else np.float64)


EXACT_INTS = ("int64", "uint64")  # integers float64 cannot hold: their differences are taken exactly


def int_distance(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """|b - a| of the int64 or uint64 elements whose raw bytes are ``a``/``b``, as float64: subtracted exactly
    first (through float64 a change of 1 at 1e17 is 0), since the distance of two int64s, or of two uint64s,
    always fits a uint64; only it is rounded."""
    flip = np.uint64(1 << 63) if dtype == "int64" else np.uint64(0)  # int64 order as uint64 order
    ua, ub = a.view(np.uint64) ^ flip, b.view(np.uint64) ^ flip
    return (np.maximum(ua, ub) - np.minimum(ua, ub)).astype(np.float64)


def cast(raw: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Floating-point bytes ``raw`` of dtype ``src`` converted to ``dst`` (float32 or bfloat16), as uint8."""
    if src == dst:
        return raw
    if src == "bfloat16":
        f32 = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # past float32's range: inf, as torch casts it
            # float64 -> float32 rounds to nearest even; float32 is read in place (only float32 is written to)
            f32 = raw.view(np.dtype(src)).astype(np.float32, copy=dst == "float32")
    if dst == "float32":
        f32[np.isnan(f32)] = np.nan  # one NaN, 0x7FC00000, in every format (a payload does not survive a cast)
        return f32.view(np.uint8)
    u = f32.view(np.uint32)
    # Round to nearest even in place on one uint32 array (uint64 temporaries took 6.5x the slab): the sum
    # wraps only for bit patterns from 0xFFFF8001 up, all NaNs, which are set below.
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u
    r >>= 16
    rounded = r.astype(np.uint16)
    del r
    rounded[np.isnan(f32)] = 0x7FC0
    return rounded.view(np.uint8)


def cast_target(name: str | None) -> str | None:
    """The dtype an export's ``dtype`` option names (``bf16`` / ``fp32``), or None for no cast."""
    if name is None:
        return None
    try:
        return CASTS[name]
    except KeyError:
        raise ValueError(f"dtype must be one of bf16, fp32 (or bfloat16, float32), got {name!r}") from None

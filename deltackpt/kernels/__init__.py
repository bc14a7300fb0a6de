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
    plane_stats(src)                           -> (nonzero bytes, pairs of positions with equal bytes)
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

The package: :mod:`.arguments` (the checks both implementations share), :mod:`.pure` (the numpy kernels),
:mod:`.impl` (the validating wrapper and the two backends), :mod:`.twins` (Python twins of the native batch
kernels); this module picks the live backend and binds the public names to it.
"""

from __future__ import annotations

import numpy as np

from deltackpt import settings
from deltackpt.errors import NativeKernelUnavailable

from . import twins
from .arguments import ELEM_SIZES
from .impl import _native, native_error as _native_error, native_impl, numpy_impl
from .pure import GEAR

__all__ = [
    "BACKEND",
    "ELEM_SIZES",
    "GEAR",
    "fastcdc_cuts",
    "find_bucketed",
    "find_sorted",
    "hash_spans",
    "native_impl",
    "numpy_impl",
    "plane_stats",
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
    "wait_hashed",
    "xxh3_64_rows",
    "zigzag_shuffle",
]

_BACKEND_CHOICES = settings.KERNEL_CHOICES


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

# chunk_refs(refs, out, offset, ends=None) -> (count, total length) | None: a manifest item's chunk ids (and into
# ends, uint32, each ref's skip + length) read from its msgpack in C with no object per ref (native only:
# store/manifest.py decodes with msgspec where it is None).
# getattr: an extension built before native/refs.c existed lacks it; then refs are read the general way.
chunk_refs = getattr(_native, "chunk_refs", None) if BACKEND == "native" else None
# walk_refs(state, piece, top, items, ids, recs, at, ends=None) -> (status, consumed): a resumable walk over a
# whole manifest body fed in pieces (ends: uint32, each ref's skip + length beside its id; native only:
# store/refstream.py reads manifests whole where it is None). WALKER_BYTES: the size of its state.
walk_refs = getattr(_native, "walk_refs", None) if BACKEND == "native" else None
WALKER_BYTES = getattr(_native, "WALKER_BYTES", 0) if BACKEND == "native" else 0


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


# unshuffle_check(buf, frames, elem_size, src, outs, ids, ok) -> passed: the planes of many chunks unshuffled into
# outs and each hashed against its id in one call (store/planebatch.py; docstring in native/binding.c).
# xxh3_64_rows(rows, stride, nbytes, out): the digests of many entry headers.
unshuffle_check = _batch_kernel("unshuffle_check", twins.unshuffle_check)
xxh3_64_rows = _batch_kernel("xxh3_64_rows", twins.xxh3_64_rows)
# hash_spans(bufs, spans, out, state) -> hashed: the chunk ids of many spans, hashed without the GIL by a thread
# ahead of the writer, progress published span by span; wait_hashed(state, n, timeout_us) -> hashed so far
# (store/hashahead.py; docstrings in native/binding.c).
hash_spans = _batch_kernel("hash_spans", twins.hash_spans)
wait_hashed = _batch_kernel("wait_hashed", twins.wait_hashed)
# find_sorted(ids, keys, out): where each key is in a sorted set of 16-byte ids (store/idset.py).
find_sorted = _batch_kernel("find_sorted", twins.find_sorted)
# find_bucketed(ids, starts, bits, keys, out): the same, keys in any order, through a bucket table (idset).
find_bucketed = _batch_kernel("find_bucketed", twins.find_bucketed)
# sort_ids(ids, pay=None): 16-byte ids sorted in place, in memcmp order (idset's sets); pay: uint32 moved along.
sort_ids = _batch_kernel("sort_ids", twins.sort_ids)
# plane_stats(src) -> (nonzero, pairs): a byte plane's nonzero bytes and its pairs of equal bytes, from one pass
# (store/planes.py decides with them whether a plane is stored sparse, raw or zstd-coded).
plane_stats = _batch_kernel("plane_stats", twins.plane_stats)

"""Chunk codecs: how a chunk's raw bytes are turned into the bytes stored in a pack, and back.

A codec is chosen per chunk and recorded in the pack entry header by id, so readers never guess:

======  ============  ==========================================================================
id      name          stored bytes
======  ============  ==========================================================================
0       ``raw``       the raw bytes
1       ``zstd``      the byte planes of raw (``elem_size`` planes), in a plane container
2       ``delta``     the byte planes of ``raw XOR base`` in a plane container; ``base`` is another
                      chunk (a keyframe)
3       ``zdelta``    the byte planes of ``zigzag(raw - base)`` in a plane container: the difference
                      of each element's bit pattern as a little-endian integer, zigzag-mapped
                      (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...; a trailing partial element is XORed);
                      ``base`` as for ``delta`` (store feature ``zigzag-delta``)
======  ============  ==========================================================================

Byte planes regroup the k bytes of each element into k planes (all first bytes, then all second bytes, ...),
which lets zstd find the redundancy in float exponents. The chunk id is always the hash of the *raw* bytes,
so how a chunk is coded never changes its identity.

XOR or difference: most elements move by a few units in the last place between checkpoints. XOR turns a
change of +-1 in the bit pattern into a carry chain (1, 3, 7, 15 ... set bits), the difference keeps it +-1
(zigzag 1 or 2), so the low planes carry less entropy and the higher ones are zero more often (the bench's
bf16 fine-tuning run, each checkpoint against the one before: 3.30x instead of 2.86x; in the store, against
keyframes: 2.58x instead of 2.45x of DCP's bytes). A value that changes sign costs every byte of a difference
but one bit of XOR, so XOR stays a codec: the writer picks per chunk (:mod:`.deltapolicy`); readers decode
both.

The stored bytes are a plane container (:mod:`.planes`) or, for ``raw``, the bytes themselves.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from .planes import (PLANES_MAGIC, SEG_RAW, SEG_SPARSE, SEG_ZSTD, Coded, apply_in_place, apply_sparse,
                     applies_in_place, container_header_size, container_segments, pack_planes, plane_layout,
                     scratch_array, unpack_planes)

__all__ = ["RAW", "ZSTD", "DELTA", "ZDELTA", "CODEC_NAMES", "DELTA_CODECS", "VALID_ELEM_SIZES", "Coded",
           "PLANES_MAGIC", "SEG_RAW", "SEG_ZSTD", "SEG_SPARSE", "applies_in_place", "container_header_size",
           "decode", "decode_onto", "encode_best", "encode_delta", "encode_planes", "is_delta", "plane_layout",
           "scratch_array"]

RAW = 0
ZSTD = 1
DELTA = 2
ZDELTA = 3

CODEC_NAMES = {RAW: "raw", ZSTD: "zstd", DELTA: "delta", ZDELTA: "zdelta"}
DELTA_CODECS = (DELTA, ZDELTA)  # codecs whose chunk has a base
VALID_ELEM_SIZES = (1, 2, 4, 8)
# A plane of a zigzag difference is zstd-coded when its sample shrinks by this much (others: by 3 %): its low
# planes are often a little compressible (a biased sign bit: 7 bits of 8), where a zstd pass costs more time
# than it saves bytes. On fp32 Adam state (benchmarks/bench_kernels.py) 0.10 instead of 0.03 codes 1.38x
# instead of 1.41x (XOR: 1.31x) at about 1.5x the speed both ways (encode 1.6 against 1.1 GB/s, decode 2.2
# against 1.6). A store made for the fewest bytes (chain_links "all") takes 0.03 (MIN_ZDELTA_PLANE_GAIN_ALL):
# its chained bf16 deltas' low planes shrink by 3-10 %, 393.95 -> 392.77 MiB on the bench's bf16 run.
_MIN_ZDELTA_PLANE_GAIN = 0.10
MIN_ZDELTA_PLANE_GAIN_ALL = 0.03


def encode_planes(raw, elem_size: int, level: int) -> Coded:
    """The ``zstd`` codec's stored bytes for ``raw``."""
    planes = kernels.shuffle(raw, elem_size) if elem_size > 1 else np.frombuffer(raw, dtype=np.uint8)
    return pack_planes(planes, elem_size, level)


def is_delta(codec: int) -> bool:
    """Whether a chunk coded with ``codec`` is a delta (needs its base to decode)."""
    return codec in DELTA_CODECS


def encode_delta(raw, base, elem_size: int, level: int, kind: int = DELTA, zdelta_gain: float | None = None) -> Coded:
    """The stored bytes for ``raw`` against ``base`` (same length) in delta codec ``kind`` (``DELTA``: XOR,
    ``ZDELTA``: zigzag difference; ``zdelta_gain``: what a zigzag plane must save to be zstd-coded, default
    ``_MIN_ZDELTA_PLANE_GAIN``)."""
    if kind == ZDELTA:
        gain = _MIN_ZDELTA_PLANE_GAIN if zdelta_gain is None else zdelta_gain
        return pack_planes(kernels.zigzag_shuffle(raw, base, elem_size), elem_size, level, gain)
    if kind == DELTA:
        return pack_planes(kernels.xor_shuffle(raw, base, elem_size), elem_size, level)
    raise ValueError(f"codec {kind} is not a delta codec")

def decode(codec: int, stored, raw_len: int, elem_size: int, base=None, out=None, scratch=None):
    """Raw bytes of a chunk (bytes or a uint8 array). ``ValueError`` when the stored bytes are damaged.

    ``out``, a writable uint8 array of ``raw_len`` bytes, receives the result of a ``zstd`` or ``delta``
    chunk (which is then returned), saving a copy when the caller wanted the bytes there anyway. ``scratch``,
    a writable uint8 array of ``raw_len`` bytes that does not overlap ``out``, holds the decoded byte planes
    on the way (a new array when None); its contents afterwards are unspecified.
    """
    if elem_size not in VALID_ELEM_SIZES:
        raise ValueError(f"invalid element size {elem_size}")
    if isinstance(stored, Coded):
        stored = bytes(stored)
    if codec == RAW:
        if len(stored) != raw_len:
            raise ValueError(f"raw chunk has {len(stored)} bytes, expected {raw_len}")
        return stored
    if codec == ZSTD:
        if elem_size == 1:  # one plane: the planes are the raw bytes
            return unpack_planes(stored, raw_len, 1, out)
        planes = unpack_planes(stored, raw_len, elem_size, scratch)
        if out is None:
            out = np.empty(raw_len, dtype=np.uint8)
        kernels.unshuffle_into(planes, elem_size, out)  # sizes checked; planes is never out (scratch or new)
        return out
    if codec in DELTA_CODECS:
        if base is None or len(base) != raw_len:
            raise ValueError("delta chunk needs its base chunk of the same length")
        segments = container_segments(stored, raw_len, elem_size)
        if apply_in_place(segments, raw_len, elem_size):  # the base, changed where the delta is nonzero
            if out is None:
                out = np.array(np.frombuffer(base, dtype=np.uint8))
            else:
                out[:] = np.frombuffer(base, dtype=np.uint8)
            apply_sparse(segments, out, elem_size, codec == ZDELTA, scratch)
            return out
        undo = kernels.unshuffle_zigzag if codec == ZDELTA else kernels.unshuffle_xor
        return undo(unpack_planes(stored, raw_len, elem_size, scratch, segments), base, elem_size, out=out)
    raise ValueError(f"unknown codec id {codec}")


def decode_onto(codec: int, stored, raw_len: int, elem_size: int, base: np.ndarray, spare: np.ndarray,
                scratch=None) -> np.ndarray:
    """Decode delta chunk ``stored`` against ``base`` (a writable uint8 array) where it is cheapest, and
    return the array that holds it: ``base`` itself, changed in place, when every plane of the delta is
    zero-sparse (only the elements it changes are touched: a chain of sparse deltas costs their nonzero
    bytes, not a pass over the chunk each), else ``spare`` (``base`` left as is). Raises as :func:`decode`;
    ``base`` then holds garbage."""
    if elem_size not in VALID_ELEM_SIZES:
        raise ValueError(f"invalid element size {elem_size}")
    if codec not in DELTA_CODECS:
        raise ValueError(f"codec {codec} is not a delta codec")
    if isinstance(stored, Coded):
        stored = bytes(stored)
    if len(base) != raw_len:
        raise ValueError("delta chunk needs its base chunk of the same length")
    segments = container_segments(stored, raw_len, elem_size)
    if apply_in_place(segments, raw_len, elem_size):
        apply_sparse(segments, base, elem_size, codec == ZDELTA, scratch)
        return base
    undo = kernels.unshuffle_zigzag if codec == ZDELTA else kernels.unshuffle_xor
    return undo(unpack_planes(stored, raw_len, elem_size, scratch, segments), base, elem_size, out=spare)


def encode_best(raw, elem_size: int, level: int, min_gain: float) -> tuple[int, Coded | bytes | memoryview]:
    """(codec, stored) for a keyframe: zstd over byte planes unless it saves less than ``min_gain``."""
    n = len(raw)
    if n == 0:
        return RAW, b""
    coded = encode_planes(raw, elem_size, level)
    if len(coded) <= n * (1.0 - min_gain):
        return ZSTD, coded
    return RAW, raw

"""Chunk codecs: how a chunk's raw bytes are turned into the bytes stored in a pack, and back.

A codec is chosen per chunk and recorded in the pack entry header by id, so readers never guess:

======  ============  ==========================================================================
id      name          stored bytes
======  ============  ==========================================================================
0       ``raw``       the raw bytes
1       ``zstd``      zstd(byte_planes(raw, elem_size)); elem_size 1 is plain zstd
2       ``delta``     zstd(byte_planes(raw XOR base, elem_size)); ``base`` is another chunk (a keyframe)
======  ============  ==========================================================================

Byte planes regroup the k bytes of each element into k planes (all first bytes, then all second bytes, ...),
which lets zstd find the redundancy in float exponents. The chunk id is always the hash of the *raw* bytes,
so how a chunk is coded never changes its identity.
"""

from __future__ import annotations

import threading

import zstandard

from .. import kernels

RAW = 0
ZSTD = 1
DELTA = 2

CODEC_NAMES = {RAW: "raw", ZSTD: "zstd", DELTA: "delta"}
VALID_ELEM_SIZES = (1, 2, 4, 8)

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def encode_planes(raw, elem_size: int, level: int) -> bytes:
    planes = kernels.shuffle(raw, elem_size) if elem_size > 1 else raw
    return _compressor(level).compress(planes)


def encode_delta(raw, base, elem_size: int, level: int) -> bytes:
    return _compressor(level).compress(kernels.xor_shuffle(raw, base, elem_size))


def _zstd_decode(stored, raw_len: int) -> bytes:
    try:
        # A damaged frame header could claim any size; python-zstandard would allocate it before failing.
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame is damaged: {e}") from None
    if declared != raw_len:
        raise ValueError(f"zstd frame declares {declared} bytes, expected {raw_len}")
    try:
        out = _decompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame is damaged: {e}") from None
    if len(out) != raw_len:
        raise ValueError(f"zstd frame decoded to {len(out)} bytes, expected {raw_len}")
    return out


def decode(codec: int, stored, raw_len: int, elem_size: int, base=None):
    """Raw bytes of a chunk (bytes or a uint8 array). ``ValueError`` when the stored bytes are damaged."""
    if codec == RAW:
        if len(stored) != raw_len:
            raise ValueError(f"raw chunk has {len(stored)} bytes, expected {raw_len}")
        return stored
    if codec == ZSTD:
        planes = _zstd_decode(stored, raw_len)
        return kernels.unshuffle(planes, elem_size) if elem_size > 1 else planes
    if codec == DELTA:
        if base is None or len(base) != raw_len:
            raise ValueError("delta chunk needs its base chunk of the same length")
        return kernels.unshuffle_xor(_zstd_decode(stored, raw_len), base, elem_size)
    raise ValueError(f"unknown codec id {codec}")


def encode_best(raw, elem_size: int, level: int, min_gain: float) -> tuple[int, bytes | memoryview]:
    """(codec, stored) for a keyframe: zstd over byte planes unless it saves less than ``min_gain``."""
    n = len(raw)
    if n == 0:
        return RAW, b""
    coded = encode_planes(raw, elem_size, level)
    if len(coded) <= n * (1.0 - min_gain):
        return ZSTD, coded
    return RAW, raw

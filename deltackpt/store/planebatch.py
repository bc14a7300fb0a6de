"""Many keyframes' plane containers decoded and checked with few calls: the ``zstd``-codec chunks of a bundle
(chunks of one pack read with one request, :mod:`.reader`), decoded as :func:`.codec.decode` decodes each.

Through ``codec.decode`` an 8 KiB float32 chunk cost ~9 us, ~2.5-4 us of it in zstd and the rest Python around
it (segment table, slices, checks). Here the segment tables of all chunks are parsed and checked in arrays,
every zstd frame of the bundle is decoded by one ``multi_decompress_to_buffer`` call (the GIL released, each
frame's size checked by zstd), and every chunk's planes (where they lie: its stored bytes or zstd's output)
are unshuffled into place and hashed against its id by one ``kernels.unshuffle_check`` call (C, the GIL
released; its Python twin gives the same bytes): no Python work per chunk. A chunk whose container is anything
else (a legacy single frame, a zero-sparse plane, a table that does not add up) is left to ``codec.decode``,
which decodes it or names the damage.
"""

from __future__ import annotations

import numpy as np
import zstandard

from .. import kernels
from . import codec, planes

_SEG_DTYPE = np.dtype([("mode", "u1"), ("len", "<u4")])  # one entry of a container's segment table, unaligned
_MAGIC = np.frombuffer(codec.PLANES_MAGIC, dtype=np.uint8)


def decode_keyframes(buf: np.ndarray, pos: np.ndarray, stored_len: np.ndarray, raw_len: np.ndarray,
                     elem_size: np.ndarray, outs: list, ids: bytes) -> np.ndarray:
    """Decode ``zstd``-codec chunks whose stored bytes are ``buf[pos[i]:pos[i] + stored_len[i]]`` (``buf`` a
    uint8 array) into ``outs[i]`` (writable buffers of ``raw_len[i]`` bytes) and check each against its id
    (``ids[16 * i:16 * i + 16]``). Returns a bool per chunk: True where decoded and its bytes hash to its id,
    False where left alone (see the module docstring; a damaged frame leaves its whole element-size group
    alone) or where the hash differs (damage ``codec.decode`` and the caller's check then name)."""
    done = np.zeros(len(pos), dtype=bool)
    for k in np.unique(elem_size).tolist():
        if k not in codec.VALID_ELEM_SIZES:
            continue
        rows = np.flatnonzero((elem_size == k) & (stored_len >= codec.container_header_size(k)))
        if len(rows):
            every = len(rows) == len(pos)  # one element size, every container long enough: the usual case
            group, ok = _decode_group(buf, pos if every else pos[rows], stored_len if every else stored_len[rows],
                                      raw_len if every else raw_len[rows], k, *rows_of(outs, ids, rows))
            done[rows[group[ok]]] = True
    return done


def _decode_group(buf, pos, stored_len, raw_len, k: int, outs: list, ids: bytes) -> tuple[np.ndarray, np.ndarray]:
    """decode_keyframes for chunks of element size ``k`` whose stored bytes can hold a container header;
    returns (the indices of those decoded, whether each hashes to its id)."""
    head = codec.container_header_size(k)
    tab = buf[pos[:, None] + np.arange(head)]  # every container header, gathered: (chunks, head)
    seg = np.ascontiguousarray(tab[:, len(_MAGIC):]).view(_SEG_DTYPE)  # (chunks, k + 1): the planes, the tail
    mode, slen = seg["mode"], seg["len"].astype(np.int64)
    raw_len = raw_len.astype(np.int64)
    per = raw_len // k
    want = np.repeat(per[:, None], k + 1, axis=1)  # each segment's decoded length
    want[:, k] = raw_len - per * k
    raw, zst = mode == codec.SEG_RAW, mode == codec.SEG_ZSTD
    good = ((tab[:, :len(_MAGIC)] == _MAGIC).all(axis=1)
            & (raw & (slen == want) | zst & (slen > 0) & (want > 0)).all(axis=1)
            & (head + slen.sum(axis=1) == stored_len))
    rows = np.flatnonzero(good)
    if not len(rows):
        return rows, rows.astype(bool)
    slen, want, zst = slen[rows], want[rows], zst[rows]
    src = pos[rows, None] + head + np.cumsum(slen, axis=1) - slen  # where each segment's stored bytes are
    frames = None
    if zst.any():
        table = np.stack([src[zst], slen[zst]], axis=1).astype(np.uint64)
        try:
            frames = planes.decompressor().multi_decompress_to_buffer(
                zstandard.BufferWithSegments(buf, table.tobytes()),
                decompressed_sizes=want[zst].astype(np.uint64).tobytes())
        except zstandard.ZstdError:
            return rows[:0], rows[:0].astype(bool)  # codec.decode finds the damaged frame and names it
        src[zst] = -1 - np.arange(int(zst.sum()))  # a zstd plane is read from its frame (row-major, as decoded)
    ok = np.zeros(len(rows), dtype=np.uint8)
    kernels.unshuffle_check(buf, frames, k, np.ascontiguousarray(src, dtype=np.int64), *rows_of(outs, ids, rows), ok)
    return rows, ok.view(bool)


def rows_of(outs: list, ids: bytes, rows: np.ndarray) -> tuple[list, bytes]:
    """The ``rows`` of ``outs`` and of ``ids`` (16-byte ids joined): all of them as they are, usually."""
    if len(rows) == len(outs):
        return outs, ids
    return [outs[i] for i in rows.tolist()], np.frombuffer(ids, dtype=np.uint8).reshape(-1, 16)[rows].tobytes()

"""Many keyframes' plane containers decoded with few calls: the ``zstd``-codec chunks of a bundle (chunks of
one pack read with one request, :mod:`.reader`), decoded as :func:`.codec.decode` decodes each.

Through ``codec.decode`` an 8 KiB float32 chunk cost ~9 us, ~2.5 us of it in zstd and the rest Python around
it (segment table, slices, checks). Here the segment tables of all chunks are parsed and checked in arrays,
every zstd frame of the bundle is decoded by one ``multi_decompress_to_buffer`` call (the GIL released, each
frame's size checked by zstd), and the Python work left per chunk is a buffer copy per run of planes and the
unshuffle. A chunk whose container is anything else (a legacy single frame, a zero-sparse plane, a table
that does not add up) is left to ``codec.decode``, which decodes it or names the damage.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from .. import kernels
from . import codec

_SEG_DTYPE = np.dtype([("mode", "u1"), ("len", "<u4")])  # one entry of a container's segment table, unaligned
_MAGIC = np.frombuffer(codec.PLANES_MAGIC, dtype=np.uint8)
_local = threading.local()


def decode_keyframes(buf: np.ndarray, pos: np.ndarray, stored_len: np.ndarray, raw_len: np.ndarray,
                     elem_size: np.ndarray, outs: list) -> np.ndarray:
    """Decode ``zstd``-codec chunks whose stored bytes are ``buf[pos[i]:pos[i] + stored_len[i]]`` (``buf`` a
    uint8 array) into ``outs[i]`` (writable buffers of ``raw_len[i]`` bytes). Returns a bool per chunk: True
    where decoded (its hash still to check: the caller does that), False where left alone (see the module
    docstring; a damaged frame leaves its whole element-size group alone)."""
    done = np.zeros(len(pos), dtype=bool)
    for k in np.unique(elem_size).tolist():
        if k not in codec.VALID_ELEM_SIZES:
            continue
        rows = np.flatnonzero((elem_size == k) & (stored_len >= codec.container_header_size(k)))
        if len(rows):
            group = _decode_group(buf, pos[rows], stored_len[rows], raw_len[rows], k, [outs[i] for i in rows])
            done[rows[group]] = True
    return done


def _decode_group(buf, pos, stored_len, raw_len, k: int, outs: list) -> np.ndarray:
    """decode_keyframes for chunks of element size ``k`` whose stored bytes can hold a container header;
    returns the indices of those decoded."""
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
        return rows
    mode, slen, want, raw, zst = mode[rows], slen[rows], want[rows], raw[rows], zst[rows]
    src = pos[rows, None] + head + np.cumsum(slen, axis=1) - slen  # where each segment's stored bytes are
    dst = np.cumsum(want, axis=1) - want  # where its planes go
    frames = None
    if zst.any():
        table = np.stack([src[zst], slen[zst]], axis=1).astype(np.uint64)
        try:
            frames = codec._decompressor().multi_decompress_to_buffer(
                zstandard.BufferWithSegments(buf, table.tobytes()),
                decompressed_sizes=want[zst].astype(np.uint64).tobytes())
        except zstandard.ZstdError:
            return rows[:0]  # codec.decode finds the damaged frame and names it
    # One copy per run of planes stored as is (they lie in the same order in the stored bytes and the planes)
    # and one per zstd frame: (chunk, frame number or -1, stored at, goes to, length), by chunk.
    raw &= want > 0
    first = raw.copy()
    first[:, 1:] &= ~raw[:, :-1]
    r_chunk, r_seg = np.nonzero(raw)
    starts = np.flatnonzero(first[r_chunk, r_seg])
    run_len = np.add.reduceat(want[r_chunk, r_seg], starts) if len(starts) else np.zeros(0, np.int64)
    z_chunk, z_seg = np.nonzero(zst)
    chunk = np.concatenate([r_chunk[starts], z_chunk])
    order = np.argsort(chunk, kind="stable")
    ops = list(zip(np.concatenate([np.full(len(starts), -1), np.arange(len(z_chunk))])[order].tolist(),
                   np.concatenate([src[r_chunk, r_seg][starts], src[z_chunk, z_seg]])[order].tolist(),
                   np.concatenate([dst[r_chunk, r_seg][starts], dst[z_chunk, z_seg]])[order].tolist(),
                   np.concatenate([run_len, want[z_chunk, z_seg]])[order].tolist()))
    bounds = np.searchsorted(chunk[order], np.arange(len(rows) + 1)).tolist()
    bmv = memoryview(buf)
    planes = memoryview(codec.scratch_array(_local, "planes", int(raw_len.max()), keep_max=16 << 20))
    unshuffle = kernels.unshuffle_into
    lens = raw_len[rows].tolist()
    for j, row in enumerate(rows.tolist()):
        out = outs[row]
        target = planes[:lens[j]] if k > 1 else memoryview(out)
        for frame, at, to, n in ops[bounds[j]:bounds[j + 1]]:
            target[to:to + n] = frames[frame] if frame >= 0 else bmv[at:at + n]
        if k > 1:
            unshuffle(target, k, out)
    return rows


"""The plane container: how a codec payload holds a chunk's byte planes, each stored its own way.

Byte planes regroup the k bytes of each element into k planes (all first bytes, then all second bytes, ...),
which lets zstd find the redundancy in float exponents; :mod:`.codec` says which bytes are shuffled (the raw
chunk, or its XOR or zigzag difference with a base).

Plane container (written since 0.2)::

    b"DCPL"  then for each of k planes and the tail (raw_len % k bytes): mode:u8 stored_len:u32 (LE)
    then the segments' stored bytes, in that order; mode 0 = stored as is, 1 = one zstd frame,
    2 = zero-sparse: nnz:u32 bitmap_mode:u8 bitmap_len:u32 values_mode:u8, the bitmap's stored bytes, then
        the values' (each part stored as is, mode 0, or as one zstd frame, mode 1); a reader that
        predates mode 2 fails to decode such a chunk (unknown mode), it never misreads one

Each plane is zstd-coded only when a sample of it compresses (the low mantissa planes of floats and of
their XOR deltas usually do not), so incompressible planes cost a copy instead of a zstd pass, on save and
on load. A plane whose sample is mostly zero bytes (the high planes of an XOR delta: most values kept their
sign and exponent, many kept every bit) is stored zero-sparse: a bitmap of its nonzero bytes (bit i, LSB
first, for byte i) and those bytes in order, each part zstd-coded when that helps. zstd then reads about
n/8 + nnz bytes instead of n, which is several times faster on such planes and compresses them better
(measured on bf16 fine-tuning deltas: 12.8x instead of 10.0x on the sign+exponent plane). A delta whose
planes are all zero-sparse is applied to its base in place (:func:`apply_sparse`).

A payload that starts with the zstd frame magic instead is one zstd frame over all planes (the layout of
stores written before the container; still read).
"""

from __future__ import annotations

import functools
import struct
import threading

import numpy as np
import zstandard

from .. import kernels

PLANES_MAGIC = b"DCPL"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SEG = struct.Struct("<BI")
SEG_RAW, SEG_ZSTD, SEG_SPARSE = 0, 1, 2
_SPARSE = struct.Struct("<IBIB")  # nonzero count, bitmap mode, bitmap stored length, values mode
_SAMPLE = 32 * 1024  # a plane larger than 4 samples is judged by a sample from its middle
_MIN_PLANE_GAIN = 0.03  # a plane is zstd-coded when the sample shrinks by at least this much
# A plane whose sample has at most this fraction of nonzero bytes is stored sparse (when that is smaller). 0.5
# before: chained bf16 deltas have planes just over half nonzero that store smaller sparse (393.95 -> 393.70 MiB
# on the bench's bf16 run with chain_links all; 0.7 and 0.8 store the same as 0.6, 0.4 more).
SPARSE_MAX_DENSITY = 0.6
# A plane whose middle (at most this many bytes) has as many equal pairs of bytes as uniform random bytes, within
# the plane's gain, is stored as is without trying zstd: an order-0 coder cannot shrink it (see _incompressible).
_STATS_SAMPLE = 2048
_ANY_GAIN = 0.01  # a plane coded whole keeps any gain zstd finds: it is skipped only when the bound is under 1 %
# A delta whose planes are all sparse is decoded in place (only its nonzero bytes touched) up to this fraction
# of nonzero bytes; past it, scattered writes cost more than a pass over the chunk (4 MiB fp32: equal at ~10 %).
SPARSE_APPLY_MAX_DENSITY = 1 / 16

# zstd level 1 (the default) means these parameters: zstd's fast strategy with a 128-entry hash table and
# 7-byte minimum matches. Byte planes of floats are low-entropy symbols with few long repeats; on them this
# compresses as well as zstd's own level 1 and up to 2.5x faster on the sign+exponent planes (measured on
# bf16 Adam state and fp32 weights). Other levels are zstd's.
FAST_PLANE_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=7, chain_log=6, search_log=1,
                         min_match=7, target_length=0)

_local = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor for ``level`` (level 1: FAST_PLANE_PARAMS)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        if level == 1:
            params = zstandard.ZstdCompressionParameters(**FAST_PLANE_PARAMS, write_content_size=True)
            cctx = zstandard.ZstdCompressor(compression_params=params)
        else:
            cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        cache[level] = cctx
    return cctx


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


class Coded:
    """A coded chunk as a list of buffers (header, then segments), so that coding never copies the planes
    that are stored as is; ``bytes(coded)`` joins them."""

    __slots__ = ("parts", "_len")

    def __init__(self, parts: list, length: int | None = None) -> None:
        """``length``: the parts' total length when the caller knows it."""
        self.parts = parts
        self._len = sum(len(p) for p in parts) if length is None else length

    def __len__(self) -> int:
        return self._len

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


@functools.lru_cache(maxsize=256)
def _segments(n: int, elem_size: int) -> tuple[tuple[int, int], ...]:
    """(start, length) of the k planes and the tail inside a shuffled buffer of n bytes (cached: a load asks
    for a few sizes, once per chunk)."""
    per = n // elem_size
    return (*((i * per, per) for i in range(elem_size)), (per * elem_size, n - per * elem_size))


def _sparse_parts(cctx, seg: np.ndarray) -> list:
    """The zero-sparse segment body of ``seg`` as buffers (header, bitmap, values)."""
    bitmap, vals = kernels.sparse_split(seg)
    parts, modes = [], []
    for part in (bitmap, vals):
        coded = cctx.compress(part) if len(part) >= 64 else b""
        if coded and len(coded) < len(part):
            parts.append(coded)
            modes.append(SEG_ZSTD)
        else:
            parts.append(part)
            modes.append(SEG_RAW)
    return [_SPARSE.pack(len(vals), modes[0], len(parts[0]), modes[1]), *parts]


def _incompressible(sample: np.ndarray, min_gain: float) -> bool:
    """Whether the middle of ``sample`` says its plane is no use to zstd: bytes spread so evenly over their values
    that no coder of independent bytes saves ``min_gain`` of them (the low mantissa planes of new float chunks;
    zstd took ~6.8 us to find that out on each 6 KiB plane of a fine-tune's first save, this test ~1.5 us).

    The test: ``pairs / (n * (n - 1))`` estimates without bias the chance that two bytes are equal, sum p(b)^2,
    whose -log2 (the Renyi entropy) never exceeds the Shannon entropy; the plane is called incompressible when
    even that bound leaves less than ``min_gain`` to save, ``-log2(p2) >= 8 * (1 - min_gain)`` bits a byte.
    Only long repeats could still let zstd shrink such bytes (a row of random values stored twice in one
    chunk); that plane is then stored as is, a loss this test accepts for its speed."""
    n = sample.size
    if n < 1024:
        return False  # too few pairs to tell (and zstd on it is cheap)
    if n > _STATS_SAMPLE:
        mid = (n - _STATS_SAMPLE) // 2
        sample, n = sample[mid:mid + _STATS_SAMPLE], _STATS_SAMPLE
    _nonzero, pairs = kernels.plane_stats(sample)
    return pairs <= n * (n - 1) * 2.0 ** (-8.0 * (1.0 - min_gain))


@functools.lru_cache(maxsize=16)
def _head_struct(elem_size: int) -> struct.Struct:
    """The plane container's header (magic, then mode and stored length of each plane and the tail)."""
    return struct.Struct("<4s" + "BI" * (elem_size + 1))


def pack_planes(planes: np.ndarray, elem_size: int, level: int, min_gain: float = _MIN_PLANE_GAIN) -> Coded:
    # One struct for the header and lengths summed on the way: this runs once per new chunk, in the saving
    # thread for small ones (a fine-tune's 201 new chunks, ~1,000 planes), where Python's share is the cost.
    cctx = compressor(level)
    fields, bodies, size = [PLANES_MAGIC], [], 0
    for start, length in _segments(planes.size, elem_size):
        if length < 64:  # (the tail, or a tiny chunk's planes): as is
            fields += (SEG_RAW, length)
            size += length
            if length:
                bodies.append(planes[start:start + length])
            continue
        seg = planes[start:start + length]
        if length > 4 * _SAMPLE:
            mid = (length // 2) & ~63
            sample, judged = seg[mid:mid + _SAMPLE], _SAMPLE
        else:
            sample, judged = seg, length
        if np.count_nonzero(sample) <= SPARSE_MAX_DENSITY * judged:
            parts = _sparse_parts(cctx, seg)
            slen = sum(map(len, parts))
            if slen < length:
                fields += (SEG_SPARSE, slen)
                bodies += parts
                size += slen
                continue
        elif not _incompressible(sample, min_gain if sample is not seg else _ANY_GAIN) and (
                sample is seg or len(cctx.compress(sample)) <= (1.0 - min_gain) * _SAMPLE):
            coded = cctx.compress(seg)
            if len(coded) < length:
                fields += (SEG_ZSTD, len(coded))
                bodies.append(coded)
                size += len(coded)
                continue
        fields += (SEG_RAW, length)
        bodies.append(seg)
        size += length
    head = _head_struct(elem_size)
    return Coded([head.pack(*fields), *bodies], head.size + size)


def container_header_size(elem_size: int) -> int:
    """Bytes of a plane container's header (magic and segment table) for ``elem_size`` planes."""
    return len(PLANES_MAGIC) + _SEG.size * (elem_size + 1)


def plane_layout(head, raw_len: int, elem_size: int) -> list[tuple[int, int, int]] | None:
    """(mode, offset in the stored bytes, stored length) of each of the ``elem_size`` planes, read from the
    first :func:`container_header_size` stored bytes; None when they are not a plane container's (a legacy
    single frame) or the table does not add up. Lets a reader look at a plane stored as is without
    decoding the chunk."""
    size = container_header_size(elem_size)
    if len(head) < size or bytes(head[:4]) != PLANES_MAGIC:
        return None
    out, pos = [], size
    for i, (_start, length) in enumerate(_segments(raw_len, elem_size)):
        mode, slen = _SEG.unpack_from(head, 4 + _SEG.size * i)
        if mode not in (SEG_RAW, SEG_ZSTD, SEG_SPARSE) or (mode == SEG_RAW and slen != length):
            return None
        out.append((mode, pos, slen))
        pos += slen
    return out[:elem_size]


# A frame of at most this many bytes is decoded with one call and copied: a stream reader costs 1-3 us more to
# set up, a third of an 8 KiB chunk's decode, while a copy this small costs little and faults no pages.
SMALL_FRAME_BYTES = 64 * 1024


def _zstd_into(stored, dest: memoryview) -> None:
    """Decode the zstd frame ``stored`` into ``dest`` (a writable byte memoryview it must fill exactly)."""
    n = len(dest)
    try:
        # A damaged frame header could claim any size: check it before decoding.
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame is damaged: {e}") from None
    if declared != n:
        raise ValueError(f"zstd frame declares {declared} bytes, expected {n}")
    if n <= SMALL_FRAME_BYTES:
        try:
            out = decompressor().decompress(stored)
        except zstandard.ZstdError as e:
            raise ValueError(f"zstd frame is damaged: {e}") from None
        if len(out) != n:
            raise ValueError(f"zstd frame decoded to {len(out)} bytes, expected {n}")
        dest[:] = out
        return
    got = 0
    try:
        # Decoded straight into the destination: no per-plane allocation (and none of the page faults a
        # fresh buffer per chunk costs on a multi-threaded load).
        reader = decompressor().stream_reader(stored, read_across_frames=False)
        while got < n:
            k = reader.readinto(dest[got:])
            if k == 0:
                break
            got += k
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame is damaged: {e}") from None
    if got != n:
        raise ValueError(f"zstd frame decoded to {got} bytes, expected {n}")


def scratch_array(holder: threading.local, name: str, n: int, *, min_size: int = 1 << 16,
                  keep_max: int = 16 << 20) -> np.ndarray:
    """The scratch array ``name`` of ``holder`` (a thread-local), ``n`` bytes long, grown as needed (to at
    least ``min_size``) and kept for the next call; a new array past ``keep_max``. Decoding then allocates
    nothing per chunk (fresh buffers page-fault, and the faults serialize a load's threads)."""
    if n > keep_max:
        return np.empty(n, dtype=np.uint8)
    buf = getattr(holder, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, min_size), dtype=np.uint8)
        setattr(holder, name, buf)
    return buf[:n]


def _part(stored, mode: int, n: int, what: str):
    """A sparse segment's bitmap or values (``n`` bytes) from its stored bytes; a zstd-coded part is decoded
    into this thread's scratch array ``what`` (valid until the next call for the same part)."""
    if mode == SEG_RAW:
        if len(stored) != n:
            raise ValueError(f"{what} has {len(stored)} bytes, expected {n}")
        return stored
    if mode == SEG_ZSTD:
        out = scratch_array(_local, "sparse_" + what, n)
        _zstd_into(stored, memoryview(out))
        return out
    raise ValueError(f"{what} has unknown mode {mode}")


def _sparse_into(body, dest: np.ndarray, i: int) -> None:
    """Decode the zero-sparse segment ``body`` of plane ``i`` into ``dest`` (it must fill it exactly)."""
    n = dest.size
    if len(body) < _SPARSE.size:
        raise ValueError(f"sparse plane {i} is truncated")
    nnz, bm_mode, bm_len, vals_mode = _SPARSE.unpack_from(body)
    if nnz > n:
        raise ValueError(f"sparse plane {i} claims {nnz} nonzero bytes of {n}")
    end = _SPARSE.size + bm_len
    if end > len(body):
        raise ValueError(f"sparse plane {i}'s bitmap is truncated")
    try:
        bitmap = _part(body[_SPARSE.size:end], bm_mode, (n + 7) // 8, "bitmap")
        vals = _part(body[end:], vals_mode, nnz, "values")
        kernels.sparse_merge(bitmap, vals, n, out=dest)
    except ValueError as e:
        raise ValueError(f"sparse plane {i}: {e}") from None


@functools.lru_cache(maxsize=16)
def _seg_table(num_segments: int) -> struct.Struct:
    """The segment table of a plane container of ``num_segments`` segments (one _SEG each)."""
    return struct.Struct("<" + "BI" * num_segments)


def _container_head(stored: memoryview, raw_len: int, elem_size: int) -> tuple | None:
    """A plane container's header: (each segment's (start, length), their (mode, stored length) fields flat,
    where the first body starts); None for a legacy single zstd frame."""
    head = stored[:4]
    if head == ZSTD_MAGIC:
        return None
    if head != PLANES_MAGIC:
        raise ValueError("stored bytes are neither a plane container nor a zstd frame")
    segs = _segments(raw_len, elem_size)
    table = _seg_table(len(segs))
    if len(stored) < 4 + table.size:
        raise ValueError("plane container header is truncated")
    return segs, table.unpack_from(stored, 4), 4 + table.size  # every segment's fields in one call


def container_segments(stored, raw_len: int, elem_size: int) -> list[tuple[int, int, int, memoryview]] | None:
    """(start, length, mode, stored body) of each segment of a plane container (its planes, then the tail),
    checked to add up; None for a legacy single zstd frame."""
    stored = memoryview(stored).cast("B")
    head = _container_head(stored, raw_len, elem_size)
    if head is None:
        return None
    segs, fields, pos = head
    out = []
    for i, ((start, length), mode, slen) in enumerate(zip(segs, fields[::2], fields[1::2])):
        body = stored[pos:pos + slen]
        if len(body) != slen:
            raise ValueError(f"plane {i} is truncated ({len(body)} of {slen} bytes)")
        pos += slen
        if mode not in (SEG_RAW, SEG_ZSTD, SEG_SPARSE):
            raise ValueError(f"plane {i} has unknown mode {mode}")
        out.append((start, length, mode, body))
    if pos != len(stored):
        raise ValueError(f"plane container has {len(stored) - pos} trailing bytes")
    return out


def _segment_into(i: int, length: int, mode: int, body, dest: np.ndarray) -> None:
    """Decode segment ``i`` (``length`` bytes when decoded) into ``dest``."""
    if not (length or len(body) or mode):
        return  # no tail (raw_len a multiple of elem_size), stored as nothing
    if mode == SEG_RAW:
        if len(body) != length:
            raise ValueError(f"raw plane {i} has {len(body)} bytes, expected {length}")
        memoryview(dest)[:] = body
    elif mode == SEG_ZSTD:
        _zstd_into(body, memoryview(dest))
    else:
        _sparse_into(body, dest, i)


def unpack_planes(stored, raw_len: int, elem_size: int, planes: np.ndarray | None = None,
                   segments=None) -> np.ndarray:
    """The shuffled planes of a plane container (or of a legacy single zstd frame), written into ``planes``
    (a writable uint8 array of ``raw_len`` bytes; a new one when None) and returned. ``segments``: the
    container's :func:`_container`, when the caller has it."""
    if planes is None:
        planes = np.empty(raw_len, dtype=np.uint8)
    elif planes.size != raw_len:
        raise ValueError(f"planes buffer has {planes.size} bytes, expected {raw_len}")
    if segments is not None:
        for i, (start, length, mode, body) in enumerate(segments):
            _segment_into(i, length, mode, body, planes[start:start + length])
        return planes
    # The same as _container then _segment_into, the segments inline: a keyframe's decode is on every load's
    # path, and the per-segment tuples and calls cost a tenth of a small chunk's decode.
    stored = memoryview(stored).cast("B")
    dest = memoryview(planes)
    head = _container_head(stored, raw_len, elem_size)
    if head is None:
        _zstd_into(stored, dest)
        return planes
    segs, fields, pos = head
    for i, ((start, length), mode, slen) in enumerate(zip(segs, fields[::2], fields[1::2])):
        if not (length or slen or mode):
            continue  # no tail (raw_len a multiple of elem_size), stored as nothing
        body = stored[pos:pos + slen]
        if len(body) != slen:
            raise ValueError(f"plane {i} is truncated ({len(body)} of {slen} bytes)")
        pos += slen
        if mode == SEG_RAW:
            if slen != length:
                raise ValueError(f"raw plane {i} has {slen} bytes, expected {length}")
            dest[start:start + length] = body
        elif mode == SEG_ZSTD:
            _zstd_into(body, dest[start:start + length])
        elif mode == SEG_SPARSE:
            _sparse_into(body, planes[start:start + length], i)
        else:
            raise ValueError(f"plane {i} has unknown mode {mode}")
    if pos != len(stored):
        raise ValueError(f"plane container has {len(stored) - pos} trailing bytes")
    return planes


def apply_sparse(segments, target: np.ndarray, elem_size: int, zigzag: bool, scratch: np.ndarray | None) -> None:
    """Apply a delta whose planes are all zero-sparse (``segments``: its :func:`_container`) to ``target``
    in place: only the elements it changes are touched. ``scratch`` (``len(target)`` bytes, or None) holds
    the planes' values on the way; their bitmaps go to this thread's scratch."""
    n = len(target) // elem_size
    b = (n + 7) // 8
    bitmaps = scratch_array(_local, "apply_bitmaps", elem_size * b)
    vals = scratch if scratch is not None else np.empty(len(target), dtype=np.uint8)
    counts = []
    for i, (_start, _length, _mode, body) in enumerate(segments[:elem_size]):
        if len(body) < _SPARSE.size:
            raise ValueError(f"sparse plane {i} is truncated")
        nnz, bm_mode, bm_len, vals_mode = _SPARSE.unpack_from(body)
        end = _SPARSE.size + bm_len
        if nnz > n or end > len(body):
            raise ValueError(f"sparse plane {i} is damaged ({nnz} nonzero bytes of {n}, bitmap {bm_len} bytes)")
        try:
            _part_into(body[_SPARSE.size:end], bm_mode, bitmaps[i * b:(i + 1) * b], "bitmap")
            _part_into(body[end:], vals_mode, vals[i * n:i * n + nnz], "values")
        except ValueError as e:
            raise ValueError(f"sparse plane {i}: {e}") from None
        counts.append(nnz)
    kernels.sparse_apply(bitmaps, vals[:n * elem_size], counts, target[:n * elem_size], elem_size, zigzag)
    start, length, mode, body = segments[elem_size]
    if length:  # the trailing partial element is XORed under both delta codecs
        tail = np.empty(length, dtype=np.uint8)
        _segment_into(elem_size, length, mode, body, tail)
        np.bitwise_xor(target[start:], tail, out=target[start:])


def _part_into(stored, mode: int, dest: np.ndarray, what: str) -> None:
    """A sparse segment's bitmap or values (``len(dest)`` bytes) from its stored bytes, into ``dest``."""
    if mode == SEG_RAW:
        if len(stored) != len(dest):
            raise ValueError(f"{what} has {len(stored)} bytes, expected {len(dest)}")
        memoryview(dest)[:] = stored
    elif mode == SEG_ZSTD:
        _zstd_into(stored, memoryview(dest))
    else:
        raise ValueError(f"{what} has unknown mode {mode}")


def apply_in_place(segments, raw_len: int, elem_size: int) -> bool:
    """Whether a delta (``segments``: its :func:`_container`, None for a legacy frame) is applied in place:
    every plane zero-sparse, with at most SPARSE_APPLY_MAX_DENSITY of the chunk's bytes nonzero."""
    if segments is None or any(seg[2] != SEG_SPARSE or len(seg[3]) < _SPARSE.size for seg in segments[:elem_size]):
        return False
    nnz = sum(_SPARSE.unpack_from(seg[3])[0] for seg in segments[:elem_size])
    return nnz <= SPARSE_APPLY_MAX_DENSITY * raw_len


def applies_in_place(stored, raw_len: int, elem_size: int) -> bool:
    """Whether a delta's stored bytes are applied to its base in place (:func:`decode_onto`), at the cost of
    their nonzero bytes instead of a pass over the chunk; False for damaged bytes."""
    if isinstance(stored, Coded):
        stored = bytes(stored)
    try:
        return apply_in_place(container_segments(stored, raw_len, elem_size), raw_len, elem_size)
    except (ValueError, struct.error):
        return False

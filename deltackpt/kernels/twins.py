"""twins: the Python twins of the native batch kernels, for the numpy backend or an extension built before them.

Each gives the same results and raises the same ``ValueError`` as its C counterpart (docstrings in
native/binding.c): many chunks unshuffled and hash-checked in one call, entry-header digests, the
sorted-id searches and sort of :mod:`deltackpt.store.idset`, and a byte plane's statistics.
"""

from __future__ import annotations

import numpy as np
import xxhash

from .arguments import as_u8, check_elem_size
from .impl import numpy_impl


def unshuffle_check(buf, frames, elem_size: int, src, outs, ids, ok) -> int:
    """The twin of the native ``unshuffle_check`` (its docstring in native/binding.c): the same checks, the
    same bytes, one chunk at a time."""
    k = check_elem_size(elem_size)
    b, n, frames = as_u8(buf, "buf"), len(outs), () if frames is None else frames
    src8, ids = as_u8(src, "src"), as_u8(ids, "ids")  # byte lengths, as the native kernel reads them
    okv = np.frombuffer(ok, dtype=np.uint8) if len(memoryview(ok)) else np.zeros(0, np.uint8)
    if okv.size != n or src8.nbytes != 8 * n * (k + 1) or ids.nbytes != 16 * n:
        raise ValueError(f"ok, src and ids must hold {n}, {n * (k + 1)} int64 and {16 * n} bytes")
    dests = [np.frombuffer(out, dtype=np.uint8) if len(memoryview(out)) else np.zeros(0, np.uint8) for out in outs]
    planes = []
    for j, (dest, starts) in enumerate(zip(dests, src8.view(np.int64).reshape(n, k + 1).tolist())):
        per = dest.size // k
        segs = []
        for s, at in enumerate(starts):
            want = per if s < k else dest.size - per * k
            if 0 <= at <= b.size - want:
                segs.append(b[at:at + want])
            elif at < 0 and -1 - at < len(frames) and memoryview(frames[-1 - at]).nbytes == want:
                segs.append(np.frombuffer(frames[-1 - at], dtype=np.uint8) if want else b[:0])
            else:
                raise ValueError(f"chunk {j}: segment {s} is out of bounds")
        planes.append(np.concatenate(segs))
    for j, (dest, joined) in enumerate(zip(dests, planes)):
        numpy_impl.unshuffle(joined, k, out=dest)
        okv[j] = xxhash.xxh3_128_digest(dest) == bytes(ids[16 * j:16 * j + 16])
    return int(okv.sum())


def xxh3_64_rows(rows, stride: int, nbytes: int, out) -> None:
    """The twin of the native ``xxh3_64_rows``: ``out[i]`` = xxh3-64 of row i's first ``nbytes``."""
    mv, dest = memoryview(rows).cast("B"), np.frombuffer(out, dtype=np.uint64)
    if not 0 <= nbytes <= stride or dest.size and (dest.size - 1) * stride + nbytes > len(mv):
        raise ValueError(f"rows has {len(mv)} bytes, {dest.size} rows of stride {stride} need more")
    dest[:] = [xxhash.xxh3_64_intdigest(mv[i * stride:i * stride + nbytes]) for i in range(dest.size)]



def plane_stats(src) -> tuple[int, int]:
    """The twin of the native ``plane_stats``: (nonzero bytes, ordered pairs of positions holding equal bytes)
    of ``src``."""
    s = as_u8(src, "src")
    counts = np.bincount(s, minlength=256).astype(np.uint64)
    return int(s.size - counts[0]), int(np.dot(counts, counts) - s.size)


def find_sorted(ids, keys, out) -> None:
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


def find_bucketed(ids, starts, bits, keys, out) -> None:
    """The twin of the native ``find_bucketed``: the same answers as :func:`find_sorted` for a bucket
    table ``starts`` of ``bits`` bits as idset.bucket_starts makes it (checked for its length only)."""
    if not 1 <= bits <= 32:
        raise ValueError("bits must be 1-32")
    if memoryview(starts).nbytes != ((1 << bits) + 1) * 4:
        raise ValueError("starts must be 2**bits + 1 uint32")
    find_sorted(ids, keys, out)


def sort_ids(ids, pay=None) -> None:
    """The twin of the native ``sort_ids``: the 16-byte ids of the writable buffer ``ids`` sorted in place;
    ``pay`` (a writable uint32 buffer, an entry per id) moved with them."""
    nbytes = memoryview(ids).nbytes
    if nbytes % 16:
        raise ValueError("ids must be 16-byte ids")
    if pay is not None and (memoryview(pay).nbytes != nbytes // 4
                            or nbytes and np.frombuffer(pay, dtype=np.uint8).ctypes.data % 4):
        raise ValueError("pay must hold a 4-byte aligned uint32 per id")
    if not nbytes:
        return
    view = np.frombuffer(ids, dtype="V16")
    if pay is None:
        view.sort()
        return
    order = np.argsort(view, kind="stable")
    view[:] = view[order]
    pays = np.frombuffer(pay, dtype=np.uint32)
    pays[:] = pays[order]



def hash_spans(bufs, spans, out, state) -> int:
    """The twin of the native ``hash_spans``: ``out[16 * i:16 * i + 16]`` = xxh3-128 of span i of ``bufs``
    ((buffer, start, end) int64 triples), progress in ``state[0]``, a cancel in ``state[1]``, done in
    ``state[2]``; the same checks (it holds the GIL between spans)."""
    st = _state(state)
    hashed = 0
    try:
        sp = as_u8(spans, "spans")
        if sp.nbytes % 24:
            raise ValueError(f"spans must hold int64 triples, got {sp.nbytes} bytes")
        triples = sp.view(np.int64).reshape(-1, 3).tolist() if sp.nbytes else []
        dest = memoryview(out).cast("B")
        if dest.readonly:
            raise ValueError("out must be a writable C-contiguous buffer")
        if len(dest) != 16 * len(triples):
            raise ValueError(f"out must hold {16 * len(triples)} bytes (16 per span), got {len(dest)}")
        views = [memoryview(b).cast("B") for b in (() if bufs is None else bufs)]
        o = np.frombuffer(dest, dtype=np.uint8) if len(dest) else None
        for k, v in enumerate(views):
            b = np.frombuffer(v, dtype=np.uint8) if len(v) else None
            if o is not None and b is not None and np.shares_memory(o, b):
                raise ValueError(f"out overlaps bufs[{k}]")
        for i, (b, s, e) in enumerate(triples):
            if not (0 <= b < len(views) and 0 <= s <= e <= len(views[b])):
                raise ValueError(f"span {i} is out of bounds")
        for i, (b, s, e) in enumerate(triples):
            if st[1]:
                break
            dest[16 * i:16 * i + 16] = xxhash.xxh3_128_digest(views[b][s:e])
            st[0] = hashed = i + 1
        return hashed
    finally:
        st[2] = 1


def wait_hashed(state, n: int, timeout_us: int) -> int:
    """The twin of the native ``wait_hashed``: ``state[0]`` once it reaches ``n`` or ``hash_spans`` returned,
    waiting at most about ``timeout_us``."""
    import operator
    import time

    st = _state(state)
    n, timeout_us = operator.index(n), operator.index(timeout_us)
    deadline = time.monotonic() + timeout_us / 1e6
    while st[0] < n and not st[2] and time.monotonic() < deadline:
        time.sleep(20e-6)
    return int(st[0])


def _state(state) -> np.ndarray:
    """``hash_spans``' state as the native kernels take it: 3 aligned, writable int64 values."""
    mv = memoryview(state)
    st = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes == 24 and mv.c_contiguous and not mv.readonly else None
    if st is None or st.ctypes.data % 8:
        raise ValueError("state must be 3 aligned int64 values")
    return st.view(np.int64)

"""Sets of chunk ids as sorted numpy arrays of 16-byte voids.

16 bytes an id and no Python object each, so a set of millions of ids stays within tens of MB; built and
queried in vectorised passes (a search per id costs O(log n) on ``V16``, but O(n) on a structured dtype).
The order is memcmp order, the order LMDB keeps its keys in, and trailing NUL bytes are kept (numpy's
``S16`` would strip them).
"""

from __future__ import annotations

import numpy as np

from .. import kernels

ID = np.dtype("V16")
_BLOCK = 1 << 14  # ids per vectorised pass where a pass's temporaries would otherwise grow with the input
_SORTED_SEARCH_ABOVE = 1 << 17  # ids (2 MiB) in a set past which a block is searched in sorted order
_BUCKET_IDS = 8  # ids per bucket of a set's bucket table (bucket_starts)
_ENDS_BLOCK = 1 << 10  # ids of a batch whose ends are folded into a Collector's at once
_HALVES = np.dtype(">u8")  # an id as two big-endian integers: their order is the ids' memcmp order


def from_ids(ids) -> np.ndarray:
    """An array (unsorted, as given) of ``ids``: 16-byte ids, or their bytes joined."""
    raw = ids if isinstance(ids, (bytes, bytearray)) else b"".join(ids)
    return np.frombuffer(bytes(raw), dtype=ID) if raw else np.empty(0, dtype=ID)


def unique(ids: np.ndarray) -> np.ndarray:
    """Sorted, without repeats (a copy, sorted by ``kernels.sort_ids``: 1.2M ids in 0.05 s, np.unique 0.3 s)."""
    if not ids.size:
        return np.empty(0, dtype=ID)
    out = np.array(ids, dtype=ID, order="C")  # a copy of its own, contiguous
    kernels.sort_ids(out)
    out.resize(_drop_repeats(out), refcheck=False)
    return out


def argsort(ids: np.ndarray) -> np.ndarray:
    """The stable order that sorts ``ids``: by their two big-endian halves (numpy's comparison of ``V16``
    items took 1.7x as long at 1.2M ids)."""
    halves = np.ascontiguousarray(ids).view(_HALVES).reshape(-1, 2)
    return np.lexsort((halves[:, 1], halves[:, 0]))


def is_sorted_unique(ids: np.ndarray) -> bool:
    """Whether ``ids`` are in strictly increasing (memcmp) order."""
    if ids.size < 2:
        return True
    halves = np.ascontiguousarray(ids).view(_HALVES).reshape(-1, 2)
    hi, lo = halves[:, 0], halves[:, 1]
    return bool(((hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] > lo[:-1]))).all())


def union(sorted_ids: np.ndarray, *more: np.ndarray) -> np.ndarray:
    """``sorted_ids`` (sorted unique) with the ids of ``more`` (any order) added, sorted unique: the new ones
    sorted and merged in (a few bases added to 1.2M ids: 5 ms, where sorting the whole again took 0.13 s)."""
    more = [m for m in more if m.size]
    if not more:
        return sorted_ids
    add = unique(np.concatenate(more))
    if not sorted_ids.size:
        return add
    add = add[~isin(sorted_ids, add)]
    if not add.size:
        return sorted_ids
    return np.insert(sorted_ids, np.searchsorted(sorted_ids, add), add)


def _search(sorted_ids: np.ndarray, query: np.ndarray, buckets: tuple[np.ndarray, int] | None = None):
    """(start, positions: -1 where absent) per block of ``query`` looked up in ``sorted_ids`` (sorted unique,
    not empty): passes holding ~40 bytes per id of a block, not of the query. With ``buckets`` (the set's
    :func:`bucket_starts`, made here for a query of over 16k ids and an eighth of the set's size) each id is looked
    up in its bucket, in any order. Else, in a set past the CPU's
    caches, a block is looked up in sorted order, each search galloping on from the last through nearby
    memory (``kernels.find_sorted``; 1.2M ids: ~0.25 us an id with the sort, ~0.85 us searching each from
    the middle of the set)."""
    sorted_ids = np.ascontiguousarray(sorted_ids)
    if buckets is None and query.size >= max(_BLOCK, sorted_ids.size // 8):
        # A large query: the table pays for itself (1.2M ids in a set of 1.2M: 0.22 -> 0.11 s; of 12k: 0.15 -> 0.03 s).
        buckets = bucket_starts(sorted_ids)
    by_order = buckets is None and sorted_ids.size >= _SORTED_SEARCH_ABOVE
    # In sorted order, a block of 1/16 of the set: consecutive searches land ~16 ids apart, in lines the last
    # one brought in or the prefetcher follows (2^14 ids: ~75 apart at 1.2M, a cache miss an id; 40 B a
    # block's id of temporaries: 2.5 B an id of the set).
    block = max(_BLOCK, sorted_ids.size // 16) if by_order else _BLOCK
    for start in range(0, query.size, block):
        q = np.ascontiguousarray(query[start:start + block])
        pos = np.empty(q.size, dtype=np.int64)
        if buckets is not None:
            kernels.find_bucketed(sorted_ids, buckets[0], buckets[1], q, pos)
            yield start, pos
            continue
        order = argsort(q) if by_order and q.size >= 64 else None
        kernels.find_sorted(sorted_ids, q if order is None else q[order], pos)
        if order is not None:  # back to the query's order
            back = np.empty_like(pos)
            back[order] = pos
            pos = back
        yield start, pos


def isin(sorted_ids: np.ndarray, query: np.ndarray, buckets: tuple[np.ndarray, int] | None = None) -> np.ndarray:
    """A bool per id of ``query``: whether it is in ``sorted_ids`` (sorted unique); ``buckets``: its
    :func:`bucket_starts`, for many small queries against one large set."""
    out = np.zeros(query.size, dtype=bool)
    for start, pos in _search(sorted_ids, query, buckets) if sorted_ids.size else ():
        out[start:start + pos.size] = pos >= 0
    return out


def bucket_starts(sorted_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """(starts, bits) of ``sorted_ids`` (sorted unique, not empty) cut by their first ``bits`` bits into
    buckets of ~8 ids: ``sorted_ids[starts[b]:starts[b + 1]]`` begin with b. The ids are hashes, so spread
    evenly: a look-up reads one bucket (a cache miss or two, keys in any order) where a search of a set past
    the CPU's caches misses at each step. 0.5 B an id."""
    bits = int(np.clip((sorted_ids.size // _BUCKET_IDS).bit_length(), 1, 32))
    heads = np.ascontiguousarray(sorted_ids).view(_HALVES).reshape(-1, 2)[:, 0]  # a view: no copy
    starts = np.empty((1 << bits) + 1, dtype=np.uint32)
    for lo in range(0, 1 << bits, _BLOCK):  # the bounds and searchsorted's output a block at a time
        b = np.arange(lo, min(lo + _BLOCK, 1 << bits), dtype=np.uint64)
        starts[lo:lo + b.size] = np.searchsorted(heads, b << np.uint64(64 - bits))
    starts[-1] = sorted_ids.size
    return starts, bits


def find(sorted_ids: np.ndarray, query: np.ndarray, buckets: tuple[np.ndarray, int] | None = None) -> np.ndarray:
    """The position in ``sorted_ids`` (sorted unique) of each id of ``query``, -1 where it is not there;
    ``buckets``: the set's :func:`bucket_starts`, for many small queries against one large set."""
    out = np.full(query.size, -1, dtype=np.int64)
    for start, pos in _search(sorted_ids, query, buckets) if sorted_ids.size else ():
        out[start:start + pos.size] = pos
    return out


def contains(sorted_ids: np.ndarray, cid: bytes) -> bool:
    """Whether the one id ``cid`` is in ``sorted_ids`` (for many ids at once use :func:`isin`)."""
    return bool(isin(sorted_ids, from_ids(cid))[0])


class Collector:
    """Gathers ids into a sorted unique set: memory ~16 bytes per unique id and a batch, however often an id
    repeats (each checkpoint of a history). An added batch is first cut to the ids not in the set yet; they
    are merged in whenever they pass a quarter of it, into the room the set's buffer has past its end (grown
    in place, realloc, when that is used up) and sorted in place, so a merge never holds the set twice.
    Time O(total log unique).

    ``with_ends``: each id comes with an end (uint32: the chunk bytes a reference to it needs), and the set
    keeps, aligned with its ids, the largest end given for each (4 bytes more an id; an end given for an id
    already in the set is folded in where it is)."""

    def __init__(self, with_ends: bool = False) -> None:
        # The set is the first _n ids of _buf, which owns its memory; the rest is room (never touched, no
        # memory, until merged into). No view of _buf is handed out while the collector has it.
        self._buf, self._n = np.empty(0, dtype=ID), 0
        self._ends = np.empty(0, dtype=np.uint32) if with_ends else None  # beside _buf, as it is
        self._waiting: list[np.ndarray] = []
        self._waiting_ends: list[np.ndarray] = []
        self._num_waiting = 0
        self._room: np.ndarray | None = None  # a buffer handed over with take(), to hold the set as it grows
        self._room_ends: np.ndarray | None = None
        self._buckets: tuple[np.ndarray, int] | None = None  # the set's bucket table, once it is large

    @property
    def with_ends(self) -> bool:
        return self._ends is not None

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """find against the set (-1: not in it): a large one through its bucket table (made once per merge:
        batches of a few thousand ids searched in sorted order each missed the cache at every step, ~0.7 us
        an id at 1.2M)."""
        if self._n < _SORTED_SEARCH_ABOVE:
            return find(self._set, ids)
        if self._buckets is None:
            self._buckets = bucket_starts(self._set)
        return find(self._set, ids, self._buckets)

    def _isin(self, ids: np.ndarray) -> np.ndarray:
        return self._find(ids) >= 0

    @property
    def _set(self) -> np.ndarray:
        return self._buf[:self._n]

    def _cut(self, ids: np.ndarray, ends: np.ndarray | None):
        """(ids, ends) of those of ``ids`` not in the set: ``ids`` itself when that is all of them, else a copy;
        the ends of the others folded into the set's."""
        if not self._n:
            return ids, ends
        if ends is None:
            keep = ~self._isin(ids)
        else:
            keep = np.empty(ids.size, dtype=bool)
            for lo in range(0, ids.size, _ENDS_BLOCK):  # a block at a time: its positions are 8 bytes an id
                pos = self._find(ids[lo:lo + _ENDS_BLOCK])
                new = keep[lo:lo + pos.size] = pos < 0
                if not new.all():
                    np.maximum.at(self._ends, pos[~new], ends[lo:lo + pos.size][~new])
        if keep.all():
            return ids, ends
        return ids[keep], (None if ends is None else ends[keep])

    def _check_ends(self, ends) -> None:
        if (ends is None) != (self._ends is None):
            raise ValueError("ends are given exactly when the collector was made with_ends")

    def add(self, ids: np.ndarray, ends: np.ndarray | None = None) -> None:
        """Add ``ids`` (and their ``ends``, uint32, when made with_ends); the collector may keep the arrays and
        reorder them."""
        self._check_ends(ends)
        ids, ends = self._cut(ids, ends)
        if ids.size:
            self._waiting.append(ids)
            if ends is not None:
                self._waiting_ends.append(ends)
            self._num_waiting += ids.size
        if self._num_waiting > (max(self._n // 4, 1 << 14) if self._n else 0):
            self._merge()  # at once when the set is empty: the batches after the first are cut against it

    def take(self, buf: np.ndarray, n: int, ends: np.ndarray | None = None) -> None:
        """Add ``buf[:n]`` (``buf``: an array of ids of its own, not a view; ``ends``: theirs, as large as
        ``buf``, when made with_ends), handing ``buf`` over: the first becomes the set's buffer, which later ids
        grow into; any later one is shrunk to its ids."""
        self._check_ends(ends)
        if self._n or self._waiting:
            buf.resize(n, refcheck=False)  # in place: its room would only be held while it waits
            if ends is not None:
                ends.resize(n, refcheck=False)
            self.add(buf, ends)
        else:
            self._room, self._room_ends = buf, ends
            self.add(buf[:n], None if ends is None else ends[:n])

    def fresh(self, ids: np.ndarray, ends: np.ndarray | None = None):
        """The ones of ``ids`` not in the set yet (ids waiting to be merged are not looked at): ``ids`` itself
        when that is all of them, else a copy. With ``ends`` (a collector made with_ends): (those ids, their
        ends), the ends of the others folded into the set's."""
        self._check_ends(ends)
        ids, ends = self._cut(ids, ends)
        return ids if ends is None else (ids, ends)

    def _merge(self) -> None:
        waiting, self._waiting, self._num_waiting = self._waiting, [], 0
        waiting_ends, self._waiting_ends = self._waiting_ends, []
        self._buckets = None  # the set changes
        room, self._room = self._room, None
        room_ends, self._room_ends = self._room_ends, None
        if not waiting:
            return
        tracked = self._ends is not None
        first, size = waiting[0], self._n
        need = size + sum(w.size for w in waiting)
        first_ends = room_ends if room_ends is not None else (waiting_ends[0] if tracked else None)
        own = room is not None or (first.base is None and first.flags.writeable)
        own_ends = not tracked or (first_ends.base is None and first_ends.flags.writeable and first_ends.size >= need)
        if not size and len(waiting) == 1 and own and own_ends:
            buf = room if room is not None else first  # the first batch becomes the set where it is: no copy
            ends = first_ends
            waiting = []
        else:
            buf, self._buf, self._n = self._buf, np.empty(0, dtype=ID), 0
            ends, self._ends = self._ends, (np.empty(0, dtype=np.uint32) if tracked else None)
            if need > buf.size:
                buf.resize(need, refcheck=False)  # ours alone; only as far as is written now (it zero-fills)
            if tracked and need > ends.size:
                ends.resize(need, refcheck=False)
            for k, w in enumerate(waiting):
                buf[size:size + w.size] = w
                if tracked:
                    ends[size:size + w.size] = waiting_ends[k]
                size += w.size
        del waiting, waiting_ends, first, first_ends, room, room_ends
        view = buf[:need]
        if tracked:
            ends_view = ends[:need]
            kernels.sort_ids(view, ends_view)  # in place (a radix sort), each end moved with its id
            self._buf, self._ends, self._n = buf, ends, _drop_repeats(view, ends_view)
        else:
            kernels.sort_ids(view)  # in place (a radix sort), unlike np.unique
            self._buf, self._n = buf, _drop_repeats(view)

    def result(self) -> np.ndarray:
        """The set (sorted unique, an array of its own); the collector is empty after."""
        return self.result_with_ends()[0]

    def result_with_ends(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(the set, as :meth:`result`; beside each id the largest end given for it, uint32, when made
        with_ends, else None); the collector is empty after."""
        self._merge()
        out, ends, n = self._buf, self._ends, self._n
        self._buf, self._n = np.empty(0, dtype=ID), 0
        out.resize(n, refcheck=False)  # the room given back (shrunk in place)
        if ends is not None:
            self._ends = np.empty(0, dtype=np.uint32)
            ends.resize(n, refcheck=False)
        return out, ends


def _drop_repeats(ids: np.ndarray, ends: np.ndarray | None = None) -> int:
    """Compact ``ids`` (sorted) in place, block by block, to its first occurrences; returns how many. ``ends``
    (one per id) compacted with them, each first occurrence's the largest of its repeats'."""
    if ids.size < 2:
        return ids.size
    keep = ids[1:] != ids[:-1]
    if keep.all():
        return ids.size
    if ends is not None:
        head = 0  # the first occurrence of the id just before the block
        for start in range(0, keep.size, _BLOCK):
            k = keep[start:start + _BLOCK]  # of ids[1 + start:1 + start + _BLOCK]
            at = np.arange(1 + start, 1 + start + k.size)
            heads = np.maximum(np.maximum.accumulate(np.where(k, at, 0)), head)
            if not k.all():
                np.maximum.at(ends, heads[~k], ends[at[~k]])
            head = int(heads[-1])
    at = 1
    for start in range(0, keep.size, _BLOCK):
        k = keep[start:start + _BLOCK]
        kept = ids[1 + start:1 + start + _BLOCK][k]  # read before anything past it is written
        ids[at:at + kept.size] = kept
        if ends is not None:
            ends[at:at + kept.size] = ends[1 + start:1 + start + _BLOCK][k]
        at += kept.size
    return at

"""Sets of chunk ids as sorted numpy arrays of 16-byte voids.

16 bytes an id and no Python object each, so a set of millions of ids stays within tens of MB; built and
queried in vectorised passes (a search per id costs O(log n) on ``V16``, but O(n) on a structured dtype).
The order is memcmp order, the order LMDB keeps its keys in, and trailing NUL bytes are kept (numpy's
``S16`` would strip them).
"""

from __future__ import annotations

import numpy as np

ID = np.dtype("V16")
_BLOCK = 1 << 14  # ids per vectorised pass where a pass's temporaries would otherwise grow with the input


def from_ids(ids) -> np.ndarray:
    """An array (unsorted, as given) of ``ids``: 16-byte ids, or their bytes joined."""
    raw = ids if isinstance(ids, (bytes, bytearray)) else b"".join(ids)
    return np.frombuffer(bytes(raw), dtype=ID) if raw else np.empty(0, dtype=ID)


def unique(ids: np.ndarray) -> np.ndarray:
    """Sorted, without repeats."""
    return np.unique(ids) if ids.size else np.empty(0, dtype=ID)


def union(sorted_ids: np.ndarray, *more: np.ndarray) -> np.ndarray:
    """``sorted_ids`` (sorted unique) with the ids of ``more`` (any order) added, sorted unique."""
    more = [m for m in more if m.size]
    return unique(np.concatenate([sorted_ids, *more])) if more else sorted_ids


def isin(sorted_ids: np.ndarray, query: np.ndarray) -> np.ndarray:
    """A bool per id of ``query``: whether it is in ``sorted_ids`` (sorted unique), in vectorised passes over
    blocks of ``query`` (a pass holds ~33 bytes per id it looks up: a block's worth, not the query's)."""
    out = np.zeros(query.size, dtype=bool)
    if not sorted_ids.size:
        return out
    last = sorted_ids.size - 1
    for start in range(0, query.size, _BLOCK):
        q = query[start:start + _BLOCK]
        pos = np.searchsorted(sorted_ids, q)
        np.minimum(pos, last, out=pos)
        out[start:start + q.size] = sorted_ids[pos] == q
    return out


def contains(sorted_ids: np.ndarray, cid: bytes) -> bool:
    """Whether the one id ``cid`` is in ``sorted_ids`` (for many ids at once use :func:`isin`)."""
    return bool(isin(sorted_ids, from_ids(cid))[0])


class Collector:
    """Gathers ids into a sorted unique set: memory ~16 bytes per unique id and a batch, however often an id
    repeats (each checkpoint of a history). An added batch is first cut to the ids not in the set yet; they
    are merged in whenever they pass a quarter of it, by growing the set in place (realloc) and sorting it
    in place, so a merge never holds the set twice. Time O(total log unique)."""

    def __init__(self) -> None:
        self._set = np.empty(0, dtype=ID)  # owns its memory: grown in place, no view of it is ever handed out
        self._waiting: list[np.ndarray] = []
        self._num_waiting = 0

    def add(self, ids: np.ndarray) -> None:
        """Add ``ids``; the collector may keep the array and reorder it."""
        if self._set.size:
            keep = ~isin(self._set, ids)
            ids = ids if keep.all() else ids[keep]
        if ids.size:
            self._waiting.append(ids)
            self._num_waiting += ids.size
        if self._num_waiting > (max(self._set.size // 4, 1 << 14) if self._set.size else 0):
            self._merge()  # at once when the set is empty: the batches after the first are cut against it

    def fresh(self, ids: np.ndarray) -> np.ndarray:
        """The ones of ``ids`` not in the set yet (ids waiting to be merged are not looked at): ``ids`` itself
        when that is all of them, else a copy."""
        if not self._set.size:
            return ids
        keep = ~isin(self._set, ids)
        return ids if keep.all() else ids[keep]

    def _merge(self) -> None:
        waiting, self._waiting, self._num_waiting = self._waiting, [], 0
        if not waiting:
            return
        first = waiting[0]
        if not self._set.size and len(waiting) == 1 and first.base is None and first.flags.writeable:
            grown = first  # the first batch becomes the set as it is: no copy of it
        else:
            size = self._set.size
            grown, self._set = self._set, np.empty(0, dtype=ID)
            grown.resize(size + sum(w.size for w in waiting), refcheck=False)  # ours alone
            for w in waiting:
                grown[size:size + w.size] = w
                size += w.size
        del waiting, first
        grown.sort()  # in place (quicksort), unlike np.unique
        self._set = _drop_repeats(grown)

    def result(self) -> np.ndarray:
        """The set (sorted unique); the collector is empty after."""
        self._merge()
        out, self._set = self._set, np.empty(0, dtype=ID)
        return out


def _drop_repeats(ids: np.ndarray) -> np.ndarray:
    """``ids`` (sorted, owning its memory) without repeats, compacted in place block by block and shrunk."""
    if ids.size < 2:
        return ids
    keep = ids[1:] != ids[:-1]
    if keep.all():
        return ids
    at = 1
    for start in range(0, keep.size, _BLOCK):
        kept = ids[1 + start:1 + start + _BLOCK][keep[start:start + _BLOCK]]  # read before anything past it is written
        ids[at:at + kept.size] = kept
        at += kept.size
    del keep, kept
    ids.resize(at, refcheck=False)
    return ids

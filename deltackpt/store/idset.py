"""Sets of chunk ids as sorted numpy arrays of 16-byte voids.

16 bytes an id and no Python object each, so a set of millions of ids stays within tens of MB; built and
queried in vectorised passes (a search per id costs O(log n) on ``V16``, but O(n) on a structured dtype).
The order is memcmp order, the order LMDB keeps its keys in, and trailing NUL bytes are kept (numpy's
``S16`` would strip them).
"""

from __future__ import annotations

import numpy as np

ID = np.dtype("V16")


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
    """A bool per id of ``query``: whether it is in ``sorted_ids`` (sorted unique), in one pass."""
    if not sorted_ids.size or not query.size:
        return np.zeros(query.size, dtype=bool)
    pos = np.searchsorted(sorted_ids, query)
    return sorted_ids[np.minimum(pos, sorted_ids.size - 1)] == query


def contains(sorted_ids: np.ndarray, cid: bytes) -> bool:
    """Whether the one id ``cid`` is in ``sorted_ids`` (for many ids at once use :func:`isin`)."""
    return bool(isin(sorted_ids, from_ids(cid))[0])


class Collector:
    """Gathers ids into a sorted unique set, merging whenever the ids waiting pass a quarter of it: memory
    O(unique ids + one batch) however often an id repeats (each checkpoint of a history), time
    O(total log total)."""

    def __init__(self) -> None:
        self._set = np.empty(0, dtype=ID)
        self._waiting: list[np.ndarray] = []
        self._num_waiting = 0

    def add(self, ids: np.ndarray) -> None:
        self._waiting.append(ids)
        self._num_waiting += ids.size
        if self._num_waiting > max(self._set.size // 4, 1 << 14):
            self._merge()

    def _merge(self) -> None:
        # The new ids are inserted at their places, not the whole set sorted again: a merge holds the set
        # twice at most (a sort of set + new ids would hold it four times).
        new = unique(np.concatenate(self._waiting)) if self._waiting else self._set[:0]
        self._waiting, self._num_waiting = [], 0
        new = new[~isin(self._set, new)]
        if new.size:
            self._set = np.insert(self._set, np.searchsorted(self._set, new), new)

    def result(self) -> np.ndarray:
        self._merge()
        return self._set

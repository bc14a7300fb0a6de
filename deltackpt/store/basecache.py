"""Keyframe bytes a Store keeps in memory, so its next save's deltas need no store reads.

Each :class:`~deltackpt.store.Store` object owns one ``BaseCache`` (``store.base_cache``). When a writer
stores a keyframe it keeps a copy of the raw bytes there; the next save through the same Store object finds
its delta base in memory. A base that is not cached (a new Store object, a restart, or evicted) is read back
from the store and verified: the cache changes speed, never bytes.

The cap is ``DELTACKPT_BASE_CACHE_BYTES`` when set (0 turns the cache off; the variable then fixes it).
Otherwise it costs nothing until it can pay: it starts at 0 and rises to ``AUTO_CAP_BYTES`` (256 MiB) when
the Store object is used a second time (a second save: a training loop; a save after a restore: a resumed
one); a one-off save keeps no copies. A DCP save on more than one rank (a training job) and
``CheckpointManager`` raise it from the first save with :meth:`BaseCache.reserve`. Keep one Store object (or
one CheckpointManager) for a run's saves: a Store opened anew for each save starts with an empty cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .. import settings

MiB = 1 << 20
AUTO_CAP_BYTES = 256 * MiB


class BaseCache:
    """Chunk id -> raw bytes, at most ``cap_bytes`` in total.

    Saves visit a model's chunks in the same order every time, which is LRU's worst case: a cache smaller
    than the working set would evict each base just before it is needed. So entries are tagged with the
    generation (save) that last used them; a new entry may evict only entries no newer save has used, and
    is dropped when there is no such room. A model larger than the cap thus keeps a stable part cached.
    """

    def __init__(self, cap_bytes: int, *, fixed: bool = False) -> None:
        self.cap_bytes = cap_bytes
        self.fixed = fixed  # set by the environment or limit(): reserve() and note_use() leave the cap alone
        self._data: OrderedDict[bytes, list] = OrderedDict()  # chunk id -> [bytes, generation]
        self._size = 0
        self._generation = 0
        self._uses = 0
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls) -> "BaseCache":
        """The cache a new Store starts with: ``DELTACKPT_BASE_CACHE_BYTES`` when set, else 0 until used."""
        cap = settings.base_cache_bytes()
        return cls(0, fixed=False) if cap is None else cls(cap, fixed=True)

    def reserve(self, cap_bytes: int) -> None:
        """Raise the cap to at least ``cap_bytes`` (unless the environment fixed it)."""
        if not self.fixed:
            with self._lock:
                self.cap_bytes = max(self.cap_bytes, int(cap_bytes))

    def limit(self, cap_bytes: int) -> None:
        """Set the cap to exactly ``cap_bytes`` (0: off) from now on (unless the environment fixed it)."""
        if not self.fixed:
            with self._lock:
                self.cap_bytes = int(cap_bytes)
                self.fixed = True

    def note_use(self) -> None:
        """Count a save or a restore through the owning Store; the second raises the cap to ``AUTO_CAP_BYTES``:
        a training loop saves again and again, a resumed one restores first."""
        with self._lock:
            self._uses += 1
            second = self._uses == 2
        if second:
            self.reserve(AUTO_CAP_BYTES)

    @property
    def size_bytes(self) -> int:
        return self._size

    def new_generation(self) -> int:
        """Start a save; entries it touches outrank those of earlier saves."""
        with self._lock:
            self._generation += 1
            return self._generation

    def get(self, chunk_id: bytes):
        key = chunk_id
        with self._lock:
            slot = self._data.get(key)
            if slot is None:
                return None
            slot[1] = self._generation
            self._data.move_to_end(key)
            return slot[0]

    def put(self, chunk_id: bytes, raw) -> None:
        n = len(raw)
        if n > self.cap_bytes:
            return
        key = chunk_id
        with self._lock:
            if key in self._data:
                self._data[key][1] = self._generation
                self._data.move_to_end(key)
                return
            if not self._make_room(n):
                return
        # numpy copies without holding the GIL (bytes() would stall the other coding threads).
        value = np.frombuffer(raw, dtype=np.uint8).copy()
        value.flags.writeable = False
        with self._lock:
            if key not in self._data and self._make_room(n):
                self._data[key] = [value, self._generation]
                self._size += n

    def _make_room(self, n: int) -> bool:
        """Evict entries older than the current generation (least recent first) until ``n`` more bytes fit
        under the cap.

        Entries are kept in order of last use, so generations only grow along it: eviction stops at the
        first entry of the current generation."""
        if self._size + n <= self.cap_bytes:
            return True
        victims, freed = [], 0
        for key, (value, gen) in self._data.items():
            if self._size - freed + n <= self.cap_bytes or gen >= self._generation:
                break
            victims.append(key)
            freed += len(value)
        for key in victims:
            del self._data[key]
        self._size -= freed
        return self._size + n <= self.cap_bytes

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._size = 0

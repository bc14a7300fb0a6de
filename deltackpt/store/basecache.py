"""A process-wide LRU of keyframe bytes, bounded per store, so the next save's deltas need no store reads.

When a writer stores a keyframe it keeps a copy of the raw bytes here; the next save of the same tensor
region finds its delta base in memory. A base that is not cached (first save after a restart, or evicted)
is read back from the store and verified.

The cap is ``DELTACKPT_BASE_CACHE_BYTES`` when set (0 turns the cache off). Otherwise the cache costs
nothing until it can pay: it starts at 0 and is raised to ``AUTO_CAP_BYTES`` (256 MiB) when a process uses
the same store a second time: a second save (a training loop) or a save after a restore (a resumed one); a
one-off save keeps no copies. From then on the keyframes it writes and the bases it reads back are kept for
the next save. A DCP save on more than one rank (a training job) and ``CheckpointManager`` raise it from the
first save, with :func:`reserve_base_cache`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .. import settings

MiB = 1 << 20
_DEFAULT_CAP = 0
AUTO_CAP_BYTES = 256 * MiB


def _cap_from_env() -> int:
    cap = settings.base_cache_bytes()
    return _DEFAULT_CAP if cap is None else cap


class BaseCache:
    """Chunk id -> raw bytes, at most ``cap_bytes`` in total.

    Saves visit a model's chunks in the same order every time, which is LRU's worst case: a cache smaller
    than the working set would evict each base just before it is needed. So entries are tagged with the
    generation (save) that last used them; a new entry may evict only entries no newer save has used, and
    is dropped when there is no such room. A model larger than the cap thus keeps a stable part cached.
    """

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes  # per store
        self._data: OrderedDict[tuple[str, bytes], list] = OrderedDict()  # key -> [bytes, generation]
        self._size = 0
        self._sizes: dict[str, int] = {}  # store id -> bytes held for it
        self._generation = 0
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        return self._size

    def new_generation(self) -> int:
        """Start a save; entries it touches outrank those of earlier saves."""
        with self._lock:
            self._generation += 1
            return self._generation

    def get(self, store_id: str, chunk_id: bytes):
        key = (store_id, chunk_id)
        with self._lock:
            slot = self._data.get(key)
            if slot is None:
                return None
            slot[1] = self._generation
            self._data.move_to_end(key)
            return slot[0]

    def put(self, store_id: str, chunk_id: bytes, raw) -> None:
        n = len(raw)
        if n > self.cap_bytes:
            return
        key = (store_id, chunk_id)
        with self._lock:
            if key in self._data:
                self._data[key][1] = self._generation
                self._data.move_to_end(key)
                return
            if not self._make_room(store_id, n):
                return
        # numpy copies without holding the GIL (bytes() would stall the other coding threads).
        value = np.frombuffer(raw, dtype=np.uint8).copy()
        value.flags.writeable = False
        with self._lock:
            if key not in self._data and self._make_room(store_id, n):
                self._data[key] = [value, self._generation]
                self._size += n
                self._sizes[store_id] = self._sizes.get(store_id, 0) + n

    def _make_room(self, store_id: str, n: int) -> bool:
        """Evict ``store_id``'s entries older than the current generation (least recent first) until its
        ``n`` more bytes fit under the cap.

        Entries are kept in order of last use, so generations only grow along it: eviction stops at the
        first entry of the current generation."""
        held = self._sizes.get(store_id, 0)
        if held + n <= self.cap_bytes:
            return True
        victims, freed = [], 0
        for key, (value, gen) in self._data.items():
            if key[0] != store_id:
                continue
            if held - freed + n <= self.cap_bytes or gen >= self._generation:
                break
            victims.append(key)
            freed += len(value)
        for key in victims:
            del self._data[key]
        self._size -= freed
        self._sizes[store_id] = held - freed
        return held - freed + n <= self.cap_bytes

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._size = 0
            self._sizes.clear()


_shared: BaseCache | None = None
_shared_lock = threading.Lock()


def reserve_base_cache(cap_bytes: int) -> None:
    """Raise the shared cache's cap to at least ``cap_bytes`` (unless the environment set it explicitly)."""
    if settings.base_cache_bytes() is None:
        cache = shared_base_cache()
        cache.cap_bytes = max(cache.cap_bytes, int(cap_bytes))


_uses: dict[str, int] = {}


def note_use(store_id: str) -> None:
    """Count a save to, or a restore from, ``store_id`` in this process; the second one raises the shared
    cache to ``AUTO_CAP_BYTES`` (unless the environment set the cap). A training loop saves again and again,
    and a resumed one restores first: either way its saves from the second use on keep their keyframes."""
    with _shared_lock:
        _uses[store_id] = n = _uses.get(store_id, 0) + 1
    if n == 2:
        reserve_base_cache(AUTO_CAP_BYTES)


def shared_base_cache() -> BaseCache:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BaseCache(_cap_from_env())
        return _shared

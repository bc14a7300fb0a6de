"""Chunk ids hashed by a thread ahead of the writer that needs them.

Hashing every chunk is about a tenth of a save's CPU (xxh3-128 at ~10 GB/s: 8 ms for a fine-tune's 83 MiB
state, whose other 40 ms are the writer's Python: placing, looking up and coding chunks). The native
``hash_spans`` hashes all the spans of a save in one call without the GIL, on another core, and publishes its
progress span by span; :meth:`HashAhead.ids` waits (without the GIL) only when the thread is behind. With the
numpy backend there is no such thread: the writer hashes as it goes.
"""

from __future__ import annotations

import threading

import numpy as np

from .. import kernels
from ..kernels import twins

# Arrays of fewer bytes than this are hashed by the writer itself: a thread's start and hand-offs cost more
# than hashing them takes (about 0.1 ms per MiB).
MIN_AHEAD_BYTES = 4 << 20
AVAILABLE = kernels.hash_spans is not twins.hash_spans  # the native kernel: the twin holds the GIL


class HashAhead:
    """The ids of the spans of ``arrays`` (a list of (byte view, [(start, end), ...])), hashed in order by a
    thread started here. ``ids(k, i, j)``: those of spans [i, j) of array k. ``close()`` stops the thread
    (at the next span) and waits for it; call it before the views may change."""

    def __init__(self, arrays: list[tuple[memoryview, list[tuple[int, int]]]]) -> None:
        counts = [len(spans) for _view, spans in arrays]
        self._first = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).tolist()
        triples = np.empty((self._first[-1], 3), dtype=np.int64)
        for k, (_view, spans) in enumerate(arrays):
            a, b = self._first[k], self._first[k + 1]
            triples[a:b, 0] = k
            triples[a:b, 1:] = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        self._out = np.empty(16 * len(triples), dtype=np.uint8)
        self._state = np.zeros(3, dtype=np.int64)  # spans hashed, cancel, returned
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=([v for v, _s in arrays], triples),
                                        name="deltackpt-hash", daemon=True)
        self._thread.start()

    def _run(self, bufs, triples) -> None:
        try:
            kernels.hash_spans(bufs, triples, self._out, self._state)
        except BaseException as e:  # noqa: BLE001 - raised in the writer's thread by ids()
            self._error = e

    def ids(self, k: int, i: int, j: int) -> list[bytes]:
        """The ids of spans [i, j) of array ``k``, once hashed."""
        a, b = self._first[k] + i, self._first[k] + j
        while kernels.wait_hashed(self._state, b, 50_000) < b:
            if self._state[2]:
                self._thread.join()
                if self._error is not None:
                    raise self._error
                raise RuntimeError("the hashing thread stopped before it hashed every span")
        raw = self._out[16 * a:16 * b].tobytes()
        return [raw[x:x + 16] for x in range(0, len(raw), 16)]

    def close(self) -> None:
        self._state[1] = 1
        self._thread.join()

"""Where a writer's coded chunks go: pack assembly apart from what to save (restic's ``packer_manager.go``).

A :class:`PackSink` owns the pack being filled, seals it at ``pack_target_bytes`` and publishes it: inline
on a local store, on an upload pool (``UPLOADS_IN_FLIGHT`` at once) for a store with no local path. It
keeps the entries and packs written (for the commit) and the first upload error (raised by :meth:`finish`).
Any number of coding threads may call :meth:`add` at once.

A failed save removes its spool files but never a pack it published: once listed, another writer may have
deduplicated against it, or published the same bytes under the same name (a pack is named by its hash) and be
about to commit; neither can be told apart from here. The writer indexes them (a retry reuses their chunks);
``gc`` removes what no checkpoint references, under its exclusive lock and grace period.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from .backend import local_root, spool_for
from .pack import PackBuilder, PackEntry, pack_key

# Sealed packs of a store with no local path (object storage) upload in this many threads while coding goes
# on; a coding thread that seals one more waits, so at most this many sealed packs are held in memory.
UPLOADS_IN_FLIGHT = 4


class PackSink:
    """Coded chunks in, published packs out. Use once: ``add`` any number of times, then ``finish`` and
    ``close``, or ``abort``."""

    def __init__(self, store, on_error: Callable[[BaseException], None] | None = None) -> None:
        """``on_error``: told of an upload's error as soon as it happens (the writer stops coding)."""
        self.store = store
        self.target_bytes = store.config.pack_target_bytes
        self._on_error = on_error
        self._lock = threading.Lock()
        self._open_builders: set[PackBuilder] = set()  # with a spool file to remove if the save fails
        self.entries: list[PackEntry] = []
        self.packs: dict[str, int] = {}  # pack name -> size in bytes
        self._builder: PackBuilder | None = self._new_builder()
        # Uploads to a remote store must not stall the coding thread that sealed the pack (a 32 MiB PUT).
        self._uploads: ThreadPoolExecutor | None = None
        self._upload_slots = threading.Semaphore(UPLOADS_IN_FLIGHT)
        self._upload_error: BaseException | None = None  # the first upload's error, raised by finish()
        if local_root(store.backend) is None:
            self._uploads = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="deltackpt-upload")

    def add(self, cid: bytes, cod: int, elem_size: int, raw_len: int, stored, base_id: bytes | None,
            age: int) -> None:
        """Append one coded chunk to the current pack; seal and publish it once it reaches the target size."""
        sealed = None
        with self._lock:
            self._builder.add(cid, cod, elem_size, raw_len, stored, base_id, age)
            if self._builder.size_bytes >= self.target_bytes:
                sealed, self._builder = self._builder, self._new_builder()
        if sealed is not None:
            self._put_pack(sealed)

    def finish(self) -> None:
        """Seal the last pack, wait for every upload, and raise the first error one of them met."""
        with self._lock:
            builder, self._builder = self._builder, None
        if len(builder):
            self._put_pack(builder)
        else:
            builder.discard()
        if self._uploads is None:
            return
        self._uploads.shutdown(wait=True)
        if self._upload_error is not None:
            raise self._upload_error

    def close(self) -> None:
        """Drop queued uploads, wait for running ones (no pack is put after the writer stopped) and remove
        the spool files of packs never published."""
        if self._uploads is not None:
            self._uploads.shutdown(wait=True, cancel_futures=True)
        # No upload runs now: drop the writer's callback, a cycle (writer -> sink -> writer) that left the
        # writer and its parent's items to the cyclic collector (100k items: a 0.41 s collection per save).
        self._on_error = None
        with self._lock:
            builders, self._open_builders, self._builder = self._open_builders, set(), None
        for builder in builders:
            builder.discard()

    def abort(self) -> None:
        """:meth:`close`: the packs already published stay (see the module docstring)."""
        self.close()

    # -- internals ---------------------------------------------------------------------------------------
    def _new_builder(self) -> PackBuilder:
        builder = PackBuilder(spool_for(self.store.backend))
        self._open_builders.add(builder)  # (callers hold self._lock, or no job is running yet)
        return builder

    def _put_pack(self, builder: PackBuilder) -> None:
        if self._uploads is None:
            self._publish(builder)
            return
        self._upload_slots.acquire()  # released when the upload ends (or is cancelled)
        try:
            fut = self._uploads.submit(self._publish, builder)
        except BaseException:
            self._upload_slots.release()
            raise
        fut.add_done_callback(self._upload_done)

    def _publish(self, builder: PackBuilder) -> None:
        name, size, entries = builder.publish(self.store.backend)
        with self._lock:
            self._open_builders.discard(builder)
            self.entries.extend(entries)
            self.packs[name] = size

    def _upload_done(self, fut: Future) -> None:
        self._upload_slots.release()
        error = None if fut.cancelled() else fut.exception()
        if error is not None:
            with self._lock:
                self._upload_error = self._upload_error or error
            if self._on_error is not None:
                self._on_error(error)  # stop coding what could not be committed anyway

"""The write path of one process: chunk -> hash -> dedup -> encode -> pack.

A :class:`ChunkWriter` takes the items of one save (arrays and byte strings) and writes every chunk the
store does not have yet into packs of its own. Hashing and encoding run in a thread pool over chunks
(xxhash, zstd and the native kernels release the GIL); a cap on in-flight bytes keeps memory bounded for
any checkpoint size. Nothing becomes visible until :meth:`Store.commit` writes the manifest; a writer that
fails or is abandoned leaves only unreferenced packs, which ``gc`` removes.

Several processes (DCP ranks) each run their own writer; their packs never collide because a pack is named
by the hash of its bytes.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from . import codec
from .chunking import cdc_spans, grid_spans
from .manifest import ChunkRef, Item
from .pack import PackBuilder, PackEntry, pack_key

MiB = 1 << 20


def as_byte_view(data) -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, numpy array, memoryview)."""
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("item data must be C-contiguous; call numpy.ascontiguousarray first")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B") if mv.nbytes else memoryview(b"")
    return mv


def chunk_id_of(view) -> bytes:
    return xxhash.xxh3_128_digest(view)


@dataclass
class WriteSummary:
    """What one writer added to the store."""

    items: list[Item]
    entries: list[PackEntry] = field(default_factory=list)
    packs: dict[str, int] = field(default_factory=dict)  # pack name -> size in bytes

    @property
    def stored_bytes(self) -> int:
        return sum(self.packs.values())

    @property
    def logical_bytes(self) -> int:
        return sum(it.nbytes for it in self.items)

    @property
    def num_chunks(self) -> int:
        return sum(len(it.chunks) for it in self.items)


class ChunkWriter:
    """Writes items' chunks into packs. Use once: ``add_*`` any number of times, then ``finish``."""

    def __init__(self, store, *, num_threads: int | None = None, max_inflight_bytes: int | None = None):
        self.store = store
        self.config = store.config
        self.num_threads = num_threads or max(1, min(8, os.cpu_count() or 1))
        self.max_inflight_bytes = max_inflight_bytes or max(64 * MiB, 4 * self.num_threads * self.config.chunk_size_bytes)
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="deltackpt-write")
        self._lock = threading.Lock()
        self._claimed: set[bytes] = set()
        self._builder = PackBuilder()
        self._entries: list[PackEntry] = []
        self._packs: dict[str, int] = {}
        self._inflight = 0
        self._cond = threading.Condition()
        # (item skeleton, [(future -> chunk id, length)], source object kept alive until finish)
        self._pending: list[tuple[Item, list[tuple[Future, int]], object]] = []
        self._finished = False

    # -- public ------------------------------------------------------------------------------------------
    def add_array(self, key: str, data, *, dtype: str, elem_size: int, shape=(), group: str = "",
                  global_offset: int = 0) -> None:
        """Queue an array item. ``global_offset`` is its byte offset inside ``group`` (a global tensor)."""
        if elem_size not in codec.VALID_ELEM_SIZES:
            raise ValueError(f"elem_size must be one of {codec.VALID_ELEM_SIZES}, got {elem_size}")
        if global_offset < 0 or global_offset % elem_size:
            raise ValueError(f"global_offset must be a non-negative multiple of elem_size, got {global_offset}")
        view = as_byte_view(data)
        spans = grid_spans(global_offset, len(view), self.config.chunk_size_bytes)
        item = Item(key=key, kind="array", nbytes=len(view), chunks=[], dtype=dtype, elem_size=elem_size,
                    shape=[int(d) for d in shape], group=group if group != key else "",
                    global_offset=global_offset)
        self._queue(item, view, spans, elem_size, data)

    def add_bytes(self, key: str, data) -> None:
        """Queue an opaque byte item (cut with FastCDC)."""
        view = as_byte_view(data)
        c = self.config
        spans = cdc_spans(view, c.cdc_min_bytes, c.cdc_avg_bytes, c.cdc_max_bytes)
        self._queue(Item(key=key, kind="bytes", nbytes=len(view), chunks=[]), view, spans, 1, data)

    def finish(self) -> WriteSummary:
        """Wait for every chunk, seal the last pack, and return the items and new pack entries."""
        if self._finished:
            raise RuntimeError("ChunkWriter.finish() was already called")
        self._finished = True
        try:
            items = []
            for item, futs, _src in self._pending:
                item.chunks = [ChunkRef(f.result(), n) for f, n in futs]
                items.append(item)
            with self._lock:
                builder, self._builder = self._builder, None
            if builder is not None and len(builder):
                self._put_pack(builder)
            return WriteSummary(items=items, entries=self._entries, packs=self._packs)
        finally:
            self._pending.clear()
            self._pool.shutdown(wait=True, cancel_futures=True)

    def abort(self) -> None:
        """Stop and drop everything queued; packs already written stay as orphans for gc."""
        self._finished = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()

    # -- internals ---------------------------------------------------------------------------------------
    def _queue(self, item: Item, view: memoryview, spans, elem_size: int, src) -> None:
        if self._finished:
            raise RuntimeError("ChunkWriter is finished")
        futs = []
        for s, e in spans:
            n = e - s
            self._reserve(n)
            try:
                fut = self._pool.submit(self._write_chunk, view[s:e], elem_size)
            except BaseException:
                self._release(n)
                raise
            fut.add_done_callback(lambda _f, n=n: self._release(n))
            futs.append((fut, n))
        self._pending.append((item, futs, src))

    def _reserve(self, n: int) -> None:
        with self._cond:
            while self._inflight and self._inflight + n > self.max_inflight_bytes:
                self._cond.wait()
            self._inflight += n

    def _release(self, n: int) -> None:
        with self._cond:
            self._inflight -= n
            self._cond.notify_all()

    def _write_chunk(self, view: memoryview, elem_size: int) -> bytes:
        cid = chunk_id_of(view)
        if self.store.index.lookup(cid) is not None:
            return cid
        with self._lock:
            if cid in self._claimed:
                return cid
            self._claimed.add(cid)
        c = self.config
        cod, stored = codec.encode_best(view, elem_size, c.zstd_level, c.min_gain)
        sealed = None
        with self._lock:
            self._builder.add(cid, cod, elem_size, len(view), stored)
            if self._builder.size_bytes >= c.pack_target_bytes:
                sealed, self._builder = self._builder, PackBuilder()
        if sealed is not None:
            self._put_pack(sealed)
        return cid

    def _put_pack(self, builder: PackBuilder) -> None:
        name, data, entries = builder.seal()
        self.store.backend.put(pack_key(name), data)
        with self._lock:
            self._entries.extend(entries)
            self._packs[name] = len(data)

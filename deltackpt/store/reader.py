"""The read path: fetch only the chunks a byte range needs, decode, re-hash, copy out.

Every chunk read is verified (by :class:`~.source.ChunkSource`): its decoded bytes must hash to its id, else
:class:`CorruptChunkError` names the chunk, its pack and (when known) the checkpoint and item.

A chunk read whole (the common case: a full load) is decoded straight into the destination and hashed
there: a raw chunk is read into it with one scatter read (``Backend.get_range_into``), a coded one is read
into per-thread scratch and decoded into it. Only reads of part of a chunk decode into a new array (kept
in a small LRU) and copy out.
"""

from __future__ import annotations

import bisect
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .backend import LocalFiles, local_root
from ..errors import CorruptChunkError, MissingChunkError
from .manifest import Item, Manifest
from .pack import PackEntry, pack_key
from .source import ChunkSource
from .threads import default_read_threads

MiB = 1 << 20
# From a store with no local path (object storage) whole chunks stored close together in one pack are read
# with one ranged GET of at most this many bytes: a request costs a round trip, and S3 serves large ranges
# best. On moto, 256 MiB of packs read in 4 MiB ranges took 1.4-1.6 s, in 16 MiB ranges 0.53-0.56 s.
COALESCE_MAX_BYTES = 32 * MiB
COALESCE_GAP_BYTES = 64 * 1024  # unneeded bytes between two chunks are read rather than a second request
_BUNDLE = object()  # marks a job that reads several whole chunks with few requests (CheckpointReader.coalesce)


class CheckpointReader:
    """Random access to the items of one committed checkpoint."""

    def __init__(self, store, manifest: Manifest, *, num_threads: int | None = None) -> None:
        self.store = store
        self.manifest = manifest
        self.items: dict[str, Item] = manifest.item_map()
        self.source = ChunkSource(store)
        self.remote = local_root(store.backend) is None  # object storage: coalesced requests, many in flight
        self.num_threads = num_threads or default_read_threads(remote=self.remote)
        self._pool: ThreadPoolExecutor | None = None
        self._starts: dict[str, list[int]] = {}
        store.base_cache.note_use()  # a restore then a save: a resumed training loop (see basecache)

    @property
    def name(self) -> str:
        return self.manifest.name

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def item(self, key: str) -> Item:
        try:
            return self.items[key]
        except KeyError:
            raise KeyError(f"checkpoint {self.name!r} has no item {key!r}") from None

    def _ref_starts(self, item: Item) -> list[int]:
        starts = self._starts.get(item.key)
        if starts is None:
            starts, pos = [], 0
            for ref in item.chunks:
                starts.append(pos)
                pos += ref.length
            self._starts[item.key] = starts
        return starts

    def read(self, key: str, offset: int = 0, length: int | None = None, *, parallel: bool = True) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of item ``key`` as a new uint8 array."""
        item = self.item(key)
        if length is None:
            length = item.nbytes - offset
        out = np.empty(length, dtype=np.uint8)
        self.read_into(key, out, offset, parallel=parallel)
        return out

    def read_into(self, key: str, out, offset: int = 0, *, parallel: bool = True) -> None:
        """Fill the writable buffer ``out`` with item ``key``'s bytes starting at ``offset``.

        Chunks are decoded straight into ``out``, in parallel; after an error (e.g. CorruptChunkError) its
        contents are unspecified: parts may hold damaged or partly decoded bytes. ``parallel=False`` reads
        the chunks in the calling thread (a caller that already reads items in parallel: nested pools would
        multiply the threads, and each holds a chunk's worth of scratch).
        """
        jobs = self.coalesce(self.chunk_jobs(key, out, offset))
        if len(jobs) == 1 or self.num_threads == 1 or not parallel:
            for job in jobs:
                self.run_job(job)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="deltackpt-read")
        for fut in [self._pool.submit(self.run_job, job) for job in jobs]:
            fut.result()

    def chunk_jobs(self, key: str, out, offset: int = 0) -> list[tuple]:
        """The per-chunk jobs that fill ``out`` with item ``key``'s bytes from ``offset`` (as read_into does),
        for a caller that schedules them itself: run each with :meth:`run_job`, in any threads. A job's
        ``[-1]`` is its byte count."""
        item = self.item(key)
        if isinstance(out, np.ndarray):
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("read_into needs a writable C-contiguous array")
            dst = out.reshape(-1).view(np.uint8)
        else:
            dst = np.frombuffer(out, dtype=np.uint8)
        length = dst.size
        if offset < 0 or offset + length > item.nbytes:
            raise ValueError(f"range [{offset}, {offset + length}) is outside item {key!r} of {item.nbytes} bytes")
        if length == 0:
            return []
        starts = self._ref_starts(item)
        i = bisect.bisect_right(starts, offset) - 1
        end = offset + length
        jobs = []
        while i < len(item.chunks) and starts[i] < end:
            ref = item.chunks[i]
            lo = max(offset, starts[i])
            hi = min(end, starts[i] + ref.length)
            jobs.append((item, dst, ref, ref.skip + lo - starts[i], lo - offset, hi - lo))
            i += 1
        return jobs

    def run_job(self, job: tuple) -> None:
        if job[0] is _BUNDLE:
            self._read_bundle(job[1])
        else:
            self._copy(*job)

    def coalesce(self, jobs: list[tuple]) -> list[tuple]:
        """``jobs`` (from chunk_jobs, of one item or many) with the whole chunks that lie close together in
        one pack bundled into one job, which reads them and their delta bases with a request per stretch of
        nearby bytes (COALESCE_MAX_BYTES in all); the rest as they are. Only for a store with no local path:
        locally a read per chunk lands straight in the destination, and a request costs no round trip."""
        if not self.remote or len(jobs) < 2:
            return jobs
        out, whole = [], []
        lookup = self.store.index.lookup
        for job in jobs:
            entry = lookup(job[2].id)
            if entry is not None and job[3] == 0 and job[-1] == entry.raw_len:
                base = lookup(entry.base_id) if entry.base_id is not None else None
                whole.append((entry, job, entry.span + (base.span if base is not None else 0)))
            else:
                out.append(job)
        whole.sort(key=lambda w: (w[0].pack, w[0].offset))
        bundle: list = []
        end = total = 0  # of the bundle being built: where its bytes end, what it reads in all
        for entry, job, cost in whole:
            if bundle and (entry.pack != bundle[-1][0].pack or entry.offset > end + COALESCE_GAP_BYTES
                           or total + cost > COALESCE_MAX_BYTES):
                out.append(_bundle_job(bundle))
                bundle = []
                end = total = 0
            bundle.append((entry, job))
            end, total = max(end, entry.offset + entry.span), total + cost
        if bundle:
            out.append(_bundle_job(bundle))
        return out

    def _read_bundle(self, parts: list) -> None:
        """Decode a bundle's chunks from a few ranged reads (the chunks, their bases). A chunk that fails to
        decode from them is read again on its own, which reports the damage as a single chunk's read would
        (and looks again through an index rebuilt from the packs when the cache's location was wrong)."""
        lookup = self.store.index.lookup
        wanted = {(e.pack, e.offset): e for e, _job in parts}
        for e, _job in parts:
            base = lookup(e.base_id) if e.base_id is not None and self.source._from_cache(e.base_id) is None else None
            if base is not None:
                wanted.setdefault((base.pack, base.offset), base)
        fetched = self._fetch(sorted(wanted.values(), key=lambda e: (e.pack, e.offset)))
        for entry, job in parts:
            item, dst, _ref, _src_off, dst_off, n = job
            try:
                self.source.decode_entry(entry, checkpoint=self.name, item=item.key, out=dst[dst_off:dst_off + n],
                                         fetched=fetched)
            except (CorruptChunkError, MissingChunkError):
                self._copy(*job)

    def _fetch(self, entries: list[PackEntry]) -> dict:
        """{(pack, offset): bytes} of ``entries`` (sorted by pack and offset), one ranged read per stretch
        of entries of one pack with gaps under COALESCE_GAP_BYTES. An entry the reads miss (a missing or
        short pack) is left out or short: decoding it then names the damage."""
        fetched, i = {}, 0
        while i < len(entries):
            j, end = i + 1, entries[i].offset + entries[i].span
            while (j < len(entries) and entries[j].pack == entries[i].pack
                   and entries[j].offset <= end + COALESCE_GAP_BYTES):
                end = max(end, entries[j].offset + entries[j].span)
                j += 1
            start = entries[i].offset
            try:
                data = memoryview(self.store.backend.get_range(pack_key(entries[i].pack), start, end - start))
            except FileNotFoundError:
                data = None
            if data is not None:
                for e in entries[i:j]:
                    fetched[(e.pack, e.offset)] = data[e.offset - start:e.offset - start + e.span]
            i = j
        return fetched

    def looks_cold(self, jobs: list[tuple], samples: int = 4) -> bool:
        """Whether the chunks the jobs (from chunk_jobs) read seem to be off the page cache: a few chunks,
        spread over the list, are probed without blocking (``Backend.is_cached``). A load is usually all
        warm (just written, or read before) or all cold (after a restart), so a few probes tell."""
        if not jobs:
            return False
        step = max(1, len(jobs) // samples)
        for job in jobs[::step][:samples]:
            entry = self.store.index.lookup(job[2].id)
            if entry is not None and isinstance(self.store.backend, LocalFiles) \
                    and self.store.backend.is_cached(pack_key(entry.pack), entry.offset) is False:
                return True
        return False

    def _copy(self, item: Item, dst: np.ndarray, ref, src_off: int, dst_off: int, n: int) -> None:
        where = dict(checkpoint=self.name, item=item.key)
        entry = self.source.entry(ref.id, **where)
        if src_off == 0 and n == entry.raw_len:
            # A whole chunk is decoded straight into the destination and not cached: a full load touches
            # each chunk once. On an error that slice of the destination holds garbage.
            self.source.decode_chunk(ref.id, out=dst[dst_off : dst_off + n], **where)
            return
        # Part of a chunk: cached, since resharded loads read one chunk from several read items.
        raw = self.source.get(ref.id, **where)
        if src_off + n > len(raw):
            raise CorruptChunkError("chunk is shorter than the manifest says", chunk_id=ref.id.hex(), **where)
        dst[dst_off : dst_off + n] = np.frombuffer(raw, dtype=np.uint8, count=n, offset=src_off)

    def read_all(self) -> dict[str, np.ndarray]:
        return {key: self.read(key) for key in self.items}


def _bundle_job(bundle: list) -> tuple:
    """A job for :meth:`CheckpointReader.run_job`: one chunk's own job, or a bundle of several."""
    if len(bundle) == 1:
        return bundle[0][1]
    return (_BUNDLE, bundle, sum(job[-1] for _e, job in bundle))

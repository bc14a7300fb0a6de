"""The read path: fetch only the chunks a byte range needs, decode, re-hash, copy out.

Every chunk read is verified (by :class:`~.source.ChunkSource`): its decoded bytes must hash to its id, else
:class:`CorruptChunkError` names the chunk, its pack and (when known) the checkpoint and item.

A chunk read whole (the common case: a full load) is decoded straight into the destination and hashed
there. The whole chunks of a read are grouped by pack (:meth:`CheckpointReader.coalesce`): one job per
bundle of nearby chunks, which opens each pack once and reads its chunks in order, one scatter read
(``Backend.get_ranges_into``) per stretch of adjacent entries, a raw chunk's bytes straight into the
destination, a coded one's into per-thread scratch to be decoded into it. Only reads of part of a chunk
decode into a new array (kept in a small LRU) and copy out.
"""

from __future__ import annotations

import bisect
import itertools
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter, itemgetter

import numpy as np

from .backend import LocalFiles, local_root
from ..errors import CorruptChunkError, MissingChunkError
from .manifest import Item, Manifest
from . import codec
from .pack import HEADER_SIZE, PackEntry, pack_key
from .pausegc import paused_gc
from .source import ChunkSource
from .threads import default_read_threads

MiB = 1 << 20
# From a store with no local path (object storage) whole chunks stored close together in one pack are read
# with one ranged GET of at most this many bytes: a request costs a round trip, and S3 serves large ranges
# best. On moto, 256 MiB of packs read in 4 MiB ranges took 1.4-1.6 s, in 16 MiB ranges 0.53-0.56 s.
COALESCE_MAX_BYTES = 32 * MiB
COALESCE_GAP_BYTES = 64 * 1024  # unneeded bytes between two chunks are read rather than a second request
# On a local store whole chunks of one pack are read and checked in bundles of at most this many bytes: one
# job, one file open and a preadv per 512 chunks of 8 KiB, while a load's threads still share the work.
BUNDLE_BYTES = 4 * MiB
_pack_order = itemgetter(0, 1)  # rows (pack, offset, ...) in the order their bytes lie
_BUNDLE = object()  # marks a job that reads several whole chunks with few reads (CheckpointReader.coalesce)


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
        with paused_gc():  # a few objects per chunk: full collections would rescan the caller's heap
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
        """``jobs`` (from chunk_jobs, of one item or many) with the whole chunks stored close together in one
        pack bundled into one job, the rest as they are. A bundle reads its chunks (and their delta bases)
        with one open of each pack and one ordered ranged read per stretch of nearby bytes, then checks each
        chunk as a read of its own would: a job per chunk cost a pool hand-off, an index look-up and a file
        open each (84 us a chunk; 160k chunks of 8 KiB loaded in 13.4 s). A bundle holds at most
        BUNDLE_BYTES on a local store, less when that would leave threads idle (4 MiB chunks stay one job
        each), and COALESCE_MAX_BYTES from object storage (a request costs a round trip)."""
        if len(jobs) < 2:
            return jobs
        index = self.store.index
        entries = index.lookup_many({job[2].id for job in jobs})
        out, whole = [], []
        for job in jobs:
            e = entries.get(job[2].id)
            if e is not None and job[3] == 0 and job[5] == e.raw_len:
                whole.append((e.pack, e.offset, e, job))
            else:
                out.append(job)
        whole.sort(key=_pack_order)
        costs = []
        for _p, _offset, e, _job in whole:
            cost = HEADER_SIZE + e.stored_len
            if e.base_id is not None:
                base = entries.get(e.base_id) or index.lookup(e.base_id)
                cost += base.span if base is not None else 0
            costs.append(cost)
        # Locally at least a bundle per thread: an item of a few large chunks still decodes in parallel.
        limit = COALESCE_MAX_BYTES if self.remote else min(BUNDLE_BYTES, -(-sum(costs) // self.num_threads))
        bundle: list = []
        pack, end, total = None, 0, 0  # of the bundle being built: its pack, where its bytes end, what it reads
        for (p, offset, e, job), cost in zip(whole, costs):
            if bundle and (p != pack or offset > end + COALESCE_GAP_BYTES or total + cost > limit):
                out.append(_bundle_job(bundle))
                bundle, end, total = [], 0, 0
            bundle.append((e, job))
            pack, end, total = p, max(end, offset + HEADER_SIZE + e.stored_len), total + cost
        if bundle:
            out.append(_bundle_job(bundle))
        return out

    def _read_bundle(self, parts: list) -> None:
        """Read a bundle's chunks (of one pack, by offset) and the bases of its deltas, each pack opened once
        and one scatter read per stretch of nearby entries (a raw chunk straight into its destination, coded
        bytes into scratch), then check and decode each. A chunk that fails (a missing or short pack,
        damage) is read again on its own, which reports the damage as a single chunk's read would (and
        looks again through an index rebuilt from the packs when the cache's location was wrong)."""
        bases = self._bundle_bases(parts)
        coded = sum(e.stored_len for e, _job in parts if e.codec != codec.RAW)
        scratch = memoryview(self.source._buffer("bundle", coded + sum(b.span for b in bases)))
        heads = memoryview(bytearray(HEADER_SIZE * len(parts)))
        dests = {}  # id(destination array) -> a byte memoryview of it (cheap to slice)
        rows, firsts = [], []  # (offset, span, buffers) of each entry to read; per part, the part that reads it
        seen: dict[int, int] = {}
        used = 0
        for i, (e, job) in enumerate(parts):
            first = seen.setdefault(e.offset, i)
            firsts.append(first)
            if first != i:
                continue  # a chunk stored once and used twice: read once
            dst, dst_off, n = job[1], job[4], job[5]
            dmv = dests.get(id(dst))
            if dmv is None:
                dmv = dests[id(dst)] = memoryview(dst)
            if e.codec == codec.RAW:
                payload = dmv[dst_off:dst_off + n]
            else:
                payload = scratch[used:used + e.stored_len]
                used += e.stored_len
            head = heads[i * HEADER_SIZE:(i + 1) * HEADER_SIZE]
            rows.append((e.offset, HEADER_SIZE + e.stored_len, (head, payload)))
        fetched = {}
        for pack, group in itertools.groupby(bases, key=attrgetter("pack")):
            base_rows = []
            for b in group:
                base_rows.append((b.offset, b.span, (scratch[used:used + b.span],)))
                used += b.span
            for (offset, _span, (buf,)), n in zip(base_rows, self._read_pack(pack, base_rows)):
                fetched[(pack, offset)] = buf[:n]  # a short read stays short: decoding it names the damage
        counts = iter(self._read_pack(parts[0][0].pack, rows))
        rows = iter(rows)
        failed = set()
        for i, (e, job) in enumerate(parts):
            first = firsts[i]
            try:
                if first == i:
                    n, (head, payload) = next(counts), next(rows)[2]
                    # a raw chunk is already in place (payload is its destination): only its hash is checked
                    dest = payload if e.codec == codec.RAW else job[1][job[4]:job[4] + job[5]]
                    self.source.decode_read(e, head, payload, n, dest, checkpoint=self.name, item=job[0].key,
                                            fetched=fetched)
                elif first in failed:
                    self._copy(*job)
                else:  # its bytes as checked for the first part that uses them
                    src = parts[first][1]
                    job[1][job[4]:job[4] + job[5]] = src[1][src[4]:src[4] + src[5]]
            except (CorruptChunkError, MissingChunkError):
                failed.add(i)
                self._copy(*job)

    def _bundle_bases(self, parts: list) -> list[PackEntry]:
        """The entries of the delta bases a bundle's chunks need that the LRU lacks, by pack and offset."""
        lookup = self.store.index.lookup
        bases = {}
        for e, _job in parts:
            if e.base_id is not None and self.source._from_cache(e.base_id) is None:
                base = lookup(e.base_id)
                if base is not None:
                    bases[(base.pack, base.offset)] = base
        return [bases[k] for k in sorted(bases)]

    def _read_pack(self, pack: str, rows: list[tuple]) -> list[int]:
        """Read ``rows`` ((offset, span, buffers) of entries of ``pack``, by offset) with one
        ``get_ranges_into``: one range per stretch of entries with gaps under COALESCE_GAP_BYTES (a gap is
        read into scratch). Returns how many of each entry's bytes were read (none from a missing pack)."""
        ranges, which = [], []
        end = 0
        for offset, span, bufs in rows:
            if ranges and end <= offset <= end + COALESCE_GAP_BYTES:
                if offset > end:
                    ranges[-1][1].append(bytearray(offset - end))
                ranges[-1][1].extend(bufs)
            else:  # the first entry, one far from the last, or one overlapping it (a damaged index)
                ranges.append((offset, list(bufs)))
            which.append(len(ranges) - 1)
            end = offset + span
        try:
            counts = self.store.backend.get_ranges_into(pack_key(pack), ranges)
        except FileNotFoundError:
            return [0] * len(rows)
        reached = [start + n for (start, _bufs), n in zip(ranges, counts)]
        return [max(0, min(span, reached[r] - offset)) for (offset, span, _bufs), r in zip(rows, which)]

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

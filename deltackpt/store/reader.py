"""The read path: fetch only the chunks a byte range needs, decode, re-hash, copy out.

Every chunk read is verified (by :class:`~.source.ChunkSource`): its decoded bytes must hash to its id, else
:class:`CorruptChunkError` names the chunk, its pack and (when known) the checkpoint and item.

A chunk read whole (the common case: a full load) is decoded straight into the destination and hashed
there. The whole chunks of a read are grouped by pack (:meth:`CheckpointReader.coalesce`): one job per
bundle of nearby chunks, which reads the stretch of the pack that holds them with one ranged read
(``Backend.get_ranges_into``) into per-thread scratch, copies the raw chunks into place, decodes the coded
ones into it, and checks them all in arrays (index records, headers, hashes: a few us an 8 KiB chunk). Only
reads of part of a chunk decode into a new array (kept in a small LRU) and copy out.
"""

from __future__ import annotations

import bisect
import itertools
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter, itemgetter

import numpy as np

from .backend import LocalFiles, local_root
from ..errors import CorruptChunkError, CorruptManifestError, MissingChunkError
from .config import chain_limit
from .manifest import Item, Manifest
from . import codec
from .records import decode_record
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
_BUNDLE = object()  # marks a job that reads several whole chunks with few reads (CheckpointReader.coalesce)
# A job's fields (chunk_jobs), read in C over a list of jobs: (item, dst, ref, skip in the chunk, dst offset, count)
_DST, _REF, _SKIP, _DST_OFF, _COUNT = itemgetter(1), itemgetter(2), itemgetter(3), itemgetter(4), itemgetter(5)
_ID, _LENGTH = attrgetter("id"), attrgetter("length")


def damaged_pack(error: CorruptChunkError) -> str | None:
    """The pack of the innermost CorruptChunkError down ``error``'s causes: a delta's error wraps its base's,
    and a chain checked link by link names the damaged link last."""
    pack = None
    while error is not None:
        if isinstance(error, CorruptChunkError) and error.pack:
            pack = error.pack
        error = error.__cause__
    return pack


class CheckpointReader:
    """Random access to the items of one committed checkpoint."""

    def __init__(self, store, manifest: Manifest, *, num_threads: int | None = None) -> None:
        self.store = store
        self.manifest = manifest
        self.items: dict[str, Item] = manifest.item_map()
        # Its chunks were published before its manifest was read, so before now.
        self.source = ChunkSource(store, published_before=store._cache_index().refreshes)
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
            starts = self._starts[item.key] = [0, *itertools.accumulate(map(_LENGTH, item.chunks))][:-1]
        return starts

    def read(self, key: str, offset: int = 0, length: int | None = None, *, parallel: bool = True) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of item ``key`` as a new uint8 array."""
        item = self.item(key)
        if length is None:
            length = item.nbytes - offset
        if offset < 0 or length < 0 or offset + length > item.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + length}) are outside item {key!r} of {item.nbytes} bytes")
        out = self._allocate(length, [key])
        self.read_into(key, out, offset, parallel=parallel)
        return out

    def _allocate(self, nbytes: int, keys) -> np.ndarray:
        """``np.empty(nbytes)`` for items ``keys``; when that is more than this machine can allocate, a manifest
        whose refs claim more than their chunks hold (a crafted one: a few hundred bytes can claim a TiB) is
        named as such (CorruptManifestError) instead of a MemoryError."""
        try:
            return np.empty(nbytes, dtype=np.uint8)
        except MemoryError:
            where = dict(checkpoint=self.name)
            for key in keys:
                for ref in self.item(key).chunks:
                    held = self.source.entry(ref.id, item=key, **where).raw_len
                    if ref.skip + ref.length > held:
                        raise CorruptManifestError(
                            f"manifest {self.name!r}: item {key!r} reads bytes {ref.skip}..{ref.skip + ref.length} "
                            f"of chunk {ref.id.hex()}, which holds {held}", checkpoint=self.name) from None
            raise

    def read_into(self, key: str, out, offset: int = 0, *, parallel: bool = True) -> None:
        """Fill the writable buffer ``out`` with item ``key``'s bytes starting at ``offset``.

        Chunks are decoded straight into ``out``, in parallel; after an error (e.g. CorruptChunkError) its
        contents are unspecified: parts may hold damaged or partly decoded bytes. ``parallel=False`` reads
        the chunks in the calling thread (a caller that already reads items in parallel: nested pools would
        multiply the threads, and each holds a chunk's worth of scratch).
        """
        with paused_gc():  # a few objects per chunk: full collections would rescan the caller's heap
            self._run_jobs(self.coalesce(self.chunk_jobs(key, out, offset)), parallel)

    def read_many(self, keys) -> dict[str, np.ndarray]:
        """Each of the items ``keys`` whole, as a new uint8 array, read together: the chunks of all of them
        coalesced by pack (read one by one, 100k items of 4 KiB cost a job, two index look-ups and a file
        open each)."""
        with paused_gc():
            outs = {key: self._allocate(self.item(key).nbytes, [key]) for key in keys}
        self.read_many_into(outs)
        return outs

    def read_many_into(self, outs: dict) -> None:
        """Fill each writable buffer of ``outs`` (item key -> buffer of the item's size, as DCP's state dict
        tensors are) with its item's bytes, the chunks of all of them read together (:meth:`read_many`)."""
        with paused_gc():
            jobs = []
            for key, out in outs.items():
                want, got = self.item(key).nbytes, memoryview(out).nbytes
                if got != want:
                    raise ValueError(f"item {key!r} holds {want} bytes, its buffer {got}")
                jobs += self.chunk_jobs(key, out)
            self._run_jobs(self.coalesce(jobs))

    def _run_jobs(self, jobs: list[tuple], parallel: bool = True) -> None:
        if len(jobs) <= 1 or self.num_threads == 1 or not parallel:
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
        if offset == 0 and length == item.nbytes:  # the whole item (a full load): every chunk whole
            return [(item, dst, ref, ref.skip, start, ref.length) for ref, start in zip(item.chunks, starts)]
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
        try:
            if job[0] is _BUNDLE:
                self._read_bundle(*job[1:4])
            else:
                self._copy(*job)
        except CorruptChunkError as e:  # final (a wrong cache record was looked up again): the pack's fault
            pack = damaged_pack(e)
            if pack:
                self.store.index.mark_damaged([pack])  # the next save writes the chunk again
            raise

    def coalesce(self, jobs: list[tuple]) -> list[tuple]:
        """``jobs`` (from chunk_jobs, of one item or many) with the whole chunks stored close together in one
        pack bundled into one job, the rest as they are. A bundle reads its chunks (and their delta bases)
        with one open of each pack and one ordered ranged read per stretch of nearby bytes, then checks each
        chunk as a read of its own would: a job per chunk cost a pool hand-off, an index look-up and a file
        open each (84 us a chunk; 160k chunks of 8 KiB loaded in 13.4 s). A bundle holds at most
        BUNDLE_BYTES on a local store, less when that would leave threads idle (4 MiB chunks stay one job
        each), and COALESCE_MAX_BYTES from object storage (a request costs a round trip). The chunks' index
        records are read and sorted as arrays: no PackEntry per chunk."""
        if len(jobs) < 2:
            return jobs
        index = self.store.index
        num = len(jobs)
        recs, found = index.records(list(map(_ID, map(_REF, jobs))))
        skip = np.fromiter(map(_SKIP, jobs), dtype=np.int64, count=num)
        length = np.fromiter(map(_COUNT, jobs), dtype=np.int64, count=num)
        whole = found & (skip == 0) & (length == recs["raw_len"].astype(np.int64))
        out = [job for job, w in zip(jobs, whole.tolist()) if not w]
        at = np.flatnonzero(whole)
        if not len(at):
            return out
        packs, pack_no = np.unique(recs["pack"][at], return_inverse=True)
        order = np.lexsort((recs["offset"][at], pack_no))  # by pack, then where the bytes lie
        at, pack_no = at[order], pack_no[order]
        recs = recs[at]
        span = HEADER_SIZE + recs["stored_len"].astype(np.int64)
        cost = span.copy()
        # A delta costs the links down its chain too (its base, the base's base, ... to a keyframe: each is read
        # and decoded with it): counting only its base packed a depth-8 load's 50 chains into 3 bundles, which
        # 2 threads could not share evenly. One level of the chains at a time, at most the store's chain limit.
        rows = np.flatnonzero(np.isin(recs["codec"], codec.DELTA_CODECS))
        link_ids = [recs["base"][k].tobytes() for k in rows.tolist()]
        for _ in range(chain_limit(self.store.config)):
            if not len(rows):
                break
            link_recs, link_found = index.records(link_ids)
            cost[rows] += np.where(link_found, HEADER_SIZE + link_recs["stored_len"].astype(np.int64), 0)
            more = link_found & np.isin(link_recs["codec"], codec.DELTA_CODECS)
            rows, link_ids = rows[more], [link_recs["base"][k].tobytes() for k in np.flatnonzero(more).tolist()]
        # Locally at least a bundle per thread: an item of a few large chunks still decodes in parallel.
        limit = COALESCE_MAX_BYTES if self.remote else min(BUNDLE_BYTES, -(-int(cost.sum()) // self.num_threads))
        starts = self._bundle_starts(pack_no, recs["offset"].astype(np.int64), span, cost, limit)
        names = [bytes(p).hex() for p in packs.tolist()]
        sizes = np.concatenate([[0], np.cumsum(length[at])]).tolist()  # bytes the bundle's jobs fill
        at, pack_no = at.tolist(), pack_no.tolist()
        for a, b in zip(starts, starts[1:]):
            if b - a == 1:
                out.append(jobs[at[a]])
            else:
                out.append((_BUNDLE, [jobs[i] for i in at[a:b]], recs[a:b], names[pack_no[a]], sizes[b] - sizes[a]))
        return out

    @staticmethod
    def _bundle_starts(pack_no: np.ndarray, offsets: np.ndarray, span: np.ndarray, cost: np.ndarray,
                       limit: int) -> list[int]:
        """Where each bundle starts in chunks sorted by pack and offset, and their count last: a new pack, a gap
        over COALESCE_GAP_BYTES after the chunk before, or a bundle that would cost over ``limit`` (a chunk
        costing more is a bundle of its own). In arrays: a Python step per bundle, not per chunk."""
        num = len(offsets)
        run = np.ones(num, dtype=bool)
        run[1:] = (pack_no[1:] != pack_no[:-1]) | (offsets[1:] > offsets[:-1] + span[:-1] + COALESCE_GAP_BYTES)
        runs = np.flatnonzero(run).tolist() + [num]
        total = np.concatenate([[0], np.cumsum(cost)])
        ends = np.searchsorted(total, total[:-1] + limit, side="right") - 1  # past the last chunk that fits
        ends = ends.tolist()
        starts = []
        for a, b in zip(runs, runs[1:]):
            while a < b:
                starts.append(a)
                a = min(b, max(a + 1, ends[a]))
        return starts + [num]

    def _read_bundle(self, parts: list, recs: np.ndarray, pack: str) -> None:
        """Read a bundle's chunks (``parts``: their jobs, of one ``pack``, by offset; ``recs``: their index
        records) with one ranged read of the stretch of the pack that holds them (the bundle's gaps are
        small), and the bases of its deltas, into scratch; then check them all, copying raw chunks into place
        and decoding zstd keyframes in a batch (:meth:`ChunkSource.check_reads`: per-chunk work in arrays, an
        8 KiB chunk costs a few us). A chunk that does not pass, and a delta, is checked on its own
        (``decode_read``), which names the damage; one that fails that is read again on its own, which
        reports the damage as a single chunk's read would (and looks again through an index rebuilt from the
        packs when the cache's location was wrong)."""
        entries = {}

        def entry(i: int) -> PackEntry:  # built only for a chunk checked on its own
            if i not in entries:
                entries[i] = decode_record(parts[i][2].id, recs[i].tobytes())
            return entries[i]

        offsets, stored = recs["offset"].astype(np.int64), recs["stored_len"].astype(np.int64)
        ids = b"".join(map(_ID, map(_REF, parts)))
        first = np.ones(len(parts), dtype=bool)
        first[1:] = offsets[1:] != offsets[:-1]  # a chunk stored once and used twice (by offset): read once
        if not first.all():  # ... if it is the same chunk: two ids at one place (a wrong cache record) are each
            words = np.frombuffer(ids, dtype="<u8").reshape(-1, 2)  # checked against their own id
            first[1:] |= (words[1:] != words[:-1]).any(axis=1)
        uniq = np.flatnonzero(first)
        start = int(offsets[0])
        extent = int((offsets + HEADER_SIZE + stored).max()) - start
        bases = self._bundle_bases([entry(i) for i in np.flatnonzero(np.isin(recs["codec"], codec.DELTA_CODECS))])
        buf = self.source._buffer("bundle", extent + sum(b.span for b in bases))
        scratch = memoryview(buf)
        got = self._read_pack(pack, [(start, extent, (scratch[:extent],))])[0]
        used = extent
        fetched = {}
        for base_pack, group in itertools.groupby(bases, key=attrgetter("pack")):
            base_rows = []
            for b in group:
                base_rows.append((b.offset, b.span, (scratch[used:used + b.span],)))
                used += b.span
            for (offset, _span, (view,)), n in zip(base_rows, self._read_pack(base_pack, base_rows)):
                fetched[(base_pack, offset)] = view[:n]  # a short read stays short: decoding it names the damage
        at = offsets[uniq] - start
        counts = np.clip(got - at, 0, HEADER_SIZE + stored[uniq]).tolist()  # bytes of each entry the read returned
        heads = buf[at[:, None] + np.arange(HEADER_SIZE)]  # (chunks, HEADER_SIZE): every header, gathered
        sel = parts if len(uniq) == len(parts) else [parts[i] for i in uniq.tolist()]
        dests = {id(d): memoryview(d) for d in {id(d): d for d in map(_DST, sel)}.values()}  # cheap to slice
        outs = [dests[id(d)][o:o + n] for d, o, n in zip(map(_DST, sel), map(_DST_OFF, sel), map(_COUNT, sel))]
        ids = ids if len(uniq) == len(parts) else b"".join(map(_ID, map(_REF, sel)))
        ok = self.source.check_reads(recs[uniq], ids, heads, counts, buf,
                                     at + HEADER_SIZE, outs)
        if ok.all() and len(uniq) == len(parts):
            return
        raw = (recs["codec"] == codec.RAW).tolist()
        stored, at = stored.tolist(), (at + HEADER_SIZE).tolist()
        failed = set()
        for j in np.flatnonzero(~ok).tolist():
            i = int(uniq[j])
            job = parts[i]
            payload, out = scratch[at[j]:at[j] + stored[i]], np.frombuffer(outs[j], dtype=np.uint8)
            if raw[i]:
                if stored[i] == job[5]:
                    out[:] = payload
                payload = out  # a raw chunk is checked where it is (decode_read's convention)
            try:
                self.source.decode_read(entry(i), heads[j], payload, counts[j], out, checkpoint=self.name,
                                        item=job[0].key, fetched=fetched)
            except (CorruptChunkError, MissingChunkError):
                failed.add(i)
                self._copy(*job)
        if len(uniq) < len(parts):
            firsts = np.maximum.accumulate(np.where(first, np.arange(len(parts)), 0)).tolist()
            for i, job in enumerate(parts):
                src = parts[firsts[i]]
                if firsts[i] == i:
                    continue
                if firsts[i] in failed:
                    self._copy(*job)
                else:  # its bytes as checked for the first part that uses them
                    job[1][job[4]:job[4] + job[5]] = src[1][src[4]:src[4] + src[5]]

    def _bundle_bases(self, deltas: list[PackEntry]) -> list[PackEntry]:
        """The entries of the delta bases the ``deltas`` need that the LRU lacks, by pack and offset."""
        lookup = self.store.index.lookup
        bases = {}
        for e in deltas:
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
        # Part of a chunk: cached, since resharded loads read one chunk from several read items. Decoded and
        # hashed first (a wrong cache record is looked up again there): only a checked length judges the ref.
        raw = self.source.get(ref.id, **where)
        if src_off + n > len(raw):  # the chunk is as its pack says (hashed on read): the ref is wrong
            raise CorruptManifestError(f"manifest {self.name!r}: item {item.key!r} reads bytes {src_off}..{src_off + n}"
                                       f" of chunk {ref.id.hex()}, which holds {len(raw)}",
                                       checkpoint=self.name)
        dst[dst_off : dst_off + n] = np.frombuffer(raw, dtype=np.uint8, count=n, offset=src_off)

    def read_all(self) -> dict[str, np.ndarray]:
        return self.read_many(self.items)

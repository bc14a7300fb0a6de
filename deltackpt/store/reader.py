"""The read path: fetch only the chunks a byte range needs, decode, re-hash, copy out.

Every chunk read is verified: its decoded bytes must hash to its id, else :class:`CorruptChunkError`
names the chunk, its pack and (when known) the checkpoint and item. A delta chunk is decoded through its
base, which must itself be a keyframe; damage in the base is reported with both ids.

A chunk read whole (the common case: a full load) is decoded straight into the destination and hashed
there: a raw chunk is read into it with one scatter read (``Backend.get_range_into``), a coded one is read
into per-thread scratch and decoded into it. Only reads of part of a chunk decode into a new array (kept
in a small LRU) and copy out.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .backend import LocalFiles, local_root
from ..errors import CorruptChunkError, ManifestFormatError, MissingChunkError
from . import codec
from .basecache import note_use
from .manifest import Item, Manifest
from .pack import HEADER_SIZE, PackEntry, decode_header, pack_key
from .chunking import chunk_id_of

MiB = 1 << 20
REMOTE_READ_THREADS = 8
# From a store with no local path (object storage) whole chunks stored close together in one pack are read
# with one ranged GET of at most this many bytes: a request costs a round trip, and S3 serves large ranges
# best. On moto, 256 MiB of packs read in 4 MiB ranges took 1.4-1.6 s, in 16 MiB ranges 0.53-0.56 s.
COALESCE_MAX_BYTES = 32 * MiB
COALESCE_GAP_BYTES = 64 * 1024  # unneeded bytes between two chunks are read rather than a second request
_BUNDLE = object()  # marks a job that reads several whole chunks with few requests (CheckpointReader.coalesce)


def default_read_threads(cold: bool = False, remote: bool = False) -> int:
    """Threads for reading chunks: one per core when the data is in the page cache (more only contend for
    the GIL), twice that when reads wait on the device (at most 8), REMOTE_READ_THREADS from object storage
    (requests wait on the network, whatever the cores). Measured on 2 cores, a 235 MiB load: warm 0.143 s
    with 2 threads vs 0.165 s with 4; cold 0.338 s with 2 vs 0.291 s with 4."""
    if remote:
        return REMOTE_READ_THREADS
    cores = usable_cores()
    return max(1, min(8, 2 * cores if cold else cores))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the platform tells)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


class ChunkSource:
    """Decoded, verified chunks by id, with a small LRU so overlapping reads decode a chunk once.

    Chunks are decoded into the caller's buffer where it wants them (``decode_entry(..., out=)``): a raw
    chunk is read straight into it, a coded one is read into a per-thread scratch buffer and decoded into it,
    and the hash is taken over it. A delta's base is decoded into per-thread scratch too, so the reader itself
    allocates nothing per chunk (fresh buffers per chunk cost page faults that serialize a multi-threaded
    load). Scratch is kept only for chunks up to ``SCRATCH_MAX`` bytes (three buffers per thread: stored
    bytes, byte planes, a delta's base; released with the source).
    """

    SCRATCH_MAX = 16 * MiB
    PROBE_ELEMS = 256  # elements of a byte plane compared by differs()

    def __init__(self, store, cache_bytes: int = 64 * MiB) -> None:
        self.store = store
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()
        self._scratch = threading.local()

    def entry(self, cid: bytes, *, checkpoint=None, item=None) -> PackEntry:
        index = self.store.index
        gen = index.generation
        entry = index.lookup(cid)
        if entry is None:
            self.store.refresh_index()
            entry = index.lookup(cid)
        if entry is None and index.distrust(gen):  # a damaged cache can lose a record the packs still hold
            entry = index.lookup(cid)
        if entry is None:
            raise MissingChunkError(cid.hex(), checkpoint=checkpoint, item=item)
        return entry

    def decode_chunk(self, cid: bytes, *, checkpoint=None, item=None, out=None):
        """:meth:`decode_entry` of the copy the index locates; a location found wrong (a damaged cache, not
        a damaged store, until the index rebuilt from the packs says the same) is looked up once more."""
        gen = self.store.index.generation
        try:
            return self.decode_entry(self.entry(cid, checkpoint=checkpoint, item=item), checkpoint=checkpoint,
                                     item=item, out=out)
        except (CorruptChunkError, MissingChunkError) as first:
            if not self.store.index.distrust(gen):
                raise
            try:
                return self.decode_entry(self.entry(cid, checkpoint=checkpoint, item=item),
                                         checkpoint=checkpoint, item=item, out=out)
            except MissingChunkError:
                raise first from None  # not even in the rebuilt index (its pack's table is damaged): say where

    def _from_cache(self, cid: bytes):
        with self._lock:
            raw = self._cache.get(cid)
            if raw is not None:
                self._cache.move_to_end(cid)
            return raw

    def get(self, cid: bytes, *, checkpoint=None, item=None, keep: bool = True):
        """Decoded bytes of chunk ``cid`` (a uint8 array or bytes; cached ones are shared: do not modify);
        ``keep=False`` skips the LRU (a chunk read once)."""
        raw = self._from_cache(cid)
        if raw is not None:
            return raw
        raw = self.decode_chunk(cid, checkpoint=checkpoint, item=item)
        if keep:
            self._remember(cid, raw)
        return raw

    def decode_entry(self, entry: PackEntry, *, checkpoint=None, item=None, out=None, fetched=None):
        """Decoded, verified bytes of the chunk at ``entry`` (a specific copy, e.g. from a pack table).

        With ``out`` (a writable uint8 array of ``entry.raw_len`` bytes) the chunk is decoded into it and it
        is returned; else into a new array. After an error ``out`` holds garbage (damaged or partly decoded
        bytes): the caller's read fails anyway. ``fetched``: {(pack, offset): entry bytes (header and
        payload)} the caller already read (one request for several chunks and their bases); entries not
        in it are read here.
        """
        if out is None:
            out = np.empty(entry.raw_len, dtype=np.uint8)
        elif out.size != entry.raw_len:
            raise ValueError(f"out has {out.size} bytes, chunk {entry.chunk_id.hex()} has {entry.raw_len}")
        base = None
        if entry.codec == codec.DELTA:
            base = self._get_base(entry, checkpoint=checkpoint, item=item, fetched=fetched)
        self._decode(entry, base, out, checkpoint=checkpoint, item=item, stored=_stored(fetched, entry))
        return out

    def _buffer(self, name: str, n: int) -> np.ndarray:
        """This thread's scratch array ``name``, ``n`` bytes long (a new array past SCRATCH_MAX)."""
        return codec.scratch_array(self._scratch, name, n, min_size=4 * MiB, keep_max=self.SCRATCH_MAX)

    def _get_base(self, entry: PackEntry, *, checkpoint, item, fetched=None):
        """The verified base of delta ``entry``: from the LRU, else decoded into this thread's scratch (valid
        until this thread decodes the next base)."""
        base_hex = entry.base_id.hex() if entry.base_id else None
        if entry.base_id is None:
            raise CorruptChunkError("delta chunk has no base", chunk_id=entry.chunk_id.hex(), pack=entry.pack,
                                    checkpoint=checkpoint, item=item)
        try:
            base = self._from_cache(entry.base_id)
            if base is not None:
                return base
            base_entry = self.entry(entry.base_id, checkpoint=checkpoint, item=item)
            if base_entry.codec == codec.DELTA:
                raise CorruptChunkError("delta base is itself a delta", chunk_id=base_hex, pack=base_entry.pack)
            # Not cached: a base serves the one delta at its place, and a load touches it once.
            base = self._buffer("base", base_entry.raw_len)
            self._decode(base_entry, None, base, checkpoint=checkpoint, item=item,
                         stored=_stored(fetched, base_entry))
            return base
        except (CorruptChunkError, MissingChunkError) as e:
            raise CorruptChunkError(f"base of delta chunk is unreadable ({e})", chunk_id=entry.chunk_id.hex(),
                                    base_chunk_id=base_hex, pack=entry.pack, checkpoint=checkpoint,
                                    item=item) from e

    def _decode(self, entry: PackEntry, base, out: np.ndarray, *, checkpoint, item, stored=None) -> None:
        """Read the entry (one ranged read: its header, and its payload straight into ``out`` when raw, else
        into scratch) unless ``stored`` holds its bytes, check the header against the index, decode into
        ``out`` and check its hash."""
        where = dict(chunk_id=entry.chunk_id.hex(), pack=entry.pack, checkpoint=checkpoint, item=item)
        if entry.codec == codec.RAW and entry.stored_len != entry.raw_len:
            raise CorruptChunkError("raw entry lengths disagree", **where)
        if stored is not None:
            stored = np.frombuffer(stored, dtype=np.uint8)
            head, payload, n = stored[:HEADER_SIZE], stored[HEADER_SIZE:], len(stored)
            if entry.codec == codec.RAW and n == entry.span:
                out[:] = payload
        else:
            head = bytearray(HEADER_SIZE)
            payload = out if entry.codec == codec.RAW else self._buffer("stored", entry.stored_len)
            try:
                n = self.store.backend.get_range_into(pack_key(entry.pack), entry.offset, [head, payload])
            except FileNotFoundError:
                raise CorruptChunkError("pack is missing", **where) from None
        if n != entry.span:
            raise CorruptChunkError("pack is truncated", **where)
        try:
            cid, cod, es, rlen, slen, base_id, _age = decode_header(head, f"pack {entry.pack}")
        except ManifestFormatError as e:
            raise CorruptChunkError(f"damaged entry header ({e})", **where) from None
        if (cid, cod, es, rlen, slen, base_id) != (entry.chunk_id, entry.codec, entry.elem_size, entry.raw_len,
                                                  entry.stored_len, entry.base_id):
            raise CorruptChunkError("entry header disagrees with the index", **where)
        if cod != codec.RAW:
            try:
                codec.decode(cod, payload, rlen, es, base, out=out, scratch=self._buffer("planes", rlen))
            except ValueError as e:
                raise CorruptChunkError(f"cannot decode ({e})", **where) from None
        if chunk_id_of(out) != entry.chunk_id:
            raise CorruptChunkError("chunk bytes do not match their hash", **where)

    def differs(self, cid: bytes, skip: int, mine: np.ndarray) -> bool:
        """Whether the bytes of chunk ``cid`` from ``skip`` surely differ from ``mine`` (a uint8 array), judged
        from a few of its stored bytes (the first ``PROBE_ELEMS`` elements, one byte plane stored as is)
        without decoding it. False when they look equal or cannot be judged this cheaply: the caller then
        compares decoded, verified bytes. The bytes probed are not verified; damage there can only make
        a chunk look different, so it is never reused on their word."""
        index = self.store.index
        entry = index.lookup(cid)
        if entry is None:
            return False
        es = entry.elem_size
        count = min(len(mine) // es, self.PROBE_ELEMS)
        first = skip // es
        if skip % es or count == 0 or first + count > entry.raw_len // es:
            return False
        parts = [entry]  # a delta's planes are XORed with its keyframe's
        if entry.codec == codec.DELTA:
            base = index.lookup(entry.base_id) if entry.base_id else None
            if base is None or base.codec == codec.DELTA or base.elem_size != es or base.raw_len != entry.raw_len:
                return False
            parts.append(base)
        try:
            # One read per entry: its container header and, when close behind it, the probed bytes of plane 0.
            heads = [self._head(e, first, count) for e in parts]
            for plane in range(es):
                got = [self._plane_bytes(e, head, plane, first, count) for e, head in zip(parts, heads)]
                if all(g is not None for g in got):
                    return not np.array_equal(np.bitwise_xor.reduce(got), mine[plane:plane + count * es:es])
        except OSError:  # a probe never fails a save: the decoded comparison reports what is wrong
            pass
        return False

    _HEAD_READ_MAX = 16384  # plane 0's probed bytes are read with the header when they end this close to it

    def _head(self, entry: PackEntry, first: int, count: int):
        """(plane layout, the stored bytes read from the payload's start) of a coded entry; (None, None) for
        a raw entry, a payload that is not a plane container, or a short read."""
        if entry.codec == codec.RAW:
            return None, None
        size = codec.container_header_size(entry.elem_size)
        extra = first + count if first + count <= self._HEAD_READ_MAX else 0
        buf = np.empty(size + extra, dtype=np.uint8)
        got = self.store.backend.get_range_into(pack_key(entry.pack), entry.offset + HEADER_SIZE, [buf])
        if got < size:
            return None, None
        return codec.plane_layout(buf[:size], entry.raw_len, entry.elem_size), buf[:got]

    def _plane_bytes(self, entry: PackEntry, head, plane: int, first: int, count: int) -> np.ndarray | None:
        """Byte ``plane`` of elements ``[first, first + count)`` of the chunk at ``entry``, from ``head``
        (:meth:`_head`) or read from its stored bytes; None when that plane is not stored as is (or the read
        comes up short)."""
        es, at = entry.elem_size, entry.offset + HEADER_SIZE
        layout, got = head
        if entry.codec == codec.RAW:
            buf = np.empty(count * es, dtype=np.uint8)
            at += first * es
            out = buf[plane::es]
        elif layout is not None and layout[plane][0] == codec.SEG_RAW:
            start = layout[plane][1] + first
            if start + count <= len(got):
                return got[start:start + count]
            buf = out = np.empty(count, dtype=np.uint8)
            at += start
        else:
            return None
        return out if self.store.backend.get_range_into(pack_key(entry.pack), at, [buf]) == buf.size else None

    def _remember(self, cid: bytes, raw) -> None:
        n = len(raw)
        if n > self.cache_bytes // 4:
            return
        with self._lock:
            if cid in self._cache:
                return
            self._cache[cid] = raw
            self._cached += n
            while self._cached > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= len(old)


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
        note_use(store.config.store_id)  # a restore then a save: a resumed training loop (see basecache)

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


def _stored(fetched: dict | None, entry: PackEntry):
    return fetched.get((entry.pack, entry.offset)) if fetched else None

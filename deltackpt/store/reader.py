"""The read path: fetch only the chunks a byte range needs, decode, re-hash, copy out.

Every chunk read is verified: its decoded bytes must hash to its id, else :class:`CorruptChunkError`
names the chunk, its pack and (when known) the checkpoint and item. A delta chunk is decoded through its
base, which must itself be a keyframe; damage in the base is reported with both ids.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import CorruptChunkError, ManifestFormatError, MissingChunkError
from . import codec
from .manifest import Item, Manifest
from .pack import PackEntry, decode_header, pack_key
from .chunking import chunk_id_of

MiB = 1 << 20


class ChunkSource:
    """Decoded, verified chunks by id, with a small LRU so overlapping reads decode a chunk once."""

    def __init__(self, store, cache_bytes: int = 64 * MiB) -> None:
        self.store = store
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()

    def entry(self, cid: bytes, *, checkpoint=None, item=None) -> PackEntry:
        entry = self.store.index.lookup(cid)
        if entry is None:
            self.store.refresh_index()
            entry = self.store.index.lookup(cid)
        if entry is None:
            raise MissingChunkError(cid.hex(), checkpoint=checkpoint, item=item)
        return entry

    def get(self, cid: bytes, *, checkpoint=None, item=None, keep: bool = True):
        """Decoded bytes of chunk ``cid``; ``keep=False`` skips the LRU (a whole chunk read once)."""
        with self._lock:
            raw = self._cache.get(cid)
            if raw is not None:
                self._cache.move_to_end(cid)
                return raw
        raw = self.decode_entry(self.entry(cid, checkpoint=checkpoint, item=item), checkpoint=checkpoint,
                                item=item)
        if keep:
            self._remember(cid, raw)
        return raw

    def decode_entry(self, entry: PackEntry, *, checkpoint=None, item=None):
        """Decoded, verified bytes of the chunk at ``entry`` (a specific copy, e.g. from a pack table)."""
        base = None
        if entry.codec == codec.DELTA:
            base = self._get_base(entry, checkpoint=checkpoint, item=item)
        return self._decode(entry, base, checkpoint=checkpoint, item=item)

    def _get_base(self, entry: PackEntry, *, checkpoint, item):
        base_hex = entry.base_id.hex() if entry.base_id else None
        if entry.base_id is None:
            raise CorruptChunkError("delta chunk has no base", chunk_id=entry.chunk_id.hex(), pack=entry.pack,
                                    checkpoint=checkpoint, item=item)
        try:
            base_entry = self.entry(entry.base_id, checkpoint=checkpoint, item=item)
            if base_entry.codec == codec.DELTA:
                raise CorruptChunkError("delta base is itself a delta", chunk_id=base_hex, pack=base_entry.pack)
            # Not cached: a base serves the one delta at its place, and a load touches it once.
            return self.get(entry.base_id, checkpoint=checkpoint, item=item, keep=False)
        except (CorruptChunkError, MissingChunkError) as e:
            raise CorruptChunkError(f"base of delta chunk is unreadable ({e})", chunk_id=entry.chunk_id.hex(),
                                    base_chunk_id=base_hex, pack=entry.pack, checkpoint=checkpoint,
                                    item=item) from e

    def _decode(self, entry: PackEntry, base, *, checkpoint, item):
        where = dict(chunk_id=entry.chunk_id.hex(), pack=entry.pack, checkpoint=checkpoint, item=item)
        try:
            buf = self.store.backend.get_range(pack_key(entry.pack), entry.offset, entry.span)
        except FileNotFoundError:
            raise CorruptChunkError("pack is missing", **where) from None
        if len(buf) != entry.span:
            raise CorruptChunkError("pack is truncated", **where)
        try:
            cid, cod, es, rlen, slen, base_id, _age = decode_header(buf, f"pack {entry.pack}")
        except ManifestFormatError as e:
            raise CorruptChunkError(f"damaged entry header ({e})", **where) from None
        if (cid, cod, es, rlen, slen, base_id) != (entry.chunk_id, entry.codec, entry.elem_size, entry.raw_len,
                                                  entry.stored_len, entry.base_id):
            raise CorruptChunkError("entry header disagrees with the index", **where)
        try:
            raw = codec.decode(cod, memoryview(buf)[64:], rlen, es, base)
        except ValueError as e:
            raise CorruptChunkError(f"cannot decode ({e})", **where) from None
        if chunk_id_of(raw) != entry.chunk_id:
            raise CorruptChunkError("chunk bytes do not match their hash", **where)
        return raw

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
        self.num_threads = num_threads or max(1, min(8, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._starts: dict[str, list[int]] = {}

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

    def read(self, key: str, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of item ``key`` as a new uint8 array."""
        item = self.item(key)
        if length is None:
            length = item.nbytes - offset
        out = np.empty(length, dtype=np.uint8)
        self.read_into(key, out, offset)
        return out

    def read_into(self, key: str, out, offset: int = 0) -> None:
        """Fill the writable buffer ``out`` with item ``key``'s bytes starting at ``offset``."""
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
            return
        starts = self._ref_starts(item)
        first = bisect.bisect_right(starts, offset) - 1
        jobs = []
        i = first
        end = offset + length
        while i < len(item.chunks) and starts[i] < end:
            ref = item.chunks[i]
            lo = max(offset, starts[i])
            hi = min(end, starts[i] + ref.length)
            jobs.append((ref, ref.skip + lo - starts[i], lo - offset, hi - lo))
            i += 1
        if len(jobs) == 1:
            self._copy(item, dst, *jobs[0])
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="deltackpt-read")
        for fut in [self._pool.submit(self._copy, item, dst, *job) for job in jobs]:
            fut.result()

    def _copy(self, item: Item, dst: np.ndarray, ref, src_off: int, dst_off: int, n: int) -> None:
        # A read of a whole chunk is not cached: a full load touches each chunk once. Partial reads are
        # (resharded loads read one chunk from several read items).
        whole = ref.skip == 0 and src_off == 0 and n == ref.length
        raw = self.source.get(ref.id, checkpoint=self.name, item=item.key, keep=not whole)
        if src_off + n > len(raw):
            raise CorruptChunkError("chunk is shorter than the manifest says", chunk_id=ref.id.hex(),
                                    checkpoint=self.name, item=item.key)
        dst[dst_off : dst_off + n] = np.frombuffer(raw, dtype=np.uint8, count=n, offset=src_off)

    def read_all(self) -> dict[str, np.ndarray]:
        return {key: self.read(key) for key in self.items}

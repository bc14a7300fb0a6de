"""The write path of one process: chunk -> hash -> dedup -> encode -> pack.

A :class:`ChunkWriter` takes the items of one save (arrays and byte strings) and writes every chunk the
store does not have yet into packs of its own. The caller hashes each batch of spans and looks it up in the
index (a few ms for 83 MiB), so chunks the store holds never wake a coding thread; the rest are coded in a
thread pool (zstd and the native kernels release the GIL); a cap on in-flight bytes keeps memory bounded
for any checkpoint size. The writer decides what to save (dedup claims, slices of the parent) and codes each new
chunk as its :class:`~.deltapolicy.DeltaPolicy` says (a delta or a keyframe); coded chunks go to its
:class:`~.packsink.PackSink`, which builds, seals and publishes the packs.
Nothing becomes visible until :meth:`Store.commit` writes the manifest. A writer that fails (or is aborted)
removes its spool files; the packs it published stay (another writer may already rely on them, see
:mod:`.packsink`; the failed writer indexes them, so a retry reuses their chunks), and so do those of a
killed process: unreferenced packs, which ``gc`` removes.

Several processes (DCP ranks) each run their own writer; their packs never collide because a pack is named
by the hash of its bytes.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import compress

import numpy as np

from ..errors import DeltackptError
from . import codec
from . import hashahead
from .chunking import as_byte_view, cdc_spans, chunk_ids_of, grid_spans
from .config import CHAINS_FEATURE, chain_limit
from .deltapolicy import DeltaBase, DeltaPolicy
from .records import NO_BASE_VOID
from .manifest import ChunkRef, Item, Manifest
from .pack import PackEntry
from .packsink import PackSink
from .parentmap import Extent, ParentMap
from .reindex import pack_names_bytes
from .source import ChunkSource
from .threads import InlineExecutor, default_write_threads

MiB = 1 << 20
BATCH_BYTES = 1 * MiB  # spans are submitted for coding in batches of at least this many bytes (or the last)
INLINE_CHUNK_BYTES = 64 * 1024  # a batch whose spans average fewer bytes is coded in the caller's thread


@dataclass
class WriteSummary:
    """What one writer added to the store."""

    items: list[Item]
    entries: list[PackEntry] = field(default_factory=list)
    packs: dict[str, int] = field(default_factory=dict)  # pack name -> size in bytes
    # Every other pack the items' refs rely on: where the indexed chunks it reused (and their delta bases) and
    # the keyframes its new deltas build on were found. Store.commit(checked_packs=) checks just these exist.
    reused_packs: set[str] = field(default_factory=set)

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

    def __init__(self, store, *, parent: Manifest | ParentMap | None = None, num_threads: int | None = None,
                 max_inflight_bytes: int | None = None, parent_packs: frozenset[str] | None = None):
        """``parent``: the previous checkpoint (its manifest, or the part of its map this writer's items
        cover), whose chunks are delta bases and are reused by slice when boundaries moved. ``parent_packs``:
        packs that held every chunk ``parent`` references, and their delta bases, when it was committed; while
        the index still holds them all, a chunk of the parent is reused without an index look-up, and those
        packs join ``reused_packs`` (the commit checks they still exist)."""
        self.store = store
        if CHAINS_FEATURE not in store.config.features:
            store.refresh_config()  # another process may have added chains: claims check them to that depth
        store.ensure_features()  # the format gate: an older reader refuses what this writer may produce
        self.config = store.config
        self.parent = parent if isinstance(parent, ParentMap) else ParentMap(parent)
        self._source = ChunkSource(store)
        self._cache = store.base_cache
        self._cache.new_generation()
        self._policy = DeltaPolicy(store)
        self._chain_limit = chain_limit(store.config)
        self._cache.note_use()
        self.num_threads = num_threads or default_write_threads()
        self.max_inflight_bytes = max_inflight_bytes or max(64 * MiB,
                                                            4 * self.num_threads * self.config.chunk_size_bytes)
        # One coding thread is no thread: a pool of one costs hand-offs and GIL switches with the caller
        # (one rank's 22 MiB shard saved with 1 coding thread: 0.095-0.104 s in a pool, 0.085-0.090 inline).
        self._pool = (ThreadPoolExecutor(self.num_threads, thread_name_prefix="deltackpt-write")
                      if self.num_threads > 1 else InlineExecutor())
        self._inline = InlineExecutor()
        self._lock = threading.Lock()
        self._claimed: set[bytes] = set()
        self._reused_packs: set[str] = set()  # see WriteSummary.reused_packs
        # A pack the index dropped since (lost, or gc moved its chunks): its chunks are looked up, and rewritten
        # if gone.
        # A pack a read found damaged: nothing in it is reused or built upon (ChunkIndex.damaged_packs).
        self._damaged = store.index.damaged_packs(refresh=True)  # a verify elsewhere may have marked one
        trusted = self.parent and parent_packs and not parent_packs & self._damaged
        self._parent_packs = parent_packs if trusted and store.index.indexes_packs(parent_packs) else None
        self._failed: BaseException | None = None  # the first coding job's (or upload's) error: stop queueing
        self._sink = PackSink(store, on_error=self._note_failure)
        self._inflight = 0
        self._cond = threading.Condition()
        # (item skeleton, a slot per piece: [batch future -> list of refs per piece, index]); a piece is a run
        # of one item's spans in one batch. The tasks' memoryviews keep each source buffer alive only until
        # its chunks are coded, so a GPU->CPU copy is freed as soon as it is written.
        self._pending: list[tuple[Item, list[list]]] = []
        # Spans are submitted in batches of about BATCH_BYTES: a large span alone, a model's many small ones
        # (biases, norms) together rather than one pool hand-off each.
        # (view, spans, elem_size, group, global offset, (array, first span, end span) in the HashAhead or None)
        self._batch: list[tuple[memoryview, list[tuple[int, int]], int, str | None, int, tuple | None]] = []
        self._batch_bytes = 0
        self._batch_slots: list[list] = []
        self._finished = False
        self._ahead: hashahead.HashAhead | None = None  # see hash_ahead
        self._ahead_arrays: list[tuple[object, int, memoryview, list]] = []
        self._ahead_next = 0

    # -- public ------------------------------------------------------------------------------------------
    def hash_ahead(self, arrays) -> None:
        """Start hashing, on another core, the chunks of the arrays :meth:`add_array` is given next, in this
        order: (data, global_offset) pairs; their bytes must not change until this writer finishes. A call
        of ``add_array`` with the next one's data (the same object) and offset takes its ids from there; any
        other array is hashed as it comes. Does nothing without the native kernel, for a few MiB, or twice."""
        if not hashahead.AVAILABLE or self._ahead is not None or self._finished:
            return
        chunk = self.config.chunk_size_bytes
        planned = []
        for data, offset in arrays:
            view = as_byte_view(data)
            planned.append((data, offset, view, grid_spans(offset, len(view), chunk)))
        if not planned or sum(len(view) for _d, _o, view, _s in planned) < hashahead.MIN_AHEAD_BYTES:
            return
        self._ahead = hashahead.HashAhead([(view, spans) for _d, _o, view, spans in planned])
        self._ahead_arrays = planned

    def add_array(self, key: str, data, *, dtype: str, elem_size: int, shape=(), group: str = "",
                  global_offset: int = 0) -> None:
        """Queue an array item. ``global_offset`` is its byte offset inside ``group`` (a global tensor)."""
        if elem_size not in codec.VALID_ELEM_SIZES:
            raise ValueError(f"elem_size must be one of {codec.VALID_ELEM_SIZES}, got {elem_size}")
        if global_offset < 0 or global_offset % elem_size:
            raise ValueError(f"global_offset must be a non-negative multiple of elem_size, got {global_offset}")
        ahead = None
        k = self._ahead_next
        if k < len(self._ahead_arrays) and self._ahead_arrays[k][0] is data and self._ahead_arrays[k][1] == global_offset:
            _data, _offset, view, spans = self._ahead_arrays[k]  # hashed ahead: the same bytes, the same spans
            self._ahead_next, ahead = k + 1, k
        else:
            view = as_byte_view(data)
            spans = grid_spans(global_offset, len(view), self.config.chunk_size_bytes)
        item = Item(key=key, kind="array", nbytes=len(view), chunks=[], dtype=dtype, elem_size=elem_size,
                    shape=[int(d) for d in shape], group=group if group != key else "",
                    global_offset=global_offset)
        self._queue(item, view, spans, elem_size, item.group_name, global_offset, ahead)

    def add_bytes(self, key: str, data) -> None:
        """Queue an opaque byte item (cut with FastCDC)."""
        view = as_byte_view(data)
        c = self.config
        spans = cdc_spans(view, c.cdc_min_bytes, c.cdc_avg_bytes, c.cdc_max_bytes)
        self._queue(Item(key=key, kind="bytes", nbytes=len(view), chunks=[]), view, spans, 1, None, 0, None)

    def finish(self) -> WriteSummary:
        """Wait for every chunk, seal the last pack, and return the items and new pack entries.

        On failure (a full disk, an interrupt) it cleans up as :meth:`abort` does before raising."""
        if self._finished:
            raise RuntimeError("ChunkWriter.finish() was already called")
        self._finished = True
        done = False
        try:
            self._submit_batch()
            items = []
            batches: dict[Future, list] = {}  # a batch's result, fetched once for all its pieces
            for item, slots in self._pending:
                item.chunks = []
                for f, i in slots:
                    refs = batches.get(f)
                    if refs is None:
                        refs = batches[f] = f.result()
                    item.chunks.extend(refs[i])
                items.append(item)
            self._sink.finish()
            done = True
            return WriteSummary(items=items, entries=self._sink.entries, packs=self._sink.packs,
                                reused_packs=self._reused_packs - self._sink.packs.keys())
        finally:
            self._pending.clear()
            self._stop_hashing()
            self._pool.shutdown(wait=True, cancel_futures=True)
            if done:
                self._sink.close()
            else:
                self._sink.abort()
                self._index_published()

    def abort(self) -> None:
        """Stop, drop everything queued, and remove this writer's spool files (also right after :meth:`finish`
        when the commit failed). Published packs are left to ``gc`` (see :mod:`.packsink`)."""
        self._finished = True
        self._stop_hashing()
        self._pool.shutdown(wait=True, cancel_futures=True)  # running jobs may still publish a pack
        self._pending.clear()
        self._sink.abort()
        self._index_published()

    def _stop_hashing(self) -> None:
        """Stop the HashAhead thread (done by now, unless this writer failed) and let go of its views."""
        if self._ahead is not None:
            self._ahead.close()
        self._ahead_arrays = []

    def _index_published(self) -> None:
        """Index the packs this failed writer published (they stay, for gc): a retry deduplicates against them
        instead of writing their chunks again, which on a full disk would fail again for want of the space
        they hold. Only packs still there are indexed (checked in the index's transaction)."""
        if not self._sink.packs:
            return
        try:
            self.store.index.add(self._sink.entries, dict(self._sink.packs), if_present=True)
        except Exception:  # noqa: BLE001 - a cache write (on a full disk, say) never hides the save's own error
            pass

    # -- internals ---------------------------------------------------------------------------------------
    def _queue(self, item: Item, view: memoryview, spans, elem_size: int, group, global_offset,
               ahead: int | None) -> None:
        """``ahead``: the array's index in the HashAhead, None when it was not hashed ahead."""
        if self._finished:
            raise RuntimeError("ChunkWriter is finished")
        if len(spans) == 1:  # one span (most items: biases, norms, adapters), a piece of the open batch as is
            if self._failed is not None:
                raise self._failed
            slot = [None, len(self._batch)]
            self._pending.append((item, [slot]))
            self._batch.append((view, spans, elem_size, group, global_offset, None if ahead is None else (ahead, 0, 1)))
            self._batch_slots.append(slot)
            self._batch_bytes += spans[0][1] - spans[0][0]
            if self._batch_bytes >= BATCH_BYTES:
                self._submit_batch()
            return
        slots: list[list] = []
        self._pending.append((item, slots))
        ends = [e for _s, e in spans]
        i = 0
        while i < len(spans):
            if self._failed is not None:
                raise self._failed  # e.g. a full disk: coding the rest of the checkpoint would be wasted
            start = spans[i][0]
            # The spans that fill this batch up to BATCH_BYTES (a large span alone), or the rest of the item.
            j = bisect_left(ends, start + BATCH_BYTES - self._batch_bytes, i) + 1
            slot = [None, len(self._batch)]  # [the batch's future, this piece's index in it]
            self._batch.append((view, spans[i:j], elem_size, group, global_offset,
                                None if ahead is None else (ahead, i, min(j, len(spans)))))
            self._batch_slots.append(slot)
            slots.append(slot)
            self._batch_bytes += ends[min(j, len(spans)) - 1] - start
            if self._batch_bytes >= BATCH_BYTES:
                self._submit_batch()
            i = j

    def _submit_batch(self) -> None:
        """Hash the spans gathered so far and look them up here, in the caller: pieces the store already
        holds (a frozen base, an unchanged tensor) become refs without waking a coding thread (a fine-tune's
        first save after its base: 357 tensors, nearly all known, 0.094 s when each batch went through the
        pool). The rest go to the pool as one job; the slots learn the batch's future."""
        if not self._batch:
            return
        batch, slots = self._batch, self._batch_slots
        self._batch, self._batch_slots, self._batch_bytes = [], [], 0
        ids = [chunk_ids_of(view, spans) if ahead is None else self._ahead.ids(*ahead)
               for view, spans, _es, _group, _goff, ahead in batch]
        wanted = {cid for piece in ids for cid in piece}
        known = self._parent_ids(batch, wanted)
        rest = wanted - known if known else wanted
        reusable = self._reusable(rest) | known if rest else known
        out: list[list[ChunkRef] | None] = [
            [ChunkRef(cid, e - s) for (s, e), cid in zip(spans, piece)] if reusable.issuperset(piece) else None
            for (_view, spans, *_), piece in zip(batch, ids)]
        todo = [k for k, refs in enumerate(out) if refs is None]
        if not todo:
            fut: Future = Future()
            fut.set_result(out)
        else:
            n = sum(batch[k][1][-1][1] - batch[k][1][0][0] for k in todo)
            spans = sum(len(batch[k][1]) for k in todo)
            # Small chunks are coded here: their cost is Python's, under the GIL, so a coding thread only
            # contends with this one (a fine-tune's 201 new 12-36 KiB chunks: 0.049 s saves in the pool,
            # 0.045 s inline, and 20 % less CPU). Large chunks' zstd runs without the GIL, in the pool.
            pool = self._inline if n < INLINE_CHUNK_BYTES * spans else self._pool
            # Reserved per batch, not per span: a lock round trip per 8 KiB span cost a third of a 1 % save.
            self._reserve(n)
            try:
                fut = pool.submit(lambda: self._write_pieces(batch, ids, reusable, out, todo))
            except BaseException:
                self._release(n)
                raise
            fut.add_done_callback(lambda f: self._job_done(f, n))
        for slot in slots:
            slot[0] = fut

    def _reserve(self, n: int) -> None:
        """Wait until ``n`` more bytes fit under ``max_inflight_bytes`` (a batch alone always fits)."""
        with self._cond:
            while self._inflight and self._inflight + n > self.max_inflight_bytes:
                self._cond.wait()
            self._inflight += n

    def _release(self, n: int) -> None:
        with self._cond:
            self._inflight -= n
            self._cond.notify_all()

    def _job_done(self, fut: Future, n: int) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._note_failure(fut.exception())
        self._release(n)

    def _note_failure(self, error: BaseException) -> None:
        if self._failed is None:
            self._failed = error

    def _write_pieces(self, batch, ids, reusable: set[bytes], out: list, todo: list[int]) -> list[list[ChunkRef]]:
        """Fill ``out`` (refs per piece of a batch) at the pieces ``todo``, which hold chunks to write."""
        for k in todo:
            view, spans, elem_size, group, goff, _ahead = batch[k]
            refs = []
            for (s, e), cid in zip(spans, ids[k]):
                if cid in reusable:
                    refs.append(ChunkRef(cid, e - s))
                else:
                    refs.extend(self._write_span(view[s:e], elem_size, group, goff + s, cid))
            out[k] = refs
        return out

    def _write_span(self, view: memoryview, elem_size: int, group: str | None, gstart: int,
                    cid: bytes) -> list[ChunkRef]:
        """Refs for one span the index has no restorable copy of: a chunk another span of this save claimed,
        slices of the parent's chunks, or a new chunk."""
        n = len(view)
        with self._lock:
            if cid in self._claimed:
                return [ChunkRef(cid, n)]
        base = None
        if group is not None and self.parent:
            same = self.parent.exact(group, gstart, gstart + n)
            # One look-up of the parent's chunk serves both questions: is it a slice, and what is its base.
            entry = None if same is None or same.skip else self.store.index.lookup(same.chunk_id)
            if same is None or same.skip or (entry is not None and entry.raw_len != n):
                # Boundaries moved (resharding), or the parent held these bytes as a slice of a larger chunk
                # (its own save was resharded): reuse slices of the parent's chunks if the bytes are equal.
                cover = self.parent.covering(group, gstart, gstart + n)
                if cover:
                    refs = self._match_parent(view, gstart, cover)
                    if refs is not None:
                        return refs
            elif entry is not None and self._policy.may_delta(n):
                base = self._policy.base_for(same.chunk_id, n, entry)
        with self._lock:
            if cid in self._claimed:
                return [ChunkRef(cid, n)]
            self._claimed.add(cid)
        self._store_chunk(cid, view, elem_size, base, is_array=group is not None)
        return [ChunkRef(cid, n)]

    def _parent_ids(self, batch, wanted: set[bytes]) -> set[bytes]:
        """The ones of ``wanted`` the parent references near the batch's pieces, when the packs that held them
        at the parent's commit are known (``parent_packs``): restorable as they were then, unless a pack is
        gone, which the commit's check of those packs finds (and then looks every chunk up)."""
        if not self._parent_packs:
            return set()
        near = set()
        for _view, spans, _es, group, goff, _ahead in batch:
            if group is not None:
                near.update(self.parent.ids_near(group, goff + spans[0][0], goff + spans[-1][1]))
        known = wanted & near
        if known:
            self._note_reused(self._parent_packs)
        return known

    def _reusable(self, ids) -> set[bytes]:
        """Which of ``ids`` the store holds a restorable copy of to deduplicate against (a claim, which gc
        spares while this save holds its shared lock): indexed, and if a delta, every base down its chain
        indexed too, within the store's chain limit (a delta whose base is gone, e.g. with a lost pack, is
        written again rather than claimed). Bulk look-ups, one per chain level: chains.chain_entries and
        restorable in arrays, since every chunk of every save passes here. Their packs join
        :attr:`WriteSummary.reused_packs`: this look-up is the only one per chunk, the commit trusts it (a
        chunk of the parent skips it when ``parent_packs`` is known: :meth:`_parent_ids`)."""
        index = self.store.index
        found, recs = index.lookup_records(ids)
        ok = np.ones(len(found), bool)
        packs = [recs["pack"]]
        owners = [None]  # per level of the chains: the chunks (positions in found) its packs are for
        pending = np.flatnonzero(recs["base"] != NO_BASE_VOID)  # chunks whose chain is not yet followed
        bases = recs["base"][pending]
        for _ in range(self._chain_limit):
            if not len(pending):
                break
            raw = bases.tobytes()
            base_of = [raw[k:k + 16] for k in range(0, len(raw), 16)]
            have, base_recs = index.lookup_records(set(base_of))
            at = {cid: i for i, cid in enumerate(have)}
            where = np.array([at.get(b, -1) for b in base_of], dtype=np.int64)
            ok[pending[where < 0]] = False
            pending, where = pending[where >= 0], where[where >= 0]
            packs.append(base_recs["pack"][where])
            owners.append(pending)
            bases = base_recs["base"][where]
            more = bases != NO_BASE_VOID
            pending, bases = pending[more], bases[more]
        ok[pending] = False  # a chain longer than the store allows: not restorable here
        if self._damaged:  # a copy (or a base) in a pack found damaged: written again, not reused
            bad = np.frombuffer(pack_names_bytes(self._damaged), dtype="<u8").reshape(-1, 2)
            for level, owner in zip(packs, owners):
                halves = np.ascontiguousarray(level).view("<u8").reshape(-1, 2)
                hit = np.zeros(len(halves), bool)
                for lo, hi in bad:  # a few marked packs: a pass each
                    hit |= (halves[:, 0] == lo) & (halves[:, 1] == hi)
                ok[np.flatnonzero(hit) if owner is None else owner[hit]] = False
        # The packs' names as a set of bytes first: np.unique sorted 16-byte voids (a fifth of this look-up).
        raw = b"".join(p.tobytes() for p in packs)
        self._note_reused({name.hex() for name in {raw[k:k + 16] for k in range(0, len(raw), 16)}})
        return set(found) if ok.all() else set(compress(found, ok))

    def _note_reused(self, packs) -> None:
        with self._lock:
            self._reused_packs.update(packs)

    def _match_parent(self, view: memoryview, gstart: int, cover: list[Extent]) -> list[ChunkRef] | None:
        """Slices of the parent's chunks equal to ``view``, or None if any byte differs."""
        gend = gstart + len(view)
        mine = np.frombuffer(view, dtype=np.uint8)
        # (parent chunk, offset in it, my bytes over it) for each piece of the cover
        pieces = [(e.chunk_id, e.skip + max(e.start, gstart) - e.start,
                   mine[max(e.start, gstart) - gstart:min(e.end, gend) - gstart]) for e in cover]
        # A few stored bytes of each parent chunk first: after a restart the data has usually changed, and
        # decoding the parent's chunks only to find that out would read the whole previous checkpoint.
        if any(self._source.differs(cid, skip, part) for cid, skip, part in pieces):
            return None
        refs = []
        for cid, skip, part in pieces:
            try:
                raw = self._source.get(cid)
            except DeltackptError:
                return None  # an unreadable parent chunk is never reused
            if skip + len(part) > len(raw):
                return None
            if not np.array_equal(np.frombuffer(raw, dtype=np.uint8, count=len(part), offset=skip), part):
                return None
            refs.append(ChunkRef(cid, len(part), skip))
        if len(self._reusable([r.id for r in refs])) < len({r.id for r in refs}):
            return None  # read through a location the index no longer holds: write the bytes anew
        return refs

    def _base_bytes(self, entry: PackEntry):
        raw = self._cache.get(entry.chunk_id)
        if raw is None:
            try:
                raw = self._source.get(entry.chunk_id, keep=False)  # used once, by this chunk's delta
            except DeltackptError:
                return None  # a damaged base is never built upon; the chunk becomes a keyframe
            self._cache.put(entry.chunk_id, raw)
        return raw

    def _store_chunk(self, cid: bytes, view: memoryview, elem_size: int, base: DeltaBase | None = None,
                     is_array=False) -> None:
        """Code and pack one new chunk: a delta against ``base`` when the policy says it pays, else a
        keyframe."""
        c = self.config
        n = len(view)
        cod, stored, base_id, age = None, None, None, 0
        if base is not None:
            base_raw = self._base_bytes(base.entry)
            pays, kind = self._policy.verdict(view, elem_size, base, base_raw)
            if pays is not False:  # True: delta expected; None: too close to call, code both ways
                delta = codec.encode_delta(view, base_raw, elem_size, c.zstd_level, kind, self._policy.zdelta_gain)
                keyframe_len = None
                if pays is None and not self._policy.accepts(len(delta), base, n):
                    cod, stored = codec.encode_best(view, elem_size, c.zstd_level, c.min_gain)
                    keyframe_len = len(stored)
                if self._policy.accepts(len(delta), base, n, keyframe_len):
                    cod, stored, base_id, age = kind, delta, base.entry.chunk_id, base.age
                    # every link's pack, not only the base's: the commit checks just these exist
                    self._note_reused(base.packs or (base.entry.pack,))
        if cod is None:
            cod, stored = codec.encode_best(view, elem_size, c.zstd_level, c.min_gain)
        depth = base.depth + 1 if codec.is_delta(cod) else 0
        if (depth < c.max_chain and self._policy.keeps_as_base(n, is_array)
                and (depth == 0 or self._policy.is_link(stored, n, elem_size))):
            self._cache.put(cid, view)  # the next save's base: a keyframe, or a delta a chain may grow from
        self._sink.add(cid, cod, elem_size, n, stored, base_id, age)

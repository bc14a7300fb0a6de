"""Decoded, verified chunks by id: the one place a chunk's stored bytes are read back and checked.

Every chunk read is verified: its decoded bytes must hash to its id, else :class:`CorruptChunkError`
names the chunk, its pack and (when known) the checkpoint and item. A delta chunk is decoded through its
base (and a chained base through the chunks down its chain, at most ``config.chain_limit(cfg)`` deltas,
to a keyframe; the links' own hashes are not checked: the delta's covers them, see ``_get_base``); damage in
the chain is reported with the delta's and its base's ids. Used by the read path
(:mod:`.reader`), the write path (slices of the parent, delta bases), ``verify`` and ``repair``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .. import kernels
from ..errors import CorruptChunkError, ManifestFormatError, MissingChunkError
from . import codec
from .chunking import chunk_id_of
from .config import CHAINS_FEATURE, MAX_CHAIN, chain_limit
from .pack import ENTRY_MAGIC, HEADER_DTYPE, HEADER_SIZE, PackEntry, decode_header, encode_header, pack_key
from .planebatch import decode_keyframes, rows_of

MiB = 1 << 20


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

    def __init__(self, store, cache_bytes: int = 64 * MiB, *, published_before: int | None = None) -> None:
        self.store = store
        self.cache_bytes = cache_bytes
        # The index's refreshes when every chunk this source will be asked for had been published (a reader's
        # manifest was read): a refresh begun since lists them all, so a miss after it need not list again.
        self.published_before = published_before
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()
        self._scratch = threading.local()

    def entry(self, cid: bytes, *, checkpoint=None, item=None) -> PackEntry:
        index = self.store.index
        gen = index.generation
        refreshes = index.refreshes if self.published_before is None else self.published_before
        entry = index.lookup(cid)
        if entry is None:
            self.store.refresh_index(since=refreshes)
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
        self._with_base(entry, checkpoint, item, fetched, lambda base: self._decode(
            entry, base, out, checkpoint=checkpoint, item=item, stored=_stored(fetched, entry)))
        return out

    def _with_base(self, entry: PackEntry, checkpoint, item, fetched, finish) -> None:
        """``finish(base)`` with the decoded base of ``entry`` (None for a keyframe), which checks ``entry``'s
        hash. A base decoded down a chain has not had its own hash checked (:meth:`_get_base`); when
        ``finish`` finds damage, the chain is decoded again link by link, each checked, to name a damaged
        link rather than the chunk above it."""
        if not codec.is_delta(entry.codec):
            finish(None)
            return
        base, checked = self._get_base(entry, checkpoint=checkpoint, item=item, fetched=fetched)
        try:
            finish(base)
        except CorruptChunkError:
            if not checked:
                self._get_base(entry, checkpoint=checkpoint, item=item, fetched=fetched, verify=True)
            raise

    def _buffer(self, name: str, n: int) -> np.ndarray:
        """This thread's scratch array ``name``, ``n`` bytes long (a new array past SCRATCH_MAX)."""
        return codec.scratch_array(self._scratch, name, n, min_size=4 * MiB, keep_max=self.SCRATCH_MAX)

    def _get_base(self, entry: PackEntry, *, checkpoint, item, fetched=None,
                  verify: bool = False) -> tuple[object, bool]:
        """(the base of delta ``entry``, whether its hash was checked): from the LRU (checked), else decoded
        (with the chunks down its chain, until a keyframe or a chunk the LRU holds) into this thread's
        scratch (valid until this thread decodes the next base). A chain longer than the store allows
        (``config.chain_limit``), or one that meets itself, is damage.

        Unless ``verify``, the chain's own hashes are not checked: each link's decode is a bijection of
        the bytes below it (XOR, or addition modulo 2^(8k)), so any damage below the top changes the top's
        bytes, and the top's hash check (the caller's) catches it. A delta whose planes are all zero-sparse
        is applied in place, at the cost of its nonzero bytes (:func:`codec.decode_onto`): a chain restores
        in about the time of its keyframe and its top delta. With ``verify`` every link is checked, in turn
        (:meth:`_with_base`, after the top failed its check: the error then names the damaged link)."""
        base_hex = entry.base_id.hex() if entry.base_id else None
        if entry.base_id is None:
            raise CorruptChunkError("delta chunk has no base", chunk_id=entry.chunk_id.hex(), pack=entry.pack,
                                    checkpoint=checkpoint, item=item)
        try:
            base = self._from_cache(entry.base_id)
            if base is not None:
                return base, True
            chain, below = self._chain_below(entry, checkpoint=checkpoint, item=item)
            links = chain[::-1]  # decoded from the bottom up, alternating two scratch buffers
            bufs = [self._buffer(name, links[0].raw_len) for name in ("base", "base2")]
            if below is None:  # the bottom is a keyframe
                below, bottom = bufs[0], links.pop(0)
                self._decode(bottom, None, below, checkpoint=checkpoint, item=item, verify=verify,
                             stored=_stored(fetched, bottom))
            for link in links:
                spare = bufs[1] if below is bufs[0] else bufs[0]
                if verify or (below is not bufs[0] and below is not bufs[1]):  # a base from the LRU: shared
                    self._decode(link, below, spare, checkpoint=checkpoint, item=item, verify=verify,
                                 stored=_stored(fetched, link))
                    below = spare
                else:
                    below = self._decode_onto(link, below, spare, checkpoint=checkpoint, item=item,
                                              stored=_stored(fetched, link))
            return below, verify
        except (CorruptChunkError, MissingChunkError) as e:
            raise CorruptChunkError(f"base of delta chunk is unreadable ({e})", chunk_id=entry.chunk_id.hex(),
                                    base_chunk_id=base_hex, pack=entry.pack, checkpoint=checkpoint,
                                    item=item) from e

    def _decode_onto(self, link: PackEntry, below: np.ndarray, spare: np.ndarray, *, checkpoint, item,
                     stored=None) -> np.ndarray:
        """Read delta ``link`` and decode it onto ``below`` (this thread's scratch) without checking its hash;
        returns ``below`` (changed in place) or ``spare``, whichever holds it (:func:`codec.decode_onto`)."""
        head, payload, n = self._read(link, spare, checkpoint, item, stored)
        self._check_header(link, head, n, checkpoint, item)
        try:
            return codec.decode_onto(link.codec, payload, link.raw_len, link.elem_size, below, spare,
                                     scratch=self._buffer("planes", link.raw_len))
        except ValueError as e:
            raise _damage(f"cannot decode ({e})", link, checkpoint, item) from None

    def _chain_below(self, entry: PackEntry, *, checkpoint, item) -> tuple[list[PackEntry], object]:
        """The entries down delta ``entry``'s chain to decode for its base (its base first), and the decoded
        bytes the last of them builds on: None when it is a keyframe, else a chunk from the LRU."""
        limit = chain_limit(self.store.config)
        chain, seen, below = [], {entry.chunk_id}, None
        cid = entry.base_id
        while True:
            if cid in seen:
                raise CorruptChunkError("delta chain meets itself (a cycle)", chunk_id=cid.hex())
            seen.add(cid)
            link = self.entry(cid, checkpoint=checkpoint, item=item)
            chain.append(link)
            if not codec.is_delta(link.codec):
                return chain, None
            if len(chain) >= limit and limit < MAX_CHAIN and CHAINS_FEATURE not in self.store.config.features:
                self.store.refresh_config()  # another process may have made this a chained store since
                limit = chain_limit(self.store.config)
            if len(chain) >= limit:
                raise CorruptChunkError(f"delta chain holds more than {limit} delta{'s' if limit > 1 else ''}"
                                        + ("" if limit > 1 else " (delta base is itself a delta)"),
                                        chunk_id=cid.hex(), pack=link.pack)
            if link.base_id is None:
                raise _damage("delta chunk has no base", link, checkpoint, item)
            below = self._from_cache(link.base_id)
            if below is not None:
                return chain, below
            cid = link.base_id

    def decode_read(self, entry: PackEntry, head, payload, n: int, out: np.ndarray, *, checkpoint=None, item=None,
                    fetched=None) -> None:
        """Check and decode the chunk at ``entry`` whose bytes the caller read itself (several chunks of a pack
        with one read): ``head`` its header, ``payload`` its stored bytes (for a raw chunk, ``out`` itself),
        ``n`` how many of the entry's bytes the read returned. A delta's base comes from the LRU, ``fetched``
        or its own read. Raises as :meth:`decode_entry` does."""
        self._with_base(entry, checkpoint, item, fetched,
                        lambda base: self._check(entry, head, payload, n, base, out, checkpoint, item))

    def check_reads(self, recs: np.ndarray, ids: bytes, heads, counts: list[int], buf: np.ndarray, at: np.ndarray,
                    outs: list) -> np.ndarray:
        """Which of several keyframes of one pack that the caller read itself check out, each as
        :meth:`decode_read` checks one (length read, header against the index, decoded into ``outs[i]``,
        hash), with no Python work per chunk: headers hashed, planes unshuffled into place and chunks hashed
        by a few native calls (``kernels.xxh3_64_rows``, ``kernels.unshuffle_check``; an 8 KiB chunk cost 15-30
        us one at a time, a load of small chunks many times the time of the same bytes in large ones).
        ``recs``: their index records (RECORD_DTYPE); ``ids``: their ids joined; ``heads``: their headers
        joined (C-contiguous); ``counts``: as decode_read's ``n``; ``buf``: a uint8 array holding their
        stored bytes, chunk i's at ``at[i]``; ``outs``: writable buffers of each chunk's ``raw_len`` (a raw
        chunk's bytes are copied there). A chunk that does not pass (a delta, damage, a header that differs
        only in its age) is left to decode_read, which decodes or names it: it raises nothing itself."""
        num = len(recs)
        codecs = recs["codec"]
        raw_len, stored_len = recs["raw_len"].astype(np.int64), recs["stored_len"].astype(np.int64)
        want = np.zeros(num, dtype=HEADER_DTYPE)
        want["magic"] = ENTRY_MAGIC
        for field in ("codec", "elem_size", "age", "raw_len", "stored_len", "base"):
            want[field] = recs[field]
        want["chunk_id"] = np.frombuffer(ids, dtype="V16")
        got = np.frombuffer(heads, dtype=HEADER_DTYPE, count=num)
        fields = HEADER_DTYPE.itemsize - 8  # the header's fields, then their hash
        digests = np.empty(num, dtype=np.uint64)
        kernels.xxh3_64_rows(heads, HEADER_SIZE, fields, digests)
        coded = codecs == codec.ZSTD
        ok = ((np.asarray(counts) == HEADER_SIZE + stored_len) & (digests == got["digest"])
              & (coded | (codecs == codec.RAW) & (stored_len == raw_len))
              & (got.view(np.uint8).reshape(num, -1)[:, :fields] == want.view(np.uint8).reshape(num, -1)[:, :fields]
                 ).all(axis=1))
        at = np.asarray(at, dtype=np.int64)
        verified = np.zeros(num, dtype=bool)

        plain = np.flatnonzero(ok & ~coded)
        if len(plain):  # a raw chunk: copied into place and hashed, as one plane
            passed = np.zeros(len(plain), dtype=np.uint8)
            src = np.stack([at[plain], at[plain] + raw_len[plain]], axis=1)
            kernels.unshuffle_check(buf, None, 1, np.ascontiguousarray(src), *rows_of(outs, ids, plain), passed)
            verified[plain] = passed.view(bool)
        todo = np.flatnonzero(ok & coded)
        if len(todo):
            verified[todo] = decode_keyframes(buf, at[todo], stored_len[todo], raw_len[todo], recs["elem_size"][todo],
                                              *rows_of(outs, ids, todo))
            rest = todo[~verified[todo]].tolist()  # left alone by the batch (e.g. a zero-sparse plane): one at a time
            if rest:
                bmv = memoryview(buf)
                planes = self._buffer("planes", int(raw_len[rest].max()))
                sizes, elem_sizes = raw_len.tolist(), recs["elem_size"].tolist()
                for i in rest:
                    try:
                        codec.decode(codec.ZSTD, bmv[at[i]:at[i] + stored_len[i]], sizes[i], elem_sizes[i],
                                     out=np.frombuffer(outs[i], dtype=np.uint8), scratch=planes[:sizes[i]])
                    except ValueError:
                        continue
                    verified[i] = chunk_id_of(outs[i]) == ids[16 * i:16 * i + 16]
        return ok & verified

    def _decode(self, entry: PackEntry, base, out: np.ndarray, *, checkpoint, item, stored=None,
                verify: bool = True) -> None:
        """Read the entry (:meth:`_read`), then :meth:`_check` it (its hash only with ``verify``)."""
        head, payload, n = self._read(entry, out, checkpoint, item, stored)
        self._check(entry, head, payload, n, base, out, checkpoint, item, verify)

    def _read(self, entry: PackEntry, out: np.ndarray, checkpoint, item, stored=None) -> tuple:
        """(header, payload, bytes of the entry read): from ``stored`` when given, else one ranged read (a raw
        payload straight into ``out``, a coded one into scratch)."""
        if entry.codec == codec.RAW and entry.stored_len != entry.raw_len:
            raise _damage("raw entry lengths disagree", entry, checkpoint, item)
        if stored is not None:
            stored = np.frombuffer(stored, dtype=np.uint8)
            head, payload, n = stored[:HEADER_SIZE], stored[HEADER_SIZE:], len(stored)
            if entry.codec == codec.RAW and n == entry.span:
                out[:] = payload
            return head, payload, n
        head = bytearray(HEADER_SIZE)
        payload = out if entry.codec == codec.RAW else self._buffer("stored", entry.stored_len)
        try:
            n = self.store.backend.get_range_into(pack_key(entry.pack), entry.offset, [head, payload])
        except FileNotFoundError:
            raise _damage("pack is missing", entry, checkpoint, item) from None
        return head, payload, n

    def _check(self, entry: PackEntry, head, payload, n: int, base, out: np.ndarray, checkpoint, item,
               verify: bool = True) -> None:
        """Check the header read (``n`` bytes of the entry in all) against the index, decode the payload into
        ``out`` (a raw one is already there) and, with ``verify``, check its hash."""
        self._check_header(entry, head, n, checkpoint, item)
        if entry.codec == codec.RAW:
            if entry.stored_len != entry.raw_len:
                raise _damage("raw entry lengths disagree", entry, checkpoint, item)
        else:
            try:
                codec.decode(entry.codec, payload, entry.raw_len, entry.elem_size, base, out=out,
                             scratch=self._buffer("planes", entry.raw_len))
            except ValueError as e:
                raise _damage(f"cannot decode ({e})", entry, checkpoint, item) from None
        if verify and chunk_id_of(out) != entry.chunk_id:
            raise _damage("chunk bytes do not match their hash", entry, checkpoint, item)

    def _check_header(self, entry: PackEntry, head, n: int, checkpoint, item) -> None:
        """Check an entry's header and length read (``n`` bytes in all) against the index."""
        if n != HEADER_SIZE + entry.stored_len:
            raise _damage("pack is truncated", entry, checkpoint, item)
        # The header the index's fields make, compared whole (0.3 us); only a mismatch is parsed (0.8 us), to
        # tell a damaged header from one that disagrees with the index or differs only in its age.
        expected = encode_header(entry.chunk_id, entry.codec, entry.elem_size, entry.raw_len, entry.stored_len,
                                 entry.base_id, entry.age)
        if bytes(head) != expected:
            try:
                cid, cod, es, rlen, slen, base_id, _age = decode_header(head, f"pack {entry.pack}")
            except ManifestFormatError as e:
                raise _damage(f"damaged entry header ({e})", entry, checkpoint, item) from None
            if (cid, cod, es, rlen, slen, base_id) != (entry.chunk_id, entry.codec, entry.elem_size,
                                                      entry.raw_len, entry.stored_len, entry.base_id):
                raise _damage("entry header disagrees with the index", entry, checkpoint, item)

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
        parts = [entry]  # a delta's planes are combined with its keyframe's
        if codec.is_delta(entry.codec):
            base = index.lookup(entry.base_id) if entry.base_id else None
            if base is None or codec.is_delta(base.codec) or base.elem_size != es or base.raw_len != entry.raw_len:
                return False
            parts.append(base)
        # A byte of a difference depends on the bytes below it, except the low 7 bits of the lowest (plane 0).
        planes = (0,) if entry.codec == codec.ZDELTA else range(es)
        try:
            # One read per entry: its container header and, when close behind it, the probed bytes of plane 0.
            heads = [self._head(e, first, count) for e in parts]
            for plane in planes:
                got = [self._plane_bytes(e, head, plane, first, count) for e, head in zip(parts, heads)]
                if all(g is not None for g in got):
                    want = mine[plane:plane + count * es:es]
                    if entry.codec == codec.ZDELTA:
                        z, base_low = got  # the low 7 bits of (base + unzigzag(z)) need z's plane 0 only
                        low = base_low + ((z >> 1) ^ np.negative(z & 1))
                        return not np.array_equal(low & 0x7F, want & 0x7F)
                    return not np.array_equal(np.bitwise_xor.reduce(got), want)
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


def _damage(message: str, entry: PackEntry, checkpoint, item) -> CorruptChunkError:
    return CorruptChunkError(message, chunk_id=entry.chunk_id.hex(), pack=entry.pack, checkpoint=checkpoint,
                             item=item)


def _stored(fetched: dict | None, entry: PackEntry):
    return fetched.get((entry.pack, entry.offset)) if fetched else None

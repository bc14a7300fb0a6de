"""A manifest's chunk ids read as a stream: what verify and gc need of a checkpoint, in bounded memory.

Read whole, a manifest costs the stored object, its decompressed body and an id per ref at once (~55 B a
ref). Here the object is read in ranges and hashed as they come (xxh3 streams), its zstd frame decompressed
a small piece at a time and walked in C (``kernels.walk_refs``): the ids go to a stage, the items (their refs
left out) to msgspec in batches against the manifest's own schema, the rest of the manifest (small) to msgspec
at the end, and every check of :func:`.manifest.decode_manifest_refs` is made. The caller adds the stage to
its set only when all of it passed (handing it over: it has room for every ref, untouched past the ids in it,
where the set can grow without being copied).

Only what the walk can prove canonical is read so. Anything else (damage, a form deltackpt does not write, a
read that fails) returns None, and the caller reads the manifest the general way, which then accepts it or
refuses it with its own error: this path never changes a decision or an error, it only spends less memory on
a good manifest (the parsers' differential fuzz tests hold the two to that).
"""

from __future__ import annotations

import msgspec
import numpy as np
import xxhash
import zstandard

from .. import kernels
from ..errors import InvalidNameError
from . import idset
from .manifest import MANIFEST_MAGIC, MANIFEST_VERSION, MAX_MANIFEST_BYTES, RefsItem, RefsManifest, item_problem, \
    validate_name

_FIRST_READ = 1 << 16  # a smaller manifest is read whole; a larger one in ~16 ranges (a request each)
_MAX_READ = 1 << 23
_FEED = 1 << 14  # compressed bytes given to zstd at once: each call's output stays small
_CARRY = 64  # more than a value the walker waits on to see whole (a ref: <= 37 bytes, a header: <= 10)
_IDS, _RECS, _ITEMS, _TOP = 1 << 12, 256, 1 << 13, 1 << 12  # the walker's outputs (ids, items, bytes; grown)
_HEADROOM = 16  # the walker writes a value's header (<= 10 bytes) and a nil whole, or waits for room
_TOP_AT, _ITEMS_AT, _ITEMS_END, _IDS_AT, _RECS_AT = range(5)
_FAILED, _NEED_INPUT, _FULL, _DONE = -1, 0, 1, 2
_ITEMS_DECODER = msgspec.msgpack.Decoder(list[RefsItem])
_TOP_DECODER = msgspec.msgpack.Decoder(RefsManifest)


class _Refused(Exception):
    """The stream cannot prove the manifest good: read it the general way."""


def stream_manifest_ids(backend, key: str, name: str, fresh, with_ends: bool = False) -> tuple | bytes | None:
    """``(buf, n)``: in ``buf[:n]`` the ids manifest ``key`` of checkpoint ``name`` references that ``fresh``
    keeps (``fresh(ids)``: those of a batch not known yet; it may return ``ids`` itself), in manifest order, all
    checks of read_manifest_refs made (``buf``: an array of its own with room past ``n``, never touched).
    ``with_ends``: ``(buf, n, ends)``, ``ends`` (uint32, as large as ``buf``) beside each id its ref's end
    (skip + length), and ``fresh(ids, ends)`` returns (ids, ends) of a batch. Else
    the manifest is to be read the general way: from these bytes, the whole object when it came in one small
    read (streaming it would cost more than it saves), or None (not the native kernels, damage, anything
    unusual)."""
    if kernels.walk_refs is None:
        return None
    try:
        return _Stream(name, fresh, with_ends).read(backend, key)
    except (_Refused, OSError, zstandard.ZstdError):
        return None


class _Stream:
    def __init__(self, name: str, fresh, with_ends: bool = False) -> None:
        self.name, self.fresh = name, fresh
        self.state = bytearray(kernels.WALKER_BYTES)
        self.top, self.items = bytearray(_TOP), bytearray(_ITEMS)
        self.ids = np.empty(_IDS, dtype=idset.ID)
        self.ends = np.empty(_IDS, dtype=np.uint32) if with_ends else None  # each ref's skip + length
        self.recs = np.empty((_RECS, 2), dtype=np.uint64)
        self.at = np.zeros(5, dtype=np.int64)
        self.tail = b""
        self.stage, self.staged = None, 0
        self.stage_ends = None
        self.dobj, self.declared, self.body_bytes, self.done = None, 0, 0, False
        self.keys: set[str] = set()  # item keys seen: one twice is refused, as the general read does

    def read(self, backend, key: str) -> tuple | bytes:
        buf = np.empty(_FIRST_READ, dtype=np.uint8)  # np.empty: a page is touched only when read into
        n = backend.get_range_into(key, 0, [buf])
        if n < _FIRST_READ:
            return buf[:n].tobytes()
        size = backend.size(key)
        first = bytes(buf[:32])
        if size < 13 or first[:4] != MANIFEST_MAGIC or first[4] != MANIFEST_VERSION:
            raise _Refused
        self._start(first, size - 13)
        digest, offset, last8 = xxhash.xxh3_64(), 0, b""
        while True:
            data = memoryview(buf)[:n]
            last8 = (last8 + bytes(data[-8:]))[-8:]  # the checksum may straddle two reads
            end = min(n, size - 8 - offset)  # the last 8 bytes are the checksum
            if end < 0 or not n:
                raise _Refused  # the object changed under us
            digest.update(data[:end])
            self._decompress(data[5:end] if offset == 0 else data[:end])
            offset += n
            if offset >= size:
                break
            if offset == n:
                del data, buf  # the first buffer freed before the one reused for the rest is made
                buf = np.empty(min(max(_FIRST_READ, size // 16), _MAX_READ), dtype=np.uint8)
            n = backend.get_range_into(key, offset, [buf])
        if offset != size or digest.intdigest() != int.from_bytes(last8, "little"):
            raise _Refused
        return self._finish()

    def _start(self, first: bytes, frame_bytes: int) -> None:
        """Check the frame's declared size as decode_manifest does (it bounds the refs: 20 bytes each at least)."""
        declared = zstandard.frame_content_size(first[5:5 + min(18, frame_bytes)])  # a header is <= 18 bytes
        if not (0 <= declared <= MAX_MANIFEST_BYTES) or declared > 1024 * frame_bytes + (1 << 20):
            raise _Refused
        self.declared = declared
        self.dobj = zstandard.ZstdDecompressor().decompressobj()
        self.stage = np.empty(0, dtype=idset.ID)
        self.stage_ends = None if self.ends is None else np.empty(0, dtype=np.uint32)

    def _decompress(self, view: memoryview) -> None:
        for start in range(0, len(view), _FEED):
            if self.dobj.eof:
                return  # bytes after the frame: hashed, never read (as decode_manifest ignores them)
            body = self.dobj.decompress(view[start:start + _FEED])
            self.body_bytes += len(body)
            if self.body_bytes > self.declared:
                raise _Refused
            if body:
                self._walk(body)

    def _walk(self, piece: bytes) -> None:
        if self.tail:  # the value cut at the end of the last piece, finished with a few bytes of this one
            tail, self.tail = self.tail, b""
            head = tail + piece[:_CARRY]
            used = self._walk_view(memoryview(head))
            if len(piece) <= _CARRY:
                self.tail = head[used:]
                return
            piece = memoryview(piece)[max(used - len(tail), 0):]
        used = self._walk_view(memoryview(piece))
        self.tail = bytes(piece[used:])

    def _walk_view(self, view: memoryview) -> int:
        """Walk ``view`` as far as it holds whole values; the bytes used."""
        done = 0
        while True:
            status, used = kernels.walk_refs(self.state, view[done:], self.top, self.items, self.ids, self.recs,
                                             self.at, self.ends)
            done += used
            if status == _FAILED:
                raise _Refused
            if status == _DONE:
                self.done = True
            if status != _FULL:
                return done
            self._drain()

    def _drain(self) -> None:
        """Empty the walker's outputs (or grow one an unbroken value fills)."""
        at = self.at
        if at[_IDS_AT]:
            batch = self.ids[:at[_IDS_AT]]
            if self.ends is None:
                new, new_ends = self.fresh(batch), None
            else:
                new, new_ends = self.fresh(batch, self.ends[:at[_IDS_AT]])
            if self.staged + new.size > self.stage.size:
                self._grow(self.staged + new.size, all_new=new is batch)
            self.stage[self.staged:self.staged + new.size] = new
            if new_ends is not None:
                self.stage_ends[self.staged:self.staged + new.size] = new_ends
            self.staged += new.size
            at[_IDS_AT] = 0
        if at[_RECS_AT]:
            self._check_items()
        elif len(self.items) - at[_ITEMS_AT] < _HEADROOM:
            self.items.extend(bytes(len(self.items)))  # one item longer than the buffer
        if len(self.top) - at[_TOP_AT] < _HEADROOM:
            self.top.extend(bytes(len(self.top)))

    def _grow(self, need: int, all_new: bool) -> None:
        """Room in the stage for ``need`` ids: for every ref at once if the first batch was all new (likely the
        whole manifest: pages never written are never touched), else doubling (most ids are known)."""
        most = self.declared // 20  # a ref takes 20 bytes or more
        if need > most:
            raise _Refused
        size = most if all_new and not self.staged else min(most, max(need, 2 * self.stage.size, 1 << 12))
        stage = np.empty(size, dtype=idset.ID)  # not resize(): it writes zeros over the room, touching it all
        stage[:self.staged] = self.stage[:self.staged]
        self.stage = stage
        if self.stage_ends is not None:
            ends = np.empty(size, dtype=np.uint32)
            ends[:self.staged] = self.stage_ends[:self.staged]
            self.stage_ends = ends

    def _check_items(self) -> None:
        """Decode the whole items in the buffer against the schema and check each (their refs were walked)."""
        at, n, end = self.at, int(self.at[_RECS_AT]), int(self.at[_ITEMS_END])
        try:
            items = _ITEMS_DECODER.decode(b"\xdd" + n.to_bytes(4, "big") + self.items[:end])
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            raise _Refused from None
        if len(items) != n:
            raise _Refused
        for it, total in zip(items, self.recs[:n, 1].tolist()):
            if bytes(it.chunks) != b"\xc0" or item_problem(it, total) or it.key in self.keys:
                raise _Refused
            self.keys.add(it.key)
        rest = int(at[_ITEMS_AT]) - end
        self.items[:rest] = self.items[end:end + rest]
        at[_ITEMS_AT], at[_ITEMS_END], at[_RECS_AT] = rest, 0, 0

    def _finish(self) -> tuple:
        if not (self.done and self.dobj.eof and not self.tail and self.body_bytes == self.declared):
            raise _Refused
        self._drain()
        try:
            m = _TOP_DECODER.decode(self.top[:self.at[_TOP_AT]])
            validate_name(m.name)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, InvalidNameError):
            raise _Refused from None
        if m.items or m.name != self.name or m.format_version != MANIFEST_VERSION:
            raise _Refused
        stage, self.stage = self.stage, None
        if self.stage_ends is None:
            return stage, self.staged
        ends, self.stage_ends = self.stage_ends, None
        return stage, self.staged, ends

"""The index cache's record of one chunk: where its stored bytes are (pack, offset, lengths), how they are
coded, and its delta base. One at a time as a PackEntry, or a batch at once as a numpy array (RECORD_DTYPE)
held to the same rules, so a save or a load of many chunks builds no object per chunk."""

from __future__ import annotations

import struct
from itertools import islice
from dataclasses import dataclass

import numpy as np

from . import idset

from ..errors import ManifestFormatError
from .codec import CODEC_NAMES, DELTA_CODECS, VALID_ELEM_SIZES, is_delta
from .pack import MAX_CHUNK_BYTES, PackEntry, _check_fields

_RECORD = struct.Struct("<16sQQQBB16sH")  # pack, offset, stored len, raw len, codec, elem size, base, age
_NO_BASE = bytes(16)
RECORD_SIZE = _RECORD.size
RECORD_DTYPE = np.dtype([("pack", "V16"), ("offset", "<u8"), ("stored_len", "<u8"), ("raw_len", "<u8"),
                         ("codec", "u1"), ("elem_size", "u1"), ("base", "V16"), ("age", "<u2")])
assert RECORD_DTYPE.itemsize == _RECORD.size
NO_BASE_VOID = np.void(_NO_BASE)
# Per u1 value: a known codec / element size / delta codec (table look-ups: np.isin took 3 x 15 us a batch).
_KNOWN_CODEC, _VALID_ELEM, _IS_DELTA = (np.isin(np.arange(256), list(v)) for v in
                                        (CODEC_NAMES, VALID_ELEM_SIZES, DELTA_CODECS))


def is_delta_codec(codecs: np.ndarray) -> np.ndarray:
    """A bool per codec id (u1): whether it is a delta's."""
    return _IS_DELTA[codecs]


def encode_record(e: PackEntry) -> bytes:
    return _RECORD.pack(bytes.fromhex(e.pack), e.offset, e.stored_len, e.raw_len, e.codec, e.elem_size,
                        e.base_id or _NO_BASE, e.age)


def records_of(table) -> np.ndarray:
    """The index records (RECORD_DTYPE) of a :class:`~.pack.PackTable`'s entries: what :func:`encode_record`
    makes of each, in one pass."""
    rows = table.rows
    out = np.empty(len(rows), dtype=RECORD_DTYPE)
    out["pack"] = np.void(bytes.fromhex(table.name))
    for field in ("offset", "stored_len", "raw_len", "codec", "elem_size", "age"):
        out[field] = rows[field]
    out["base"] = rows["base_id"]  # NO_BASE where no delta, as encode_record writes it
    return out


def decode_record(chunk_id: bytes, rec: bytes) -> PackEntry:
    if len(rec) != _RECORD.size:
        raise ManifestFormatError(f"index record for chunk {chunk_id.hex()} has {len(rec)} bytes")
    pack, off, slen, rlen, codec, es, base, age = _RECORD.unpack(rec)
    _check_fields(codec, es, rlen, slen, f"index record for chunk {chunk_id.hex()} is malformed")
    if is_delta(codec) != (base != _NO_BASE):
        raise ManifestFormatError(f"index record for chunk {chunk_id.hex()} is malformed")
    return PackEntry(chunk_id, pack.hex(), off, slen, rlen, codec, es, None if base == _NO_BASE else base, age)


def check_record_array(chunk_ids, recs: np.ndarray, found: np.ndarray | None = None) -> None:
    """Raise ManifestFormatError naming the first of ``recs`` (those where ``found``) that decode_record would
    refuse: the same rules, checked in arrays."""
    bad = malformed(recs)
    if found is not None:
        bad &= found
    if bad.any():
        cid = chunk_ids[int(np.argmax(bad))]
        raise ManifestFormatError(f"index record for chunk {bytes(cid).hex()} is malformed")


def malformed(recs: np.ndarray) -> np.ndarray:
    """A bool per record of ``recs`` (RECORD_DTYPE): whether decode_record would refuse it."""
    codecs, sizes = recs["codec"], recs["elem_size"]
    return (~_KNOWN_CODEC[codecs] | ~_VALID_ELEM[sizes]
            | (_IS_DELTA[codecs] != (recs["base"] != NO_BASE_VOID))
            | (recs["raw_len"] > MAX_CHUNK_BYTES) | (recs["stored_len"] > MAX_CHUNK_BYTES + (1 << 20)))


def decode_records(chunk_ids: list[bytes], recs: list[bytes]) -> np.ndarray:
    """The records of ``chunk_ids`` as one RECORD_DTYPE array, held to decode_record's rules; the first
    malformed record is named."""
    try:
        if any(len(r) != RECORD_SIZE for r in recs):
            raise ManifestFormatError("an index record has the wrong size")
        arr = np.frombuffer(b"".join(recs), RECORD_DTYPE)
        check_record_array(chunk_ids, arr)
        return arr
    except ManifestFormatError:
        _name_first_bad(chunk_ids, recs)
        raise


def _name_first_bad(chunk_ids, recs) -> None:
    """Raise decode_record's error for the first malformed one of ``recs`` (None: not indexed, skipped)."""
    for cid, rec in zip(chunk_ids, recs):
        if rec is not None:
            decode_record(bytes(cid), bytes(rec))


@dataclass
class Located:
    """Where the index locates a batch of chunks (see :func:`locate_in`), in arrays."""

    packs: list[str]  # the packs named, numbered by position
    pack_of: np.ndarray  # int32 per chunk: its pack's number, -1 when not indexed
    delta_at: np.ndarray  # int32: positions of the chunks stored as deltas
    delta_base: np.ndarray  # V16: the base of each of those deltas
    raw_len: np.ndarray | None = None  # uint32 per chunk: its decoded size, 0 when not indexed


class RecordSnapshot:
    """What the index held for each of a sorted set of chunks at one moment (right after a reconcile wrote
    it: every chunk the pack tables hold), as arrays: located with a vectorised search instead of a B-tree
    look-up each (1.2M chunks: ~1.1 s of LMDB gets). A chunk it lacks (its pack published since) is looked
    up with ``fallback`` (e.g. ``ChunkIndex.locate``). 41 bytes a chunk."""

    def __init__(self, ids: np.ndarray, base: np.ndarray, delta: np.ndarray, packs: list[str], pack_of: np.ndarray,
                 fallback, raw_len: np.ndarray) -> None:
        """``ids``: sorted unique V16; of each, its record's ``base`` (V16), whether it is a ``delta``, the
        number in ``packs`` of its pack, and its ``raw_len``."""
        self.ids = ids
        self._raw_len = np.ascontiguousarray(raw_len, dtype=np.uint32)
        self._packs = list(packs)
        self._pack_of = np.ascontiguousarray(pack_of, dtype=np.int32)
        self._delta = delta
        self._base = base
        self._buckets = idset.bucket_starts(ids) if ids.size else None
        self._fallback = fallback

    def locate(self, ids: np.ndarray) -> Located:
        """As ``ChunkIndex.locate``: the pack and delta base of each of ``ids``, as the index had them."""
        if not self.ids.size:  # nothing indexed (no pack left): every chunk is a miss
            return self._fallback(np.ascontiguousarray(ids))
        pos = idset.find(self.ids, ids, self._buckets)
        hit = pos >= 0
        names, pack_of = _block_packs(np.where(hit, self._pack_of[np.maximum(pos, 0)], -1), self._packs)
        delta_at = np.flatnonzero(hit & self._delta[np.maximum(pos, 0)]).astype(np.int32)
        delta_base = self._base[pos[delta_at]]
        raw_len = np.where(hit, self._raw_len[np.maximum(pos, 0)], 0).astype(np.uint32)
        miss = np.flatnonzero(~hit)
        if miss.size:
            other = self._fallback(np.ascontiguousarray(ids[miss]))
            if other.packs:
                numbers = {n: i for i, n in enumerate(names)}
                renumber = np.array([numbers.setdefault(n, len(numbers)) for n in other.packs] + [-1], dtype=np.int32)
                names = list(numbers)
                pack_of[miss] = renumber[other.pack_of]
            raw_len[miss] = other.raw_len
            order = np.argsort(np.concatenate([delta_at, miss[other.delta_at].astype(np.int32)]), kind="stable")
            delta_at = np.concatenate([delta_at, miss[other.delta_at].astype(np.int32)])[order]
            delta_base = np.concatenate([delta_base, other.delta_base])[order]
        return Located(names, pack_of, delta_at, delta_base, raw_len)

    def locate_each(self, ids: np.ndarray, fn, block: int = 1 << 16) -> list:
        """As ``ChunkIndex.locate_each``."""
        return [fn(start, self.locate(ids[start:start + block])) for start in range(0, ids.size, block)]


_LOCATE_BLOCK = 256  # ids whose records are held at once (~210 B each: bytes objects, then joined)


def locate_in(get, ids: np.ndarray) -> Located:
    """The pack and delta base of each of ``ids`` (an array of 16-byte ids), with ``get`` (chunk id -> record
    bytes or None, e.g. an LMDB transaction's); only the fields a structure check needs are checked (its
    size, and a base exactly when it is a delta), in arrays a block at a time."""
    ids = np.ascontiguousarray(ids)
    names: dict[bytes, int] = {}
    pack_of = np.full(ids.size, -1, dtype=np.int32)
    raw_len = np.zeros(ids.size, dtype=np.uint32)
    delta_at, bases = [np.empty(0, dtype=np.int32)], [np.empty(0, dtype="V16")]
    for start in range(0, ids.size, _LOCATE_BLOCK):
        block = ids[start:start + _LOCATE_BLOCK]
        got = list(map(get, block.tolist()))  # V16 items are bytes: the loop in C
        at = np.arange(start, start + len(got), dtype=np.int32)
        if None in got:
            found = np.array([g is not None for g in got], dtype=bool)
            got, block, at = [g for g in got if g is not None], block[found], at[found]
        if set(map(len, got)) - {_RECORD.size}:
            bad = next(k for k, g in enumerate(got) if len(g) != _RECORD.size)
            raise ManifestFormatError(f"index record for chunk {block[bad].tobytes().hex()} is malformed")
        recs = np.frombuffer(b"".join(got), dtype=RECORD_DTYPE)
        delta = _IS_DELTA[recs["codec"]]
        wrong = delta != (recs["base"] != NO_BASE_VOID)
        if wrong.any():
            raise ManifestFormatError(f"index record for chunk {block[int(np.argmax(wrong))].tobytes().hex()} "
                                      "is malformed")
        packs, which = np.unique(recs["pack"], return_inverse=True)
        number = np.array([names.setdefault(p.tobytes(), len(names)) for p in packs], dtype=np.int32)
        pack_of[at] = number[which]
        raw_len[at] = recs["raw_len"]
        delta_at.append(at[delta])
        bases.append(recs["base"][delta])
    return Located([n.hex() for n in names], pack_of, np.concatenate(delta_at), np.concatenate(bases), raw_len)


_WALK_BLOCK = 1 << 12  # cache records read per step of a walk (~0.4 MiB of bytes objects held)


def cache_blocks(txn, size: int):
    """The cache (an LMDB transaction's records), walked in key order a block at a time: (16-byte keys,
    their values, the block's other keys, none of which is a chunk's). Keys and values are read by two
    cursors of the transaction (they walk the same keys): no tuple per record, and no bytes object held past
    its block."""
    keys_it = txn.cursor().iternext(keys=True, values=False)
    vals_it = txn.cursor().iternext(keys=False, values=True)
    while ks := list(islice(keys_it, size)):
        vs = list(islice(vals_it, len(ks)))
        other = []
        if set(map(len, ks)) != {16}:
            other = [bytes(k) for k in ks if len(k) != 16]
            vs = [v for k, v in zip(ks, vs) if len(k) == 16]
            ks = [k for k in ks if len(k) == 16]
        yield ks, vs, other


def _block_packs(number: np.ndarray, names) -> tuple[list[str], np.ndarray]:
    """(the names of the packs a block's ``number`` (int, -1: none) uses, each id's number among them, -1
    staying -1): a block's Located names only its own packs."""
    used, pack_of = np.unique(number, return_inverse=True)
    pack_of = pack_of.astype(np.int32).reshape(-1)
    if used.size and used[0] < 0:  # -1 sorts first: it stays -1, the others count from 0
        used, pack_of = used[1:], pack_of - 1
    return [names[k] for k in used.tolist()], pack_of


def locate_walk(txn, ids: np.ndarray, fn, block: int) -> list:
    """``fn(start, Located)`` for each block of at most ``block`` of ``ids`` (sorted unique, most of the
    cache's chunks), as locate_in finds them, by walking the cache (an LMDB transaction) in key order: a
    cursor's step costs ~0.3 us a record where a look-up costs ~0.85 us, once the ids are a large share of
    the keys. The ids a step's keys reach are matched against them in arrays, and their records checked as
    locate_in checks them."""
    out = []
    done = 0

    def hand_over(upto: int, keys: np.ndarray, recs: np.ndarray) -> None:
        nonlocal done
        part = ids[done:upto]
        pos = np.searchsorted(keys, part) if keys.size else np.zeros(part.size, dtype=np.int64)
        hit = keys[np.minimum(pos, keys.size - 1)] == part if keys.size else np.zeros(part.size, dtype=bool)
        recs = recs[pos[hit]]
        delta = _IS_DELTA[recs["codec"]]
        wrong = delta != (recs["base"] != NO_BASE_VOID)
        if wrong.any():
            bad = part[np.flatnonzero(hit)[int(np.argmax(wrong))]]
            raise ManifestFormatError(f"index record for chunk {bad.tobytes().hex()} is malformed")
        names, number = _pack_numbers(recs["pack"])
        pack_of = np.full(part.size, -1, dtype=np.int32)
        pack_of[hit] = number
        is_delta = np.zeros(part.size, dtype=bool)
        is_delta[hit] = delta
        base = np.zeros(part.size, dtype="V16")
        base[hit] = recs["base"]
        raw_len = np.zeros(part.size, dtype=np.uint32)
        raw_len[hit] = recs["raw_len"]
        for start in range(0, part.size, block):
            d = np.flatnonzero(is_delta[start:start + block]).astype(np.int32)
            out.append(fn(done + start, Located(*_block_packs(pack_of[start:start + block], names), d,
                                                base[start + d], raw_len[start:start + block])))
        done = max(done, upto)

    for ks, vs, _ in cache_blocks(txn, _WALK_BLOCK):  # a key of another length is never one of ids
        if done >= ids.size:
            break
        if not ks:
            continue
        keys = np.frombuffer(b"".join(ks), dtype="V16")
        upto = int(np.searchsorted(ids, keys[-1], side="right"))  # the ids up to this step's last key
        lo = int(np.searchsorted(keys, ids[done])) if done < upto else keys.size
        keys, vs = keys[lo:], vs[lo:]  # keys before the next id: not needed
        if set(map(len, vs)) - {_RECORD.size}:  # malformed: an error if an id's, else left out
            keep = np.array([len(v) == _RECORD.size for v in vs], dtype=bool)
            wanted = np.isin(keys[~keep], ids[done:upto])
            if wanted.any():
                bad = keys[~keep][int(np.argmax(wanted))]
                raise ManifestFormatError(f"index record for chunk {bad.tobytes().hex()} is malformed")
            keys, vs = keys[keep], [v for v, k in zip(vs, keep.tolist()) if k]
        hand_over(upto, keys, np.frombuffer(b"".join(vs), dtype=RECORD_DTYPE))
    hand_over(ids.size, np.empty(0, dtype="V16"), np.empty(0, dtype=RECORD_DTYPE))
    return out


def _pack_numbers(packs: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(the distinct pack ids of ``packs`` (V16) as names, the number of each): numbered by their first 8
    bytes as integers (a third of sorting V16), unless two differ only past them."""
    heads = np.ascontiguousarray(packs).view("<u8").reshape(-1, 2)[:, 0]
    _, first, number = np.unique(heads, return_index=True, return_inverse=True)
    distinct = packs[first]
    if packs.size and not (distinct[number.reshape(-1)] == packs).all():
        distinct, number = np.unique(packs, return_inverse=True)
    return [p.tobytes().hex() for p in distinct], number.astype(np.int32).reshape(-1)


def records_in(get, chunk_ids) -> tuple[np.ndarray, np.ndarray]:
    """(records, found) of ``chunk_ids`` with ``get``: a RECORD_DTYPE array (zeros where not indexed) and a
    bool per id, checked as decode_record checks one (1.1 us a chunk; a PackEntry each took 3.8)."""
    size = _RECORD.size
    parts = list(map(get, chunk_ids))  # the loop in C: 0.3 us a chunk less than one in Python
    if None in parts:
        found = bytearray(p is not None for p in parts)
        missing = bytes(size)
        parts = [missing if p is None else p for p in parts]
    else:
        found = b"\x01" * len(parts)
    try:
        buf = b"".join(parts)
        if len(buf) != size * len(parts):
            raise ManifestFormatError("an index record has the wrong size")
        recs = np.frombuffer(buf, dtype=RECORD_DTYPE)
        found = np.frombuffer(bytes(found), dtype=bool)
        check_record_array(chunk_ids, recs, found)
    except ManifestFormatError:
        _name_first_bad(chunk_ids, [p if f else None for p, f in zip(parts, bytes(found))])
        raise
    return recs, found


ENTRY_SIZE = 16 + RECORD_SIZE  # a chunk id and its record


def encode_entries(entries) -> bytes:
    """Pack entries as one blob (chunk id + record each): what a DCP rank sends its coordinator, so the commit
    indexes its packs without reading their tables back (a request each on object storage)."""
    return b"".join(e.chunk_id + encode_record(e) for e in entries)


def decode_entries(blob: bytes) -> list[PackEntry]:
    """The entries :func:`encode_entries` packed, each held to decode_record's rules."""
    if len(blob) % ENTRY_SIZE:
        raise ManifestFormatError(f"a blob of pack entries has {len(blob)} bytes, not a multiple of {ENTRY_SIZE}")
    view = memoryview(blob)
    return [decode_record(bytes(view[k:k + 16]), bytes(view[k + 16:k + ENTRY_SIZE]))
            for k in range(0, len(blob), ENTRY_SIZE)]

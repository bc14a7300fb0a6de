"""Fuzzing every parser of stored bytes: random input and mutations of valid encodings (with and without
their checksums repaired) raise only our errors (DeltackptError, or at worst a ValueError), never
IndexError / struct.error / MemoryError / RecursionError, never hang, never allocate from a forged length,
and never unpickle anything."""

from __future__ import annotations

import os
import pickle
import struct
import tracemalloc
from contextlib import contextmanager

import msgspec
import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deltackpt.errors import ManifestFormatError
from deltackpt.store import ChunkRef, Item, Manifest, MemoryBackend, Stats, codec
from deltackpt.store.config import FORMAT_VERSION, decode_config, encode_config, new_config
from deltackpt.store.records import decode_record, decode_records, encode_record
from deltackpt import kernels
from deltackpt.store import commitlog, refstream
from deltackpt.store.manifest import (MANIFEST_MAGIC, decode_manifest, decode_manifest_refs, encode_manifest,
                                      manifest_key)
from fuzz_helpers import FUZZ, OUR_ERRORS, MiB, attempt, mutate, mutations

from deltackpt.store.pack import (
    FOOTER_SIZE,
    HEADER_SIZE,
    MAX_CHUNK_BYTES,
    ROW_SIZE,
    PackBuilder,
    PackEntry,
    decode_header,
    encode_header,
    entries_from_rows,
    pack_key,
    parse_footer,
    parse_table,
    read_pack_entries,
)

pytestmark = pytest.mark.timeout(120)

# -- manifests ---------------------------------------------------------------------------------------------------


def _manifest() -> Manifest:
    ids = [xxhash.xxh3_128_digest(bytes([i])) for i in range(5)]
    items = [
        Item(key="w", kind="array", nbytes=9000, dtype="<f4", elem_size=4, shape=[2250],
             chunks=[ChunkRef(ids[0], 4096), ChunkRef(ids[1], 4096), ChunkRef(ids[2], 808)]),
        Item(key="shard", kind="array", nbytes=100, dtype="<f2", elem_size=2, shape=[50], group="g",
             global_offset=4000, chunks=[ChunkRef(ids[3], 96, skip=4000), ChunkRef(ids[4], 4)]),
        Item(key="obj", kind="bytes", nbytes=10, chunks=[ChunkRef(ids[4], 10)]),
    ]
    return Manifest(name="step-100", store_id="ab" * 16, created_ns=1_700_000_000_000_000_000, items=items,
                    stats=Stats(logical_bytes=9110, stored_bytes=5000, num_chunks=6, new_chunks=5),
                    parent="step-90", metadata={"step": 100, "lr": 0.1, "tags": ["a", None]},
                    layer_data={"layers": {"w": [1, 2]}})


MANIFEST = _manifest()
VALID_MANIFEST = encode_manifest(MANIFEST)
BODY = msgspec.msgpack.encode(MANIFEST)


def _builtins() -> dict:
    return msgspec.to_builtins(MANIFEST, builtin_types=(bytes,))


def seal(payload: bytes, version: int = 1) -> bytes:
    """A manifest object around an already compressed ``payload``, with a correct checksum."""
    out = MANIFEST_MAGIC + bytes([version]) + payload
    return out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out))


def seal_body(body: bytes) -> bytes:
    return seal(zstandard.ZstdCompressor(level=3).compress(body))


def test_valid_samples_decode():
    """The fuzzers below start from encodings that really are valid."""
    assert decode_manifest(VALID_MANIFEST) == MANIFEST
    assert decode_manifest(seal_body(BODY)) == MANIFEST
    assert decode_manifest(seal_body(msgspec.msgpack.encode(_builtins()))) == MANIFEST


def _check_manifest_invariants(m: Manifest) -> None:
    assert isinstance(m, Manifest)
    for it in m.items:
        assert sum(r.length for r in it.chunks) == it.nbytes
        assert all(len(r.id) == 16 and r.length >= 0 and r.skip >= 0 for r in it.chunks)
        assert it.elem_size in codec.VALID_ELEM_SIZES


@FUZZ
@given(st.binary(max_size=4096))
def test_manifest_random_bytes(data):
    assert attempt(decode_manifest, data) is None or data == VALID_MANIFEST
    for candidate in (seal(data), MANIFEST_MAGIC + data):  # past the checksum / magic only
        m = attempt(decode_manifest, candidate)
        if m is not None:
            _check_manifest_invariants(m)


@FUZZ
@given(mutations)
def test_manifest_mutations_are_caught_by_the_checksum(ops):
    data = mutate(VALID_MANIFEST, ops)
    m = attempt(decode_manifest, data)
    if data == VALID_MANIFEST:
        assert m == MANIFEST
    else:
        assert m is None  # any change is detected before parsing


@FUZZ
@given(mutations)
def test_manifest_mutated_body_resealed(ops):
    """Past the checksum: the msgpack body against the strict schema."""
    m = attempt(decode_manifest, seal_body(mutate(BODY, ops)))
    if m is not None:
        _check_manifest_invariants(m)


def _frame_header_len(frame: bytes) -> int:
    return 4 + zstandard.frame_header_size(frame)


def _outcome(fn, data):
    """(the error's type, None) or (None, the result) of fn(data); only our errors are caught."""
    try:
        return None, fn(data)
    except OUR_ERRORS as e:
        return type(e), None


@contextmanager
def tiny_stream_buffers():
    """The streaming reader with reads of 32 bytes, 3 compressed bytes fed to zstd at a time and outputs of one
    id, one item record and 16 bytes: every value and every ref is cut at some point."""
    names = ("_FIRST_READ", "_FEED", "_IDS", "_RECS", "_ITEMS", "_TOP")
    saved = [getattr(refstream, n) for n in names]
    for n, v in zip(names, (32, 3, 1, 1, 16, 16)):
        setattr(refstream, n, v)
    try:
        yield
    finally:
        for n, v in zip(names, saved):
            setattr(refstream, n, v)


def _streamed(data: bytes, name: str):
    """What the streaming reader makes of ``data`` stored as checkpoint ``name``'s manifest: every id in order
    (nothing is known yet), or None where it leaves the manifest to the general reading."""
    backend = MemoryBackend()
    backend.put("manifests/x", data)
    got = refstream.stream_manifest_ids(backend, "manifests/x", name, lambda ids: ids)
    if isinstance(got, bytes):  # small: read whole, the general way
        assert got == data
        return None
    return None if got is None else got[0][:got[1]]


def _stream_agrees(data: bytes, error, m) -> None:
    """The streaming reader never accepts what decode_manifest refuses, and what it accepts it reads the same."""
    for tiny in (False, True):
        with tiny_stream_buffers() if tiny else contextmanager(lambda: (yield))():
            got = _streamed(data, m.name if m is not None else MANIFEST.name)
        if got is not None:
            assert error is None, (tiny, error)
            assert got.tobytes() == b"".join(r.id for it in m.items for r in it.chunks), tiny


def _refs_agree_with_full_decode(data: bytes) -> None:
    """decode_manifest_refs accepts exactly what decode_manifest accepts, with the same refs and the same error
    type, in C and in the general (msgspec) reading of the refs; the streaming reader accepts nothing more."""
    error, m = _outcome(decode_manifest, data)
    _stream_agrees(data, error, m)
    native = kernels.chunk_refs
    for impl in ({native, None} if native else {None}):
        kernels.chunk_refs = impl
        try:
            refs_error, refs = _outcome(decode_manifest_refs, data)
        finally:
            kernels.chunk_refs = native
        assert refs_error is error, (impl, refs_error, error)
        if m is not None:
            assert refs.name == m.name
            assert refs.ids.tobytes() == b"".join(r.id for it in m.items for r in it.chunks)
            assert refs.item_end.tolist() == np.cumsum([len(it.chunks) for it in m.items]).tolist()


def test_refs_of_valid_samples():
    for data in (VALID_MANIFEST, seal_body(BODY), seal_body(msgspec.msgpack.encode(_builtins()))):
        _refs_agree_with_full_decode(data)
        assert decode_manifest_refs(data).ids.size == 6
        if kernels.walk_refs is not None:  # the canonical form is read by the stream, not left to the general way
            with tiny_stream_buffers():  # (at the usual sizes a manifest this small is read whole)
                assert _streamed(data, MANIFEST.name).tobytes() == decode_manifest_refs(data).ids.tobytes()
                assert _streamed(data, "another-name") is None  # a manifest under another name is not this one


@FUZZ
@given(mutations)
def test_manifest_refs_mutated_stored_object(ops):
    """Damage to the stored object (the checksum not repaired): the streaming reader, which checks the checksum
    only at the end, still accepts nothing the whole-object reading refuses."""
    data = mutate(VALID_MANIFEST, ops)
    error, m = _outcome(decode_manifest, data)
    _stream_agrees(data, error, m)


@FUZZ
@given(mutations)
def test_manifest_refs_mutated_body_resealed(ops):
    """Past the checksum, the refs-only reading refuses exactly what the strict schema refuses."""
    _refs_agree_with_full_decode(seal_body(mutate(BODY, ops)))


@FUZZ
@given(st.lists(st.tuples(st.binary(min_size=14, max_size=18), st.integers(-2, 2**64 - 1),
                          st.integers(-2, 2**64 - 1), st.booleans()), max_size=6),
       st.integers(0, 2**64 - 1))
@example([(bytes(16), 2**30, 0, True)], 0)  # lengths and skips up to a chunk's size (MAX_REF_BYTES) pass,
@example([(bytes(16), 2**30 + 1, 0, True)], 0)  # one byte more does not, in every reader
@example([(bytes(16), 5, 2**30, False)], 0)
@example([(bytes(16), 5, 2**30 + 1, False)], 0)
@example([(bytes(16), 2**30 + 1, 0, False), (bytes(16), 2**30 + 1, 0, True)], 0)
def test_manifest_refs_forms_resealed(refs, nbytes):
    """Refs in every msgpack form (2 or 3 fields, ids of the wrong length, negative or huge integers)."""
    d = _builtins()
    d["items"][0]["chunks"] = [[i, n] if two else [i, n, k] for i, n, k, two in refs]
    total = sum(n for _i, n, _k, _t in refs)
    d["items"][0]["nbytes"] = nbytes if nbytes % 2 or not 0 <= total < 2**64 else total
    _refs_agree_with_full_decode(seal_body(msgspec.msgpack.encode(d)))


def _map(pairs) -> bytes:
    """A msgpack map of ``pairs`` (raw msgpack keys and values), repeats allowed, in a map32 header."""
    return b"\xdf" + len(pairs).to_bytes(4, "big") + b"".join(k + v for k, v in pairs)


def _pairs(d: dict) -> list[tuple[bytes, bytes]]:
    return [(msgspec.msgpack.encode(k), msgspec.msgpack.encode(v)) for k, v in d.items()]


@pytest.mark.parametrize("case", ["items twice", "chunks twice", "str8 keys", "items first", "empty item"])
def test_manifest_refs_repeated_and_unusual_keys_resealed(case):
    """Keys the walker must not misread: a repeated "items" or "chunks" (whichever msgspec takes), the keys in
    a longer str encoding, the items before the other fields, an item with no fields."""
    d = _builtins()
    other = [[xxhash.xxh3_128_digest(b"other"), 10]]
    top = _pairs(d)
    items = [_pairs(it) for it in d["items"]]
    enc = msgspec.msgpack.encode
    if case == "chunks twice":
        items[2].append((enc("chunks"), enc(other)))
    if case == "empty item":
        items.append([])
    if case == "str8 keys":
        items = [[(b"\xd9" + bytes([len(k) - 1]) + k[1:], v) for k, v in it] for it in items]  # fixstr -> str8
    top = [(k, b"\xdc" + len(items).to_bytes(2, "big") + b"".join(_map(it) for it in items)) if k == enc("items")
           else (k, v) for k, v in top]
    if case == "items twice":
        top.append((enc("items"), enc([{"key": "o", "kind": "bytes", "nbytes": 10, "chunks": other}])))
    if case == "items first":
        top.sort(key=lambda kv: kv[0] != enc("items"))
    if case == "str8 keys":
        top = [(b"\xd9" + bytes([len(k) - 1]) + k[1:], v) for k, v in top]
    _refs_agree_with_full_decode(seal_body(_map(top)))


@FUZZ
@given(mutations)
def test_manifest_mutated_zstd_frame_resealed(ops):
    """Past the checksum: damaged zstd blocks. (The frame header's content size is covered separately by
    test_manifest_forged_content_size_*, which are known bugs.)"""
    frame = VALID_MANIFEST[5:-8]
    m = attempt(decode_manifest, seal(mutate(frame, ops, lo=_frame_header_len(frame))))
    if m is not None:
        _check_manifest_invariants(m)


@FUZZ
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
                    | st.binary(max_size=20),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=30))
def test_manifest_random_msgpack_resealed(tree):
    body = msgspec.msgpack.encode(tree)
    assert attempt(decode_manifest, seal_body(body)) is None
    # and the same tree in place of each manifest field
    for field in ("name", "items", "stats", "metadata", "created_ns"):
        d = _builtins()
        d[field] = tree
        data = seal_body(msgspec.msgpack.encode(d))
        m = attempt(decode_manifest, data)
        if m is not None:
            _check_manifest_invariants(m)
        _stream_agrees(data, None if m is not None else ManifestFormatError, m)


def _peak_while(fn, *args) -> int:
    tracemalloc.start()
    try:
        attempt(fn, *args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_forged_msgpack_lengths_allocate_nothing():
    d = _builtins()
    d["items"] = None
    marker = b"\xa5items\xc0"
    body = msgspec.msgpack.encode(d)
    assert marker in body
    for forged in (b"\xa5items\xdd\xff\xff\xff\xff",  # array32 of 2**32-1 elements, none present
                   b"\xa5items\xdf\xff\xff\xff\xff",  # map32
                   b"\xa5items\xc6\xff\xff\xff\xff"):  # bin32 of 4 GiB
        data = seal_body(body.replace(marker, forged))
        for decode in (decode_manifest, decode_manifest_refs):
            with pytest.raises(ManifestFormatError):
                decode(data)
            assert _peak_while(decode, data) < 64 * MiB


def _forged_frame(content_size: int) -> bytes:
    """A zstd frame header (single segment, 8-byte content size) followed by an empty last raw block."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", content_size) + b"\x01\x00\x00"


def test_manifest_forged_content_size_allocates_little():
    data = seal(_forged_frame(1 << 30))
    assert _peak_while(decode_manifest, data) < 64 * MiB


@settings(FUZZ, max_examples=20)
@given(st.integers(1 << 48, (1 << 62)))
def test_manifest_forged_content_size_is_a_format_error(size):
    with pytest.raises(ManifestFormatError):
        decode_manifest(seal(_forged_frame(size)))


def test_manifest_deeply_nested_metadata_is_a_format_error():
    d = _builtins()
    d["metadata"] = {"deep": None}
    body = msgspec.msgpack.encode(d)
    body = body.replace(b"\xa4deep\xc0", b"\xa4deep" + b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(ManifestFormatError):
        decode_manifest(seal_body(body))


class _Boom:
    """Unpickling this creates the marker file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_is_never_executed(tmp_path, mem_store):
    marker = str(tmp_path / "pwned")
    payload = pickle.dumps(_Boom(marker))
    payload_v0 = pickle.dumps(_Boom(marker), protocol=0)
    candidates = [payload, payload_v0, MANIFEST_MAGIC + b"\x01" + payload, seal(payload),
                  seal_body(payload), seal(zstandard.ZstdCompressor().compress(payload_v0))]
    for data in candidates:
        with pytest.raises(ManifestFormatError):
            decode_manifest(data)
    # the same through the store: read_manifest, ls, verify
    for i, data in enumerate(candidates):
        mem_store.backend.put(manifest_key(f"evil{i}"), data)
    for i in range(len(candidates)):
        with pytest.raises(ManifestFormatError):
            mem_store.read_manifest(f"evil{i}")
    assert mem_store.list_checkpoints() == []
    from deltackpt.store.verify import verify_store

    r = verify_store(mem_store, level=2)
    assert sorted(p.kind for p in r.problems) == ["manifest"] * len(candidates)
    assert not os.path.exists(marker)
    pickle.loads(payload)  # control: the payload really does create the marker when unpickled
    assert os.path.exists(marker)


# -- pack entry headers ---------------------------------------------------------------------------------------------

HEADER = encode_header(b"\x11" * 16, codec.DELTA, 4, 4096, 1000, b"\x22" * 16, 3)


def _rehash(head56: bytes) -> bytes:
    return head56 + struct.pack("<Q", xxhash.xxh3_64_intdigest(head56))


def _check_header(out, src):
    cid, cod, es, rlen, slen, base, age = out
    assert cod in codec.CODEC_NAMES and es in codec.VALID_ELEM_SIZES
    assert 0 <= rlen <= MAX_CHUNK_BYTES and 0 <= slen <= MAX_CHUNK_BYTES + MiB
    assert len(cid) == 16 and (base is None or len(base) == 16)
    assert src[:4] == b"DCE1"


@FUZZ
@given(st.binary(max_size=200))
def test_header_random_bytes(data):
    out = attempt(decode_header, data, "fuzz")
    if out is not None:
        _check_header(out, data)
    out = attempt(decode_header, _rehash(data[:56].ljust(56, b"\0")), "fuzz")
    if out is not None:
        _check_header(out, data[:56].ljust(56, b"\0"))


@FUZZ
@given(mutations, st.booleans())
def test_header_mutations(ops, rehash):
    head = mutate(HEADER, ops)
    if rehash:
        head = _rehash(head[:56].ljust(56, b"\0"))
    out = attempt(decode_header, head, "fuzz")
    if out is not None:
        _check_header(out, head)
    elif not rehash:
        assert head[:64] != HEADER


@FUZZ
@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_header_field_bounds(cod, es, rlen, slen):
    head = encode_header(b"\x01" * 16, cod, es, rlen, slen, None)
    out = attempt(decode_header, head, "fuzz")
    ok = cod in codec.CODEC_NAMES and es in codec.VALID_ELEM_SIZES and rlen <= MAX_CHUNK_BYTES \
        and slen <= MAX_CHUNK_BYTES + MiB
    assert (out is not None) == ok


# -- pack footers and tables ------------------------------------------------------------------------------------


def _pack():
    b = PackBuilder()
    rng = np.random.default_rng(0)
    raw = rng.standard_normal(1024).astype(np.float32).tobytes()
    z = codec.encode_planes(raw, 4, 1)
    b.add(xxhash.xxh3_128_digest(raw), codec.ZSTD, 4, len(raw), z)
    b.add(b"\x05" * 16, codec.RAW, 1, 300, rng.bytes(300))
    b.add(b"\x06" * 16, codec.DELTA, 4, len(raw), b"delta-ish", xxhash.xxh3_128_digest(raw), 2)
    name, data, entries = b.seal()
    return name, bytes(data), entries


PACK_NAME, PACK, PACK_ENTRIES = _pack()


def _entries_of(data: bytes, name: str = PACK_NAME):
    be = MemoryBackend()
    be.put(pack_key(name), data)
    return attempt(read_pack_entries, be, name, len(data))


def _check_entries(entries: list[PackEntry], size: int):
    table_offset = size - FOOTER_SIZE - len(entries) * ROW_SIZE
    prev = 8
    for e in entries:
        assert e.offset >= prev and e.offset + HEADER_SIZE + e.stored_len <= table_offset
        prev = e.offset + HEADER_SIZE + e.stored_len
        assert e.codec in codec.CODEC_NAMES and e.elem_size in codec.VALID_ELEM_SIZES
        assert codec.is_delta(e.codec) == (e.base_id is not None)


def _fix_table_hash(data: bytes) -> bytes:
    """Recompute the footer's table hash so that row checks, not the checksum, decide."""
    if len(data) < FOOTER_SIZE + 8:
        return data
    tail = data[-FOOTER_SIZE:]
    off, num, _h, ver, pad, magic = struct.unpack("<QQQHH4s", tail)
    table = data[off:off + num * ROW_SIZE] if num < 1 << 20 else b""
    return data[:-FOOTER_SIZE] + struct.pack("<QQQHH4s", off, num, xxhash.xxh3_64_intdigest(table), ver, pad, magic)


def test_valid_pack_parses():
    assert _entries_of(PACK) == PACK_ENTRIES
    assert _entries_of(_fix_table_hash(PACK)) == PACK_ENTRIES


@FUZZ
@given(st.binary(min_size=FOOTER_SIZE, max_size=FOOTER_SIZE), st.integers(0, 2**70), st.binary(max_size=512))
def test_footer_and_table_random(tail, size, table):
    out = attempt(parse_footer, tail, size, "fuzz")
    if out is not None:
        off, num = out
        assert 8 <= off and off + num * ROW_SIZE + FOOTER_SIZE == size
    entries = attempt(parse_table, table, tail, "fuzz")
    if entries is not None:
        assert len(table) == len(entries) * ROW_SIZE


@FUZZ
@given(mutations, st.booleans(), st.sampled_from(["all", "table", "footer"]))
def test_pack_mutations(ops, fix_hash, region):
    table_offset = len(PACK) - FOOTER_SIZE - len(PACK_ENTRIES) * ROW_SIZE
    lo = {"all": 0, "table": table_offset, "footer": len(PACK) - FOOTER_SIZE}[region]
    data = mutate(PACK, ops, lo=lo)
    if fix_hash:
        data = _fix_table_hash(data)
    entries = _entries_of(data)
    if entries is not None:
        _check_entries(entries, len(data))


@FUZZ
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_forged_footer_counts(table_offset, num):
    tail = struct.pack("<QQQHH4s", table_offset, num, 0, 1, 0, b"DCPK")
    data = PACK[:-FOOTER_SIZE] + tail
    assert _entries_of(data) is None or (table_offset, num) == struct.unpack("<QQ", PACK[-FOOTER_SIZE:][:16])


def test_footer_claiming_2_to_the_60_entries_allocates_nothing():
    tail = struct.pack("<QQQHH4s", 8, 2**60, 0, 1, 0, b"DCPK")
    forged = PACK[:-FOOTER_SIZE] + tail
    tracemalloc.start()
    try:
        assert _entries_of(forged) is None
        with pytest.raises(ManifestFormatError):
            parse_table(b"", tail, "fuzz")
        with pytest.raises(ManifestFormatError):
            parse_footer(tail, len(forged), "fuzz")
        off, num = parse_footer(tail, 8 + 2**60 * ROW_SIZE + FOOTER_SIZE, "fuzz")  # consistent sizes pass...
        assert num == 2**60
        with pytest.raises(ManifestFormatError):
            parse_table(PACK[8:8 + 4096], tail, "fuzz")  # ...but the table must really be there
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MiB


# -- index records ------------------------------------------------------------------------------------------------

RECORD = encode_record(PACK_ENTRIES[2])


@FUZZ
@given(st.binary(min_size=16, max_size=16), st.binary(max_size=120))
def test_index_record_random(cid, rec):
    e = attempt(decode_record, cid, rec)
    if e is not None:
        _check_record(e, cid, rec)
    assert len(rec) == len(RECORD) or e is None


@FUZZ
@given(mutations)
def test_index_record_mutations(ops):
    rec = mutate(RECORD, ops)
    e = attempt(decode_record, PACK_ENTRIES[2].chunk_id, rec)
    if len(rec) != len(RECORD):
        assert e is None
    elif e is not None:
        _check_record(e, PACK_ENTRIES[2].chunk_id, rec)
    if rec == RECORD:
        assert e == PACK_ENTRIES[2]


@FUZZ
@given(st.lists(mutations, max_size=4), st.integers(0, 4))
def test_index_records_decode_in_bulk_as_one_by_one(ops_list, at):
    """A save decodes its look-ups in bulk: it accepts what decode_record accepts, field for field, and
    refuses what it refuses, naming the first malformed record's chunk."""
    recs = [RECORD] * 2 + [mutate(RECORD, ops) for ops in ops_list]
    recs = recs[at % len(recs):] + recs[:at % len(recs)]
    ids = [bytes([i]) * 16 for i in range(len(recs))]
    one = [attempt(decode_record, cid, rec) for cid, rec in zip(ids, recs)]
    if None in one:
        with pytest.raises(ManifestFormatError, match=ids[one.index(None)].hex()):
            decode_records(ids, recs)
        return
    arr = decode_records(ids, recs)
    assert len(arr) == len(recs)
    for e, row in zip(one, arr):
        assert (row["pack"].tobytes().hex(), int(row["offset"]), int(row["stored_len"]), int(row["raw_len"]),
                int(row["codec"]), int(row["elem_size"]), int(row["age"])) == (
            e.pack, e.offset, e.stored_len, e.raw_len, e.codec, e.elem_size, e.age)
        assert row["base"].tobytes() == (e.base_id or bytes(16))


def _check_record(e, cid, rec):
    assert len(rec) == len(RECORD)
    assert e.chunk_id == cid and len(e.pack) == 32
    assert encode_record(e) == rec  # a record decodes to exactly what it says
    assert e.codec in codec.CODEC_NAMES and e.elem_size in codec.VALID_ELEM_SIZES
    assert codec.is_delta(e.codec) == (e.base_id is not None)


# -- store config -----------------------------------------------------------------------------------------------

CONFIG = encode_config(new_config())
_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=10),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
                     max_leaves=10)
_FIELDS = list(msgspec.json.decode(CONFIG))


def _check_config(cfg):
    cfg.validate()
    assert cfg.format_version <= FORMAT_VERSION


@FUZZ
@given(st.binary(max_size=1000))
def test_config_random_bytes(data):
    cfg = attempt(decode_config, data)
    if cfg is not None:
        _check_config(cfg)


@FUZZ
@given(mutations)
def test_config_mutations(ops):
    cfg = attempt(decode_config, mutate(CONFIG, ops))
    if cfg is not None:
        _check_config(cfg)


@FUZZ
@given(st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=8), _json, max_size=6))
def test_config_random_fields(overrides):
    base = msgspec.json.decode(CONFIG)
    base.update(overrides)
    cfg = attempt(decode_config, msgspec.json.encode(base))
    if cfg is not None:
        _check_config(cfg)
        assert set(overrides) <= set(_FIELDS)


@pytest.mark.parametrize("store_id", ["../../../tmp/evil", "/etc/deltackpt", "a/b", ""])
def test_config_store_id_is_validated(store_id):
    base = msgspec.json.decode(CONFIG)
    base["store_id"] = store_id
    with pytest.raises(ManifestFormatError):
        decode_config(msgspec.json.encode(base))


@pytest.mark.parametrize("version", [0, -1])
def test_config_format_version_below_1_is_refused(version):
    base = msgspec.json.decode(CONFIG)
    base["format_version"] = version
    with pytest.raises(ManifestFormatError):
        decode_config(msgspec.json.encode(base))


# -- codecs: stored chunk bytes ----------------------------------------------------------------------------------

RAW = np.random.default_rng(1).standard_normal(1024).astype(np.float32).tobytes()
ZFRAME = bytes(codec.encode_planes(RAW, 4, 1))
DFRAME = bytes(codec.encode_delta(RAW, RAW[::-1], 4, 1))
_MOVED = np.frombuffer(RAW, np.float32).copy()
_MOVED[::5] *= np.float32(1.001)
SBASE = _MOVED.tobytes()
SFRAME = bytes(codec.encode_delta(RAW, SBASE, 4, 1))  # every plane zero-sparse (4 of 5 values unchanged)
assert list(SFRAME[4:24:5]) == [codec.SEG_SPARSE] * 4
ZDFRAME = bytes(codec.encode_delta(RAW, SBASE, 4, 1, codec.ZDELTA))


@FUZZ
@given(st.sampled_from([codec.RAW, codec.ZSTD, codec.DELTA, codec.ZDELTA, 7]), st.binary(max_size=600), st.integers(0, 8192),
       st.sampled_from([1, 2, 4, 8]))
def test_codec_decode_random(cod, stored, raw_len, es):
    out = attempt(codec.decode, cod, stored, raw_len, es, bytes(raw_len), errors=ValueError)
    if out is not None:
        assert len(out) == raw_len


@FUZZ
@given(mutations, st.sampled_from(["zstd", "delta", "sparse", "zdelta"]), st.booleans())
def test_codec_decode_mutated_frames(ops, kind, header_too):
    frame, base = {"zstd": (ZFRAME, None), "delta": (DFRAME, RAW[::-1]), "sparse": (SFRAME, SBASE),
                   "zdelta": (ZDFRAME, SBASE)}[kind]
    damaged = mutate(frame, ops, lo=0 if header_too else _frame_header_len(frame))
    cod = {"zstd": codec.ZSTD, "zdelta": codec.ZDELTA}.get(kind, codec.DELTA)
    out = attempt(codec.decode, cod, damaged, len(RAW), 4, base, errors=ValueError)
    if out is not None:
        assert len(out) == len(RAW)


@FUZZ
@given(mutations, st.sampled_from([1, 2, 4, 8]), st.integers(0, 8192), st.booleans())
def test_plane_layout_of_damaged_headers_stays_in_bounds(ops, es, raw_len, sparse):
    """The layout a reader probes stored planes with (ChunkSource.differs) never raises, and a plane it calls
    stored as is has exactly its raw length: damage can only point a probe at other bytes of the pack."""
    frame = (SFRAME if sparse else ZFRAME) if es == 4 else DFRAME
    head = mutate(frame[:codec.container_header_size(es)], ops)
    layout = codec.plane_layout(head, raw_len, es)
    if layout is None:
        return
    assert len(layout) == es
    pos = codec.container_header_size(es)
    for mode, offset, slen in layout:
        assert mode in (codec.SEG_RAW, codec.SEG_ZSTD, codec.SEG_SPARSE) and offset == pos
        if mode == codec.SEG_RAW:
            assert slen == raw_len // es
        pos += slen


def test_plane_layout_of_a_valid_container():
    layout = codec.plane_layout(ZFRAME, len(RAW), 4)
    assert [m for m, _, _ in layout][:2] == [codec.SEG_RAW, codec.SEG_RAW]  # fp32 low mantissa bytes
    mode, offset, slen = layout[0]
    assert ZFRAME[offset:offset + slen] == np.frombuffer(RAW, np.uint8)[0::4].tobytes()
    assert codec.plane_layout(b"\x28\xb5\x2f\xfd" + bytes(40), len(RAW), 4) is None  # a legacy single frame


@pytest.mark.parametrize("size", [1 << 30, 1 << 50, (1 << 62)])
def test_codec_forged_content_size_is_a_value_error(size):
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            codec.decode(codec.ZSTD, _forged_frame(size), 4096, 4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MiB


# -- commit records ----------------------------------------------------------------------------------------------

_RECORD = commitlog.CommitRecord(store_id="s" * 32, name="step-10", created_ns=123, packs={"ab" * 16: 4096},
                                 tables={"ab" * 16: bytes(range(64))}, after="step-9", after_ns=100)
VALID_RECORD = commitlog.encode_commit_record(_RECORD)
_RECORD_HEAD = len(commitlog.MAGIC) + 1


def _seal_record(body: bytes) -> bytes:
    out = commitlog.MAGIC + bytes([commitlog.VERSION]) + body
    return out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out))


def _decode_commit(data: bytes):
    return commitlog.decode_commit_record(data, "step-10", "s" * 32)  # a hint: anything wrong is None, nothing raised


@FUZZ
@given(st.binary(max_size=2048))
def test_commit_record_random_bytes(data):
    for candidate in (data, _seal_record(data)):
        record = _decode_commit(candidate)
        assert record is None or (record.name == "step-10" and candidate.startswith(commitlog.MAGIC))


@FUZZ
@given(mutations)
def test_commit_record_mutations_are_caught_by_the_checksum(ops):
    data = mutate(VALID_RECORD, ops)
    assert _decode_commit(data) == (_RECORD if data == VALID_RECORD else None)


@FUZZ
@given(mutations)
def test_commit_record_mutated_body_resealed(ops):
    record = _decode_commit(_seal_record(mutate(VALID_RECORD[_RECORD_HEAD:-8], ops)))
    if record is not None:
        assert record.store_id == "s" * 32 and record.created_ns >= 0
        assert all(len(p) == 32 for p in record.packs) and all(size >= 0 for size in record.packs.values())
        assert record.tables.keys() <= record.packs.keys()
        for pack, rows in record.tables.items():  # a table that is not the pack's raises our error only
            attempt(entries_from_rows, rows, record.packs[pack], pack)

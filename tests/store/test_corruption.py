"""Damaged packs, manifests and pack tables are detected and reported with typed errors."""

from __future__ import annotations

import os
import pickle
import struct
import tracemalloc

import msgspec
import numpy as np
import pytest
import xxhash
import zstandard

from deltackpt.errors import (
    CorruptChunkError,
    CorruptManifestError,
    DeltackptError,
    ManifestFormatError,
    MissingChunkError,
    UnsupportedFormatError,
)
from deltackpt.store import ChunkRef, Item, Manifest, MemoryBackend, Stats, Store, codec
from deltackpt.store.manifest import MANIFEST_MAGIC, decode_manifest, encode_manifest
from deltackpt.store.pack import (
    FOOTER_SIZE,
    HEADER_SIZE,
    ROW_SIZE,
    PackBuilder,
    decode_header,
    encode_header,
    pack_key,
    parse_footer,
    parse_table,
    read_pack_entries,
)
from deltackpt.store.chunking import chunk_id_of

from store_helpers import assert_items_equal, flip_bit, mutate_object, packs_of_checkpoint, random_array


def _entry_of(store, name, key, index):
    ref = store.read_manifest(name).item_map()[key].chunks[index]
    entry = store.index.lookup(ref.id)
    assert entry is not None
    return ref, entry


# -- pack payloads --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["payload", "header"])
def test_bit_flip_in_pack_is_a_corrupt_chunk(store, rng, where):
    items = {"w": random_array(rng, "float32", (20_000,)), "other": random_array(rng, "int64", (3000,))}
    store.save("ck", items)
    ref, entry = _entry_of(store, "ck", "w", 5)
    pos = entry.offset + (HEADER_SIZE + entry.stored_len // 2 if where == "payload" else 20)
    flip_bit(store.backend, pack_key(entry.pack), pos, 3)

    fresh = Store.open(store.backend, cache_dir=store.cache_dir)  # nothing cached in memory
    with pytest.raises(CorruptChunkError) as ei:
        fresh.load("ck")
    err = ei.value
    assert isinstance(err, DeltackptError)
    assert err.chunk_id == ref.id.hex()
    assert err.pack == entry.pack
    assert err.checkpoint == "ck"
    assert err.item == "w"
    for part in (ref.id.hex(), entry.pack, "ck", "w"):
        assert part in str(err)
    # errors survive pickling (they cross process boundaries in DCP)
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.chunk_id, clone.pack, clone.checkpoint, clone.item) == (err.chunk_id, err.pack, "ck", "w")
    assert str(clone) == str(err)

    with fresh.open_checkpoint("ck") as r:
        raw = items["w"].tobytes()
        cs = fresh.config.chunk_size_bytes
        # ranges that avoid the damaged chunk still read, and so do other items in the same pack
        assert r.read("w", 0, 5 * cs).tobytes() == raw[: 5 * cs]
        assert r.read("w", 6 * cs).tobytes() == raw[6 * cs :]
        with pytest.raises(CorruptChunkError):
            r.read("w", 5 * cs + 10, 1)
        assert r.read("other").tobytes() == items["other"].tobytes()


def test_truncated_pack(store, rng):
    a = {"a": random_array(rng, "float32", (60_000,))}
    b = {"b": random_array(rng, "float32", (60_000,))}
    store.save("A", a)
    store.save("B", b)
    a_packs, b_packs = packs_of_checkpoint(store, "A"), packs_of_checkpoint(store, "B")
    assert a_packs and b_packs and not (a_packs & b_packs)
    victim = sorted(a_packs)[0]
    mutate_object(store.backend, pack_key(victim), lambda d: d[: len(d) // 2])

    # The index still points into the pack: the read finds the pack too short.
    with pytest.raises(CorruptChunkError) as ei:
        Store.open(store.backend, cache_dir=store.cache_dir).load("A")
    assert ei.value.pack == victim and ei.value.checkpoint == "A" and ei.value.item == "a"
    assert_items_equal(b, store.load("B"))

    # After a rebuild the damaged pack's table is unreadable, so its chunks are simply not found.
    assert store.rebuild_index()[0] == len(a_packs | b_packs)
    with pytest.raises(MissingChunkError) as ei:
        store.load("A")
    assert isinstance(ei.value, DeltackptError) and isinstance(ei.value, KeyError)
    assert ei.value.checkpoint == "A" and ei.value.item == "a"
    assert_items_equal(b, store.load("B"))
    clone = pickle.loads(pickle.dumps(ei.value))
    assert (clone.chunk_id, clone.checkpoint, clone.item) == (ei.value.chunk_id, "A", "a")


def test_deleted_pack(store, rng):
    a = {"a": random_array(rng, "float32", (30_000,))}
    b = {"b": random_array(rng, "float32", (30_000,))}
    store.save("A", a)
    store.save("B", b)
    victim = sorted(packs_of_checkpoint(store, "A"))[0]
    store.backend.delete(pack_key(victim))
    with pytest.raises(CorruptChunkError, match="pack is missing") as ei:
        store.load("A")
    assert ei.value.pack == victim
    # A new process notices the pack is gone, rebuilds its index, and reports the chunks as missing.
    fresh = Store.open(store.backend, cache_dir=store.cache_dir)
    with pytest.raises(MissingChunkError):
        fresh.load("A")
    assert_items_equal(b, fresh.load("B"))


def test_commit_refuses_chunks_of_a_pack_deleted_behind_the_index(store, rng, monkeypatch):
    a = {"a": random_array(rng, "float32", (30_000,))}
    store.save("A", a)
    victim = sorted(packs_of_checkpoint(store, "A"))[0]
    store.backend.delete(pack_key(victim))  # e.g. gc in another process; this index still lists its chunks
    listed = []
    real_list = type(store.backend).list
    monkeypatch.setattr(type(store.backend), "list",
                        lambda self, prefix="": listed.append(prefix) or real_list(self, prefix))
    with pytest.raises(MissingChunkError):
        store.save("A2", {"a": a["a"].copy()})  # dedups against the stale index entries
    assert not store.exists("A2")
    # Only a failing commit looks at the whole store (one refresh, to rule out a stale cache); a commit that
    # succeeds checks just the packs it points into, never a listing of all packs.
    listed.clear()
    store.save("B", {"b": random_array(rng, "float32", (30_000,))})
    assert "packs/" not in listed


# -- manifests -----------------------------------------------------------------------------------------------


@pytest.fixture
def manifest_store(mem_store, rng):
    items = {"w": random_array(rng, "float32", (5000,)), "b": b"hello" * 100}
    mem_store.save("m", items)
    return mem_store, mem_store.backend.get("manifests/m"), items


def test_manifest_truncation_is_detected(manifest_store):
    store, data, items = manifest_store
    for n in range(len(data)):
        with pytest.raises(ManifestFormatError):
            decode_manifest(data[:n])
    store.backend.put("manifests/m", data[: len(data) - 7])
    with pytest.raises(ManifestFormatError):
        store.load("m")
    assert store.list_checkpoints() == []  # ls skips it rather than failing
    store.backend.put("manifests/m", data)
    assert_items_equal(items, store.load("m"))


@pytest.mark.parametrize("payload", ["random", "pickle", "pickle-in-frame", "msgpack-wrong-schema", "json"])
def test_foreign_manifest_payloads_are_rejected_and_never_executed(manifest_store, tmp_path, rng, payload):
    store, _data, _items = manifest_store
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = pickle.dumps(Evil())
    blob = {
        "random": rng.bytes(500),
        "pickle": evil,
        "pickle-in-frame": MANIFEST_MAGIC + b"\x01" + zstandard.ZstdCompressor().compress(evil),
        "msgpack-wrong-schema": MANIFEST_MAGIC + b"\x01"
        + zstandard.ZstdCompressor().compress(msgspec.msgpack.encode({"name": "m", "items": "x"})),
        "json": b'{"name": "m", "items": []}',
    }[payload]
    store.backend.put("manifests/m", blob)
    with pytest.raises(ManifestFormatError):
        store.load("m")
    with pytest.raises(ManifestFormatError):
        store.read_manifest("m")
    assert not marker.exists()
    pickle.loads(evil)  # sanity: the payload really would run (it creates the marker) ...
    assert marker.exists()  # ... so the engine not running it above is meaningful


def test_manifest_with_wrong_name_or_bad_refs(manifest_store):
    store, data, _ = manifest_store
    m = decode_manifest(data)
    store.backend.put("manifests/copied", data)  # a manifest stored under another name
    with pytest.raises(ManifestFormatError):
        store.load("copied")

    from deltackpt.store.manifest import encode_manifest

    bad_len = msgspec.structs.replace(m, items=[msgspec.structs.replace(m.items[0], nbytes=m.items[0].nbytes + 1)])
    bad_id = msgspec.structs.replace(
        m, items=[msgspec.structs.replace(m.items[0], chunks=[ChunkRef(b"short", m.items[0].nbytes)])])
    neg = msgspec.structs.replace(m, items=[msgspec.structs.replace(m.items[0], global_offset=-4)])
    bad_es = msgspec.structs.replace(m, items=[msgspec.structs.replace(m.items[0], elem_size=3)])
    ref = m.items[0].chunks[0]
    # A negative length or skip, each balanced so the lengths still sum to the item's size.
    neg_ref = msgspec.structs.replace(m, items=[msgspec.structs.replace(m.items[0], chunks=[
        ChunkRef(ref.id, m.items[0].nbytes + 1), ChunkRef(ref.id, -1), *m.items[0].chunks[1:]])])
    neg_skip = msgspec.structs.replace(m, items=[msgspec.structs.replace(m.items[0], chunks=[
        ChunkRef(ref.id, ref.length, -1), *m.items[0].chunks[1:]])])
    long_id = msgspec.structs.replace(m, items=[msgspec.structs.replace(m.items[0], chunks=[
        ChunkRef(ref.id + b"x", ref.length), *m.items[0].chunks[1:]])])
    # A length past any chunk's (a load allocated 1 TiB for it) and a skip past one.
    huge = msgspec.structs.replace(m, items=[msgspec.structs.replace(m.items[0], nbytes=2**40, chunks=[
        ChunkRef(ref.id, 2**40)])])
    huge_skip = msgspec.structs.replace(m, items=[msgspec.structs.replace(m.items[0], chunks=[
        ChunkRef(ref.id, ref.length, 2**40), *m.items[0].chunks[1:]])])
    for bad in (bad_len, bad_id, neg, bad_es, neg_ref, neg_skip, long_id, huge, huge_skip):
        with pytest.raises(ManifestFormatError):
            decode_manifest(encode_manifest(bad))
    # A shape that does not fit the item's bytes (a manifest with a valid checksum, forged or from a buggy
    # writer): a typed error naming the checkpoint, not numpy's bare ValueError.
    wrong_shape = msgspec.structs.replace(m, name="shape", items=[msgspec.structs.replace(m.items[0], shape=[3]),
                                                                  *m.items[1:]])
    store.backend.put("manifests/shape", encode_manifest(wrong_shape))
    with pytest.raises(CorruptManifestError, match="shape") as ei:
        store.load("shape")
    assert ei.value.checkpoint == "shape"


def test_newer_manifest_version_is_unsupported_and_a_flipped_version_bit_is_damage():
    future = MANIFEST_MAGIC + bytes([9]) + b"some future layout" + bytes(64)
    with pytest.raises(UnsupportedFormatError):  # whole, as a newer writer made it
        decode_manifest(future + struct.pack("<Q", xxhash.xxh3_64_intdigest(future)))
    # One flipped bit in the version byte (0x01 -> 0x81) is damage: it blocked ls, gc and resume as "newer".
    with pytest.raises(CorruptManifestError):
        decode_manifest(future + bytes(8))


def test_every_manifest_bit_flip_is_detected(manifest_store):
    _store, data, _ = manifest_store
    silent = []
    for bit in range(len(data) * 8):
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        try:
            decode_manifest(bytes(b))
        except (ManifestFormatError, UnsupportedFormatError):
            continue
        silent.append(bit)
    assert silent == []


def test_manifest_bit_flips_never_raise_untyped_errors(manifest_store):
    """Whatever a bit flip does, it never surfaces as a non-deltackpt exception."""
    store, data, items = manifest_store
    for pos in (0, 3, 5, 8):  # DCMF magic, zstd frame magic
        b = bytearray(data)
        b[pos] ^= 0x10
        store.backend.put("manifests/m", bytes(b))
        with pytest.raises(ManifestFormatError):
            store.load("m")
    store.backend.put("manifests/m", data)
    assert_items_equal(items, store.load("m"))
    for bit in range(0, len(data) * 8, 3):
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        try:
            decode_manifest(bytes(b))
        except DeltackptError:
            pass


# -- forged pack tables ---------------------------------------------------------------------------------------


def _pack(n_chunks=3, size=1000):
    pb = PackBuilder()
    for i in range(n_chunks):
        raw = bytes([i]) * size
        pb.add(chunk_id_of(raw), codec.RAW, 1, len(raw), raw)
    return pb.seal()


def _footer(table_offset, num, table_hash, version=1):
    return struct.pack("<QQQHH4s", table_offset, num, table_hash, version, 0, b"DCPK")


def _row(cid, off, slen, rlen, cod=0, es=1, base=bytes(16)):
    return struct.pack("<16s16sQQQBB6x", cid, base, off, slen, rlen, cod, es)


def _forge(data, rows):
    """Replace the table of pack ``data`` by ``rows``, with a valid table hash and footer."""
    table_offset = struct.unpack_from("<Q", data, len(data) - FOOTER_SIZE)[0]
    table = b"".join(rows)
    return bytes(data[:table_offset]) + table + _footer(table_offset, len(rows), xxhash.xxh3_64_intdigest(table))


def test_valid_pack_parses():
    name, data, entries = _pack()
    be = MemoryBackend()
    be.put(pack_key(name), data)
    assert read_pack_entries(be, name) == entries
    assert read_pack_entries(be, name, len(data)) == entries
    assert [e.offset for e in entries] == [8, 8 + HEADER_SIZE + 1000, 8 + 2 * (HEADER_SIZE + 1000)]


@pytest.mark.parametrize("case", [
    "huge-num", "huge-table-offset", "table-offset-in-magic", "bad-magic", "newer-version", "too-short",
    "table-hash", "huge-raw-len", "huge-stored-len", "offset-past-table", "overlapping-rows", "bad-codec",
    "bad-elem-size", "empty",
])
def test_forged_pack_tables_are_rejected_without_huge_allocation(case):
    name, data, entries = _pack()
    data = bytes(data)
    table_offset = struct.unpack_from("<Q", data, len(data) - FOOTER_SIZE)[0]
    e0 = entries[0]
    forged = {
        "huge-num": lambda: data[:-FOOTER_SIZE] + _footer(table_offset, 2**60, 0),
        "huge-table-offset": lambda: data[:-FOOTER_SIZE] + _footer(2**63, 3, 0),
        "table-offset-in-magic": lambda: data[:-FOOTER_SIZE] + _footer(2, 3, 0),
        "bad-magic": lambda: data[:-4] + b"XXXX",
        "newer-version": lambda: data[:-FOOTER_SIZE] + _footer(table_offset, 3, 0, version=7),
        "too-short": lambda: data[:20],
        "table-hash": lambda: data[:table_offset] + bytes([data[table_offset] ^ 1]) + data[table_offset + 1:],
        "huge-raw-len": lambda: _forge(data, [_row(e0.chunk_id, e0.offset, 1000, 2**62)]),
        "huge-stored-len": lambda: _forge(data, [_row(e0.chunk_id, e0.offset, 2**62, 1000)]),
        "offset-past-table": lambda: _forge(data, [_row(e0.chunk_id, table_offset - 10, 1000, 1000)]),
        "overlapping-rows": lambda: _forge(data, [_row(e0.chunk_id, 8, 1000, 1000), _row(e0.chunk_id, 100, 10, 10)]),
        "bad-codec": lambda: _forge(data, [_row(e0.chunk_id, 8, 1000, 1000, cod=77)]),
        "bad-elem-size": lambda: _forge(data, [_row(e0.chunk_id, 8, 1000, 1000, es=3)]),
        "empty": lambda: b"",
    }[case]()
    be = MemoryBackend()
    be.put(pack_key(name), forged)
    tracemalloc.start()
    try:
        with pytest.raises(ManifestFormatError):
            read_pack_entries(be, name)
        with pytest.raises(ManifestFormatError):
            tail = forged[-FOOTER_SIZE:]
            off, num = parse_footer(tail, len(forged), name)
            parse_table(forged[off : off + num * ROW_SIZE], tail, name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_parse_table_rejects_short_table_before_allocating():
    name, data, _ = _pack()
    tail = struct.pack("<QQQHH4s", 8, 2**58, 0, 1, 0, b"DCPK")
    tracemalloc.start()
    try:
        with pytest.raises(ManifestFormatError):
            parse_table(b"", tail, name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("fields", [
    dict(codec=1, elem_size=4, raw_len=2**40, stored_len=10),
    dict(codec=1, elem_size=4, raw_len=10, stored_len=2**40),
    dict(codec=9, elem_size=4, raw_len=10, stored_len=10),
    dict(codec=0, elem_size=5, raw_len=10, stored_len=10),
])
def test_forged_entry_headers_are_rejected(fields):
    head = encode_header(b"\x01" * 16, fields["codec"], fields["elem_size"], fields["raw_len"],
                         fields["stored_len"], None)
    with pytest.raises(ManifestFormatError):
        decode_header(head, "test")
    with pytest.raises(ManifestFormatError):
        decode_header(head[:40], "test")
    good = encode_header(b"\x01" * 16, 1, 4, 100, 50, None)
    assert decode_header(good, "t")[:6] == (b"\x01" * 16, 1, 4, 100, 50, None)
    with pytest.raises(ManifestFormatError):
        decode_header(good[:10] + bytes([good[10] ^ 1]) + good[11:], "t")  # checksum


def test_forged_pack_in_store_is_ignored_by_index(mem_store, rng):
    x = {"x": random_array(rng, "float32", (10_000,))}
    mem_store.save("ok", x)
    victim = sorted(packs_of_checkpoint(mem_store, "ok"))[0]
    mutate_object(mem_store.backend, pack_key(victim),
                  lambda d: bytes(d[:-FOOTER_SIZE]) + _footer(8, 2**60, 0))
    packs, dropped = mem_store.rebuild_index()  # no exception, no huge allocation
    assert packs >= 1 and dropped == 0
    # The forged table is ignored; the intact entries are recovered from their own headers.
    assert_items_equal(x, mem_store.load("ok"))
    from deltackpt.store.verify import verify_store

    report = verify_store(mem_store, level=1)
    assert [p.kind for p in report.problems] == ["pack-hash"] and report.problems[0].pack == victim


# -- delta chunks (the reader's two-chunk path) --------------------------------------------------------------


def _delta_store(store, rng, *, base_in_store=True, base_is_delta=False):
    n = 4096
    base = random_array(rng, "float32", (n // 4,)).tobytes()
    target = bytearray(base)
    target[100:140] = rng.bytes(40)
    target = bytes(target)
    base_id, target_id = chunk_id_of(base), chunk_id_of(target)
    pb = PackBuilder()
    doomed = None
    if not base_in_store:
        # Commit refuses a delta whose base is unknown, so store the base in its own pack, commit, and
        # then lose that pack (as after a disk error or a buggy external cleanup).
        bp = PackBuilder()
        bp.add(base_id, codec.ZSTD, 4, n, codec.encode_planes(base, 4, 1))
        doomed, bdata, bentries = bp.seal()
        store.backend.put(pack_key(doomed), bdata)
        store.index.add(bentries, {doomed: len(bdata)})
    if base_in_store:
        if base_is_delta:
            other = rng.bytes(n)
            pb.add(chunk_id_of(other), codec.RAW, 1, n, other)
            pb.add(base_id, codec.DELTA, 4, n, codec.encode_delta(base, other, 4, 1), chunk_id_of(other))
        else:
            pb.add(base_id, codec.ZSTD, 4, n, codec.encode_planes(base, 4, 1))
    pb.add(target_id, codec.DELTA, 4, n, codec.encode_delta(target, base, 4, 1), base_id)
    name, data, entries = pb.seal()
    store.backend.put(pack_key(name), data)
    item = Item(key="t", kind="array", nbytes=n, chunks=[ChunkRef(target_id, n)], dtype="<f4", elem_size=4,
                shape=[n // 4])
    if base_is_delta:
        # The commit check rejects a delta whose base is a delta; write the manifest past it.
        store.index.add(entries, {name: len(data)})
        manifest = Manifest(name="delta", store_id=store.config.store_id, created_ns=1, items=[item],
                            stats=Stats())
        store.backend.put("manifests/delta", encode_manifest(manifest))
    else:
        store.commit("delta", [item], entries=entries, packs={name: len(data)})
    if doomed is not None:
        store.backend.delete(pack_key(doomed))
        store.refresh_index()
    return target, base_id, target_id


def test_commit_refuses_delta_without_base(mem_store, rng):
    n = 4096
    base, target = rng.bytes(n), rng.bytes(n)
    pb = PackBuilder()
    pb.add(chunk_id_of(target), codec.DELTA, 4, n, codec.encode_delta(target, base, 4, 1), chunk_id_of(base))
    name, data, entries = pb.seal()
    mem_store.backend.put(pack_key(name), data)
    item = Item(key="t", kind="array", nbytes=n, chunks=[ChunkRef(chunk_id_of(target), n)], elem_size=4)
    with pytest.raises(MissingChunkError):
        mem_store.commit("delta", [item], entries=entries, packs={name: len(data)})
    assert not mem_store.exists("delta")


def test_delta_chunk_reads_through_its_base(mem_store, rng):
    target, _, _ = _delta_store(mem_store, rng)
    assert mem_store.load("delta")["t"].tobytes() == target
    with mem_store.open_checkpoint("delta") as r:
        assert r.read("t", 90, 60).tobytes() == target[90:150]


@pytest.mark.parametrize("variant", ["missing-base", "delta-base"])
def test_delta_with_bad_base_is_corrupt(make_store, rng, variant):
    mem_store = make_store(max_chain=1)  # a store without delta-chains: a delta base must be a keyframe
    _, base_id, target_id = _delta_store(mem_store, rng, base_in_store=variant != "missing-base",
                                         base_is_delta=variant == "delta-base")
    with pytest.raises(CorruptChunkError) as ei:
        mem_store.load("delta")
    assert ei.value.chunk_id == target_id.hex()
    assert ei.value.base_chunk_id == base_id.hex()
    assert ei.value.checkpoint == "delta" and ei.value.item == "t"


@pytest.mark.parametrize("found_by", ["load", "verify"])
def test_a_chunk_found_damaged_is_written_again_by_the_next_save_not_reused(local_store, rng, found_by):
    from deltackpt.store.verify import verify_store

    store = local_store
    frozen = random_array(rng, "float32", (20_000,))  # a frozen layer: the same bytes in every save
    store.save("c1", {"frozen": frozen, "w": random_array(rng, "float32", (3000,))})
    _ref, victim = _entry_of(store, "c1", "frozen", 0)
    flip_bit(store.backend, pack_key(victim.pack), victim.offset + HEADER_SIZE + victim.stored_len // 2, 3)
    if found_by == "load":
        with pytest.raises(CorruptChunkError):
            store.load("c1")
    else:
        assert not verify_store(store, level=1).ok
    assert victim.pack in store.index.damaged_packs()
    w2 = random_array(rng, "float32", (3000,))
    store.save("c2", {"frozen": frozen, "w": w2})  # before: the damaged chunk deduplicated, c2 unrestorable
    assert_items_equal({"frozen": frozen, "w": w2}, Store.open(store.backend.root).load("c2"))
    np.testing.assert_array_equal(store.load("c1")["frozen"], frozen)  # c1 heals: same chunk id, new copy
    packs_of_c2 = packs_of_checkpoint(store, "c2")
    # A rebuild from the packs does not trust a damaged pack again; one c2 wrote anew (its bytes, the same
    # chunks again, may even give it the same name) is not damaged.
    assert store.index.damaged_packs() == ({victim.pack} - packs_of_c2)
    store.index.rebuild()
    assert store.index.damaged_packs() == ({victim.pack} - packs_of_c2)
    for name in ("c1", "c2"):
        np.testing.assert_array_equal(store.load(name)["frozen"], frozen)
    assert verify_store(store, level=2).ok


def test_a_damaged_base_marks_its_own_pack_and_the_next_save_writes_it_again(local_store, rng):
    store = local_store
    a = random_array(rng, "float32", (store.config.chunk_size_bytes // 4,))  # one chunk
    x = a.copy()
    x[::50] += np.float32(1e-3)  # close to a: stored as a delta on it
    store.save("c1", {"t": a})
    store.save("c2", {"t": x})
    _ref, base = _entry_of(store, "c1", "t", 0)
    _ref, delta = _entry_of(store, "c2", "t", 0)
    assert delta.base_id == base.chunk_id and delta.pack != base.pack
    flip_bit(store.backend, pack_key(base.pack), base.offset + HEADER_SIZE + base.stored_len // 2, 3)
    with pytest.raises(CorruptChunkError):
        store.load("c2")
    assert store.index.damaged_packs() == {base.pack}  # the base's pack, not the delta's
    store.save("c3", {"t": a})  # the run resumes from c1's state
    np.testing.assert_array_equal(Store.open(store.backend.root).load("c3")["t"], a)


def test_a_mark_made_by_another_process_reaches_a_running_writer(local_store, rng):
    from deltackpt.store.verify import verify_store

    store = local_store  # a trainer's store, open for the whole run
    frozen = random_array(rng, "float32", (5000,))
    store.save("c1", {"frozen": frozen, "w": random_array(rng, "float32", (800,))})
    assert store.index.damaged_packs() == frozenset()  # read (and cached) before the mark
    _ref, victim = _entry_of(store, "c1", "frozen", 0)
    flip_bit(store.backend, pack_key(victim.pack), victim.offset + HEADER_SIZE + victim.stored_len // 2, 3)
    cron = Store.open(store.backend.root)  # a scheduled verify: another Store, the same cache
    assert not verify_store(cron, level=1).ok
    Store.open(store.backend.root).index.mark_damaged(["00" * 16])  # and another mark, from elsewhere
    store.save("c2", {"frozen": frozen, "w": random_array(rng, "float32", (800,))})
    np.testing.assert_array_equal(Store.open(store.backend.root).load("c2")["frozen"], frozen)
    assert Store.open(store.backend.root).index.damaged_packs() >= {"00" * 16}  # neither mark lost the other

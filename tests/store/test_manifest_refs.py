"""A checkpoint's chunk refs read into arrays (Store.read_manifest_refs, for verify and gc): the C reader of the
canonical form, the general reading it defers to, damaged manifests on that path, and the id-set collector
that gathers the refs of a history."""

from __future__ import annotations

import struct
import tracemalloc
from contextlib import contextmanager

import msgspec
import numpy as np
import pytest
import xxhash
import zstandard

from deltackpt import kernels
from deltackpt.errors import CorruptManifestError
from deltackpt.store import ChunkRef, Item, Manifest, Stats, idset
from deltackpt.store.gc import live_chunk_ids, plan_gc
from deltackpt.store.manifest import MANIFEST_MAGIC, decode_manifest, encode_manifest, manifest_key, refs_from_body
from deltackpt.store.refstream import stream_manifest_ids
from deltackpt.store.verify import verify_store
from store_helpers import random_array

native = pytest.mark.skipif(kernels.chunk_refs is None, reason="the native kernels are not in use")


def _ids(n: int, seed: int = 0) -> list[bytes]:
    return [xxhash.xxh3_128_digest(struct.pack("<QQ", seed, i)) for i in range(n)]


def test_refs_ends_are_skip_plus_length(monkeypatch):
    """Each ref's end (skip + length), beside its id, the same from the C reader and the general one."""
    refs = [ChunkRef(cid, length, skip) for cid, length, skip in zip(_ids(300), [0, 5, 127, 128, 70_000, 2**30] * 50,
                                                                     [0, 1, 2**30] * 100)]
    m = Manifest(name="c", store_id="s", created_ns=0, stats=Stats(), items=[
        Item(key="a", kind="bytes", nbytes=sum(r.length for r in refs[:200]), chunks=refs[:200]),
        Item(key="b", kind="bytes", nbytes=sum(r.length for r in refs[200:]), chunks=refs[200:])])
    body = msgspec.msgpack.encode(m)
    want = [r.skip + r.length for r in refs]
    got = refs_from_body(body, with_ends=True)
    assert got.ends.tolist() == want and got.ids.tobytes() == b"".join(r.id for r in refs)
    assert refs_from_body(body).ends is None
    monkeypatch.setattr(kernels, "chunk_refs", None)
    assert refs_from_body(body, with_ends=True).ends.tolist() == want


def test_collector_keeps_the_largest_end_of_each_id(rng):
    pool = idset.from_ids(b"".join(_ids(5000)))
    c, want = idset.Collector(with_ends=True), {}
    for k in range(8):
        ids = pool[rng.integers(0, pool.size, size=int(rng.integers(0, 9000)))].copy()
        ends = rng.integers(0, 2**31 + 1, ids.size, dtype=np.uint32)
        for i, e in zip(ids.tolist(), ends.tolist()):
            want[i] = max(want.get(i, 0), e)
        if k % 2:
            c.add(ids, ends)
        else:  # as a stream hands its stage over: the ids not known yet, with room past them
            new, new_ends = c.fresh(ids, ends)
            room, room_ends = np.empty(new.size + 99, dtype=idset.ID), np.empty(new.size + 99, dtype=np.uint32)
            room[:new.size], room_ends[:new.size] = new, new_ends
            c.take(room, new.size, room_ends)
    got, ends = c.result_with_ends()
    assert got.tolist() == sorted(want) and ends.tolist() == [want[i] for i in got.tolist()]
    with pytest.raises(ValueError):
        idset.Collector().add(got, ends)  # ends only to a collector made with_ends


@native
def test_native_reads_the_canonical_form():
    refs = [ChunkRef(cid, length, skip) for cid, length, skip in zip(_ids(300), [0, 5, 127, 128, 70_000, 2**30] * 50,
                                                                     [0, 1, 2**30] * 100)]
    out = np.zeros(301, dtype=idset.ID)
    assert kernels.chunk_refs(msgspec.msgpack.encode(refs), out, 16) == (300, sum(r.length for r in refs))
    assert out[1:].tobytes() == b"".join(r.id for r in refs) and out[0] == np.zeros(1, dtype=idset.ID)[0]
    ref = b"\x92\xc4\x10" + bytes(16)
    wide = b"\x91" + ref + b"\xcf" + (1000).to_bytes(8, "big")  # any unsigned width: a uint64 of a small length
    assert kernels.chunk_refs(wide, out, 16) == (1, 1000)
    for past in (2**30 + 1, 2**40):  # past a chunk's size: left to the schema, which refuses it
        assert kernels.chunk_refs(b"\x91" + ref + b"\xcf" + past.to_bytes(8, "big"), out, 16) is None
        assert kernels.chunk_refs(b"\x91\x93" + ref[1:] + b"\x01\xcf" + past.to_bytes(8, "big"), out, 16) is None


@native
@pytest.mark.parametrize("raw", [
    b"\x91\x92\xc5\x00\x10" + bytes(16) + b"\x01",  # bin16 header: valid msgpack, not the canonical form
    b"\x91\x93\xc4\x10" + bytes(16) + b"\x01\xd0\x01",  # a signed encoding of a non-negative skip
    b"\x91\x93\xc4\x10" + bytes(16) + b"\x01\xff",  # a negative skip
    b"\x91\x93\xc4\x0f" + bytes(15) + b"\x01\x00",  # a 15-byte id
    b"\x91\x94\xc4\x10" + bytes(16) + b"\x01\x00\x00",  # four fields
    b"\x92\x92\xc4\x10" + bytes(16) + b"\x01",  # two refs announced, one present
    b"\x91\x92\xc4\x10" + bytes(16) + b"\x01\x00",  # a trailing byte
    b"\xdd\xff\xff\xff\xff\x92\xc4\x10" + bytes(16) + b"\x01",  # a forged count: nothing is sized from it
    b"\x92\x92\xc4\x10" + bytes(16) + b"\xcf" + b"\xff" * 8 + b"\x92\xc4\x10" + bytes(16) + b"\x01",  # sum > 64 bits
])
def test_native_defers_every_other_form(raw):
    """None: the caller reads these with msgspec, which accepts or refuses them (never the C reader)."""
    assert kernels.chunk_refs(raw, np.zeros(4, dtype=idset.ID), 0) is None


@native
def test_native_refuses_to_write_past_the_buffer():
    raw = msgspec.msgpack.encode([ChunkRef(cid, 1) for cid in _ids(4)])
    assert kernels.chunk_refs(raw, np.zeros(4, dtype=idset.ID), 16) is None
    assert kernels.chunk_refs(raw, np.zeros(4, dtype=idset.ID), 80) is None


@contextmanager
def _nothing():
    yield


def _reseal_name(store, name: str, data: bytes) -> None:
    """Store manifest ``data`` (another checkpoint's) as checkpoint ``name``'s, renamed and resealed."""
    d = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(data[5:-8]))
    d["name"] = name
    out = MANIFEST_MAGIC + b"\x01" + zstandard.ZstdCompressor().compress(msgspec.msgpack.encode(d))
    store.backend.put(manifest_key(name), out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out)))


def _reseal(store, name: str, edit) -> None:
    """Rewrite checkpoint ``name``'s manifest with ``edit`` applied to its fields, the envelope kept valid:
    damage only the strict schema can find."""
    key = manifest_key(name)
    data = store.backend.get(key)
    d = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(data[5:-8]))
    edit(d)
    out = MANIFEST_MAGIC + b"\x01" + zstandard.ZstdCompressor().compress(msgspec.msgpack.encode(d))
    store.backend.put(key, out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out)))


DAMAGE = {
    "length sum": lambda d: d["items"][0]["chunks"][0].__setitem__(1, d["items"][0]["chunks"][0][1] + 1),
    "short id": lambda d: d["items"][0]["chunks"][0].__setitem__(0, b"x" * 15),
    "negative skip": lambda d: d["items"][0]["chunks"][-1].append(-1) if len(d["items"][0]["chunks"][-1]) == 2
    else d["items"][0]["chunks"][-1].__setitem__(2, -1),
    "ref as a map": lambda d: d["items"][0]["chunks"].__setitem__(0, {"id": b"x" * 16}),
    "unknown item field": lambda d: d["items"][0].__setitem__("extra", 1),
    "elem size": lambda d: d["items"][0].__setitem__("elem_size", 3),
    "stats type": lambda d: d["stats"].__setitem__("num_chunks", "many"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_manifest_is_refused_on_the_refs_path(make_store, rng, damage):
    store = make_store("memory", "m")
    w = random_array(rng, "float32", (40 * 1024,))
    store.save("a", {"w": w, "v": w[:1000] + 1})
    store.save("b", {"w": w + 1})
    _reseal(store, "b", DAMAGE[damage])
    with pytest.raises(CorruptManifestError) as full:
        store.read_manifest("b")
    with pytest.raises(CorruptManifestError) as refs:
        store.read_manifest_refs("b")
    assert refs.value.checkpoint == full.value.checkpoint == "b"
    r = verify_store(store, level=0)
    assert [(p.kind.value, p.checkpoints) for p in r.problems] == [("manifest", ["b"])]
    assert r.num_checkpoints == 1
    with pytest.raises(CorruptManifestError):
        live_chunk_ids(store)  # gc never plans from a manifest it cannot read
    with pytest.raises(CorruptManifestError):
        plan_gc(store, grace_s=0)


def test_refs_path_matches_the_manifest_and_keeps_gc_and_verify_right(make_store, rng):
    store = make_store("memory", "m")
    w = random_array(rng, "float32", (64 * 1024,))
    store.save("a", {"w": w, "empty": np.zeros(0, np.float32), "b": b"bytes"})
    w2 = w.copy()
    w2[::4096] += 1
    store.save("b", {"w": w2})
    for name in ("a", "b"):
        m, refs = store.read_manifest(name), store.read_manifest_refs(name)
        assert refs.ids.tobytes() == b"".join(r.id for it in m.items for r in it.chunks)
        assert refs.item_end.tolist() == np.cumsum([len(it.chunks) for it in m.items]).tolist()
        assert refs.ids.base is None  # an array of its own, which the id-set collector may grow in place
    every = {r.id for name in ("a", "b") for it in store.read_manifest(name).items for r in it.chunks}
    live = live_chunk_ids(store)
    assert set(idset.from_ids(sorted(every)).tolist()) <= set(live.tolist())
    assert verify_store(store, level=2).clean


def test_collector_is_the_sorted_unique_union(rng):
    c = idset.Collector()
    pool = idset.from_ids(b"".join(_ids(50_000)))
    batches = [pool[rng.integers(0, pool.size, size=int(rng.integers(0, 30_000)))].copy() for _ in range(12)]
    batches.append(pool[:0].copy())
    batches.append(idset.from_ids(b"".join(_ids(3))))  # read-only: kept by copy, never written
    for b in batches:
        c.add(b)
    got = c.result()
    assert got.tobytes() == np.unique(np.concatenate(batches)).tobytes()
    assert c.result().size == 0  # the set was handed over


def test_argsort_is_the_stable_memcmp_order(rng):
    raw = rng.integers(0, 3, (5000, 16), dtype=np.uint8)  # many repeats and shared prefixes
    raw[:, 15] = rng.integers(0, 256, 5000)  # ids that differ in the last byte only, trailing zeros among them
    ids = raw.view("V16").ravel()
    order = idset.argsort(ids)
    assert order.tolist() == sorted(range(ids.size), key=lambda i: (ids[i].tobytes(), i))


def test_collector_of_a_large_set_looks_ids_up_through_its_buckets(rng, monkeypatch):
    monkeypatch.setattr(idset, "_SORTED_SEARCH_ABOVE", 1000)  # the bucket table from 1,000 ids on
    found = []
    real = idset.bucket_starts
    monkeypatch.setattr(idset, "bucket_starts", lambda ids: found.append(ids.size) or real(ids))
    c = idset.Collector()
    pool = idset.from_ids(b"".join(_ids(20_000)))
    batches = [pool[rng.integers(0, pool.size, size=3000)].copy() for _ in range(10)]
    for b in batches:
        c.add(b)
    assert found, "the set grew past the threshold: its look-ups went through a bucket table"
    assert c.result().tobytes() == np.unique(np.concatenate(batches)).tobytes()


@native  # without the C reader the refs are decoded into objects (~300 B each): correct, not lean
def test_verify_level_0_memory_per_unique_chunk(make_store, rng):
    """A checkpoint of 20k chunks: verify level 0 holds the set of ids (16 B a chunk, room for ~15 % more
    reserved but never touched: tracemalloc counts it), beside each the largest end of the refs to it (4 B,
    until the structure check, whose base nodes then use the same memory), its structure arrays (~6 B) and a
    manifest's stream buffers (~300 KiB whatever its size: 15 B a chunk here, less at scale). It took ~290 B
    per chunk when each manifest was decoded into objects, ~70 when whole manifests were read into arrays."""
    store = make_store("memory", "m", chunk_size_bytes=4096)
    w = random_array(rng, "float32", (20_000 * 1024,))
    store.save("a", {"w": w})
    w[::1024 * 100] += 1
    store.save("b", {"w": w})
    unique = store.index.num_chunks()
    verify_store(store, level=0)  # warm (the index, imports)
    tracemalloc.start()
    try:
        assert verify_store(store, level=0).clean
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak / unique < 49, peak / unique


# -- the streaming reading (refstream) -------------------------------------------------------------------------
streams = pytest.mark.skipif(kernels.walk_refs is None, reason="the native kernels are not in use")


def _history(make_store, rng):
    store = make_store("memory", "m", chunk_size_bytes=4096)
    w = random_array(rng, "float32", (64 * 1024,))
    store.save("a", {"w": w, "empty": np.zeros(0, np.float32), "b": b"bytes", "w2": w[:5000] + 1})
    w2 = w.copy()
    w2[::4096] += 1
    store.save("b", {"w": w2})
    return store


@streams
@pytest.mark.parametrize("tiny", [False, True])
def test_streamed_ids_are_the_manifests_refs(make_store, rng, tiny):
    from test_fuzz_parsers import tiny_stream_buffers

    store = _history(make_store, rng)
    with tiny_stream_buffers() if tiny else _nothing():
        for name in ("a", "b"):
            got = stream_manifest_ids(store.backend, manifest_key(name), name, lambda ids: ids)
            if tiny:
                buf, n = got
                assert buf[:n].tobytes() == store.read_manifest_refs(name).ids.tobytes()
                buf, n, ends = stream_manifest_ids(store.backend, manifest_key(name), name, lambda *a: a, True)
                refs = store.read_manifest_refs(name, with_ends=True)
                assert buf[:n].tobytes() == refs.ids.tobytes() and ends[:n].tolist() == refs.ends.tolist()
            else:  # under 64 KiB: read whole (one read), then the general way
                assert got == store.backend.get(manifest_key(name))
        c = idset.Collector()
        for name in ("a", "b"):
            store.add_manifest_ids(name, c)
    every = np.concatenate([store.read_manifest_refs(n).ids for n in ("a", "b")])
    assert c.result().tobytes() == np.unique(every).tobytes()


@streams
def test_a_manifest_replaced_while_streamed_is_read_whole(make_store, rng):
    """Forgotten and saved again between two ranged reads: the checksum fails, and the general reading decides
    (here: the new manifest's refs, never a mix of the two)."""
    from test_fuzz_parsers import tiny_stream_buffers

    store = _history(make_store, rng)
    key, replacement = manifest_key("a"), store.backend.get(manifest_key("b"))
    old_ids = store.read_manifest_refs("a").ids
    real = store.backend.get_range_into
    calls = []

    def swap_after_first_read(k, offset, buffers):
        n = real(k, offset, buffers)
        if k == key and not calls:
            calls.append(offset)
            _reseal_name(store, "a", replacement)
        return n

    store.backend.get_range_into = swap_after_first_read
    with tiny_stream_buffers():
        assert stream_manifest_ids(store.backend, key, "a", lambda ids: ids) is None
        c = idset.Collector()
        store.add_manifest_ids("a", c)
    assert calls and c.result().tobytes() == np.unique(store.read_manifest_refs("a").ids).tobytes()
    assert store.read_manifest_refs("a").ids.tobytes() != old_ids.tobytes()


@streams
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_manifest_adds_nothing(make_store, rng, damage):
    from test_fuzz_parsers import tiny_stream_buffers

    store = _history(make_store, rng)
    _reseal(store, "b", DAMAGE[damage])
    c = idset.Collector()
    with tiny_stream_buffers():  # streamed (the manifests are small), refused, then read the general way
        assert stream_manifest_ids(store.backend, manifest_key("b"), "b", lambda ids: ids) is None
        store.add_manifest_ids("a", c)
        with pytest.raises(CorruptManifestError) as streamed:
            store.add_manifest_ids("b", c)
    with pytest.raises(CorruptManifestError) as whole:
        store.read_manifest_refs("b")
    assert str(streamed.value) == str(whole.value)
    assert c.result().tobytes() == np.unique(store.read_manifest_refs("a").ids).tobytes()


def test_manifests_are_written_with_a_small_zstd_window():
    """What lets a streaming reader hold a 64 KiB window instead of the whole decompressed body."""
    refs = [ChunkRef(cid, 4096) for cid in _ids(8000)]
    m = Manifest(name="a", store_id="ab" * 16, created_ns=1, stats=Stats(),
                 items=[Item(key="w", kind="bytes", nbytes=4096 * len(refs), chunks=refs)])
    frame = encode_manifest(m)[5:-8]
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size > 1 << 17 and params.window_size <= 1 << 16
    assert decode_manifest(encode_manifest(m)) == m


def test_collector_grows_into_the_room_it_was_handed(rng):
    """take(): the first buffer becomes the set where it is, later ids are merged into its room (no copy of the
    set), and the result is the sorted unique union, shrunk to it."""
    pool = idset.from_ids(b"".join(_ids(5000)))
    buf = np.empty(4000, dtype=idset.ID)
    buf[:3000] = pool[rng.integers(0, 2500, size=3000)]
    first = buf[:3000].copy()
    c = idset.Collector()
    c.take(buf, 3000)
    assert c._buf is buf  # adopted, not copied
    more = [pool[rng.integers(0, 5000, size=400)].copy() for _ in range(3)]
    for m in more:
        c.add(m)
    c._merge()
    assert c._buf is buf  # merged into its room
    got = c.result()
    assert got.tobytes() == np.unique(np.concatenate([first, *more])).tobytes() and got.size <= 4000

"""The read path's fast lanes: scatter reads (Backend.get_range_into), whole chunks decoded straight into
the destination, per-thread scratch for coded payloads and delta bases; and that it still verifies."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import numpy as np
import pytest

from deltackpt.errors import CorruptChunkError, MissingChunkError
from deltackpt.store.backend import LocalFiles
from deltackpt.store import LocalBackend, MemoryBackend, Store, codec, deltapolicy
from deltackpt.store.pack import HEADER_SIZE, pack_key
from deltackpt.store.source import ChunkSource
from deltackpt.store.threads import usable_cores

from store_helpers import flip_bit

# -- Backend.get_range_into ----------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "local"])
def backend(request, tmp_path):
    return MemoryBackend() if request.param == "memory" else LocalBackend(tmp_path / "root", fsync=False)


def test_get_range_into_scatters_like_get_range(backend):
    data = os.urandom(10_000)
    backend.put("k", data)
    a, b, c = bytearray(64), np.empty(1000, np.uint8), bytearray(0)
    assert backend.get_range_into("k", 100, [a, c, b]) == 1064
    assert bytes(a) == data[100:164] and b.tobytes() == data[164:1164]
    # past the end: fewer bytes, the rest of the buffers untouched
    tail = np.full(500, 7, np.uint8)
    assert backend.get_range_into("k", 9_800, [tail]) == 200
    assert tail[:200].tobytes() == data[9_800:] and (tail[200:] == 7).all()
    assert backend.get_range_into("k", 20_000, [bytearray(8)]) == 0
    assert backend.get_range_into("k", 5, []) == 0
    with pytest.raises(FileNotFoundError):
        backend.get_range_into("nope", 0, [bytearray(1)])
    with pytest.raises(ValueError):
        backend.get_range_into("k", -1, [bytearray(1)])
    with pytest.raises(ValueError):
        backend.get_range_into("../x", 0, [bytearray(1)])


# -- whole chunks straight into the destination ------------------------------------------------------------


def _codecs(store: Store) -> Counter:
    return Counter(codec.CODEC_NAMES[e.codec] for e in store.index.iter_entries())


@pytest.fixture(params=[codec.DELTA, codec.ZDELTA], ids=["xor", "zigzag"])
def delta_kind(request, monkeypatch):
    """The delta codec the writer picks for chunks too small to sample (all of ``delta_store``'s)."""
    monkeypatch.setattr(deltapolicy, "DEFAULT_DELTA_CODEC", request.param)
    return request.param


@pytest.fixture(params=["memory", "local"])
def delta_store(request, tmp_path, delta_kind):
    """A store whose checkpoint "c1" holds raw, zstd and delta chunks (16 KiB chunks) of codec ``delta_kind``."""
    backend = MemoryBackend() if request.param == "memory" else LocalBackend(tmp_path / "st", fsync=False)
    store = Store.init(backend, cache_dir=tmp_path / "cache", chunk_size_bytes=16384)
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(80_000) * 0.05).astype(np.float32)
    items = {"w": w, "noise": rng.integers(0, 256, 70_000, dtype=np.uint8), "kept": w[::-1].copy()}
    store.save("c0", items)
    items = dict(items, w=(w + rng.standard_normal(w.size).astype(np.float32) * 1e-6).astype(np.float32))
    store.save("c1", items)
    assert {"raw", "zstd", codec.CODEC_NAMES[delta_kind]} <= set(_codecs(store))
    return store, {k: np.ascontiguousarray(v).view(np.uint8).reshape(-1) for k, v in items.items()}


def test_whole_chunks_decode_into_destination_without_intermediate_arrays(delta_store, monkeypatch):
    store, raw = delta_store

    def no_get(*a, **k):
        raise AssertionError("a whole-chunk read must not go through ChunkSource.get")

    monkeypatch.setattr(ChunkSource, "get", no_get)
    with store.open_checkpoint("c1") as r:
        r.num_threads = 3
        for key, want in raw.items():
            out = np.full(want.size, 0xEE, np.uint8)
            r.read_into(key, out)
            assert np.array_equal(out, want), key


def test_partial_reads_are_cached_copies_not_scratch(delta_store):
    store, raw = delta_store
    cs = 16384
    with store.open_checkpoint("c1") as r:
        r.num_threads = 1
        first = r.source.get(r.item("w").chunks[0].id)
        snapshot = np.array(first, copy=True)
        # Decode every other chunk on this thread (reusing its scratch); the cached chunk must not change.
        for key in raw:
            r.read(key)
        assert np.array_equal(first, snapshot)
        # Ranges inside and across chunks (the cached path), then whole chunks again.
        for lo, hi in [(10, 20), (cs - 3, cs + 5), (5 * cs + 1, 9 * cs - 1), (0, raw["w"].size)]:
            assert np.array_equal(r.read("w", lo, hi - lo), raw["w"][lo:hi])


def test_many_threads_share_nothing_but_the_destination(delta_store):
    store, raw = delta_store
    with store.open_checkpoint("c1") as r:
        r.num_threads = 8
        for _ in range(3):
            got = r.read_all()
            for key, want in raw.items():
                assert np.array_equal(got[key], want), key


# -- verification on the fast lanes --------------------------------------------------------------------------


def _first_entry(store, codec_id, key):
    m = store.read_manifest("c1").item_map()[key]
    for i, ref in enumerate(m.chunks):
        e = store.index.lookup(ref.id)
        if e.codec == codec_id:
            return i, ref, e
    raise AssertionError(f"no {codec.CODEC_NAMES[codec_id]} chunk in {key}")


@pytest.mark.parametrize("victim", ["raw", "zstd", "delta", "delta-base"])
def test_damage_on_each_lane_is_a_corrupt_chunk(delta_store, delta_kind, victim):
    store, raw = delta_store
    key, cid = {"raw": ("noise", codec.RAW), "zstd": ("kept", codec.ZSTD)}.get(victim, ("w", delta_kind))
    index, ref, entry = _first_entry(store, cid, key)
    damaged = store.index.lookup(entry.base_id) if victim == "delta-base" else entry
    # flip a bit in the middle of the payload (the base's payload for "delta-base")
    flip_bit(store.backend, pack_key(damaged.pack), damaged.offset + HEADER_SIZE + damaged.stored_len // 2, 2)

    fresh = Store.open(store.backend, cache_dir=store.cache_dir)
    with fresh.open_checkpoint("c1") as r:
        out = np.empty(raw[key].size, np.uint8)
        with pytest.raises(CorruptChunkError) as ei:
            r.read_into(key, out)
        err = ei.value
        assert (err.chunk_id, err.pack, err.checkpoint, err.item) == (ref.id.hex(), entry.pack, "c1", key)
        if victim == "delta-base":
            assert err.base_chunk_id == entry.base_id.hex()
        # The failed read left nothing behind: other chunks and items still read, on the same threads.
        cs = 16384
        lo = (index + 1) * cs
        assert np.array_equal(r.read(key, lo), raw[key][lo:])
        other = "kept" if key != "kept" else "noise"
        assert np.array_equal(r.read(other), raw[other])


def test_truncated_raw_entry_is_a_corrupt_chunk(tmp_path):
    store = Store.init(LocalBackend(tmp_path / "st", fsync=False), chunk_size_bytes=16384)
    noise = np.random.default_rng(3).integers(0, 256, 40_000, dtype=np.uint8)
    store.save("c", {"n": noise})
    # The chunk written last into its pack (chunks are coded in parallel, so not always the item's last):
    # truncating inside it damages it alone.
    refs = store.read_manifest("c").item_map()["n"].chunks
    ref, entry = max(((r, store.index.lookup(r.id)) for r in refs), key=lambda re: re[1].offset)
    assert entry.codec == codec.RAW
    path = store.backend.root / pack_key(entry.pack)
    os.truncate(path, entry.offset + HEADER_SIZE + entry.stored_len // 2)
    with pytest.raises(CorruptChunkError, match="truncated") as ei:
        store.load("c")
    assert ei.value.chunk_id == ref.id.hex() and ei.value.item == "n"


def test_cold_probe_picks_more_read_threads(tmp_path, monkeypatch):
    """A warm local pack reads as cached (preadv RWF_NOWAIT); a backend that reports chunks off the page
    cache makes looks_cold true and doubles the read threads; a backend that cannot tell counts as warm."""
    from deltackpt.store import MemoryBackend
    from deltackpt.store.reader import CheckpointReader
    from deltackpt.store.threads import default_read_threads

    store = Store.init(LocalBackend(tmp_path / "st", fsync=False), chunk_size_bytes=16384)
    w = np.random.default_rng(12).standard_normal(20_000).astype(np.float32)
    store.save("c", {"w": w})
    entry = store.index.lookup(store.read_manifest("c").item_map()["w"].chunks[0].id)
    key = pack_key(entry.pack)
    (store.backend.root / key).read_bytes()  # now in the page cache
    assert store.backend.is_cached(key, entry.offset) in (True, None)  # None: no RWF_NOWAIT here
    reader = CheckpointReader(store, store.read_manifest("c"))
    jobs = reader.chunk_jobs("w", np.empty(w.nbytes, dtype=np.uint8))
    monkeypatch.setattr(LocalBackend, "is_cached", lambda self, k, off: False)
    assert reader.looks_cold(jobs) and not reader.looks_cold([])
    monkeypatch.setattr(LocalBackend, "is_cached", lambda self, k, off: True)
    assert not reader.looks_cold(jobs)
    assert not isinstance(MemoryBackend(), LocalFiles)  # no page cache to probe: never judged cold
    cores = usable_cores()
    assert default_read_threads(cold=True) == min(8, 2 * cores) and default_read_threads() == min(8, cores)


# -- ChunkSource.differs: a few stored bytes instead of a decode ---------------------------------------------


@pytest.mark.parametrize("head_read_max", [ChunkSource._HEAD_READ_MAX, 0])  # probe read with the header / apart
@pytest.mark.parametrize("key", ["noise", "kept", "w"])  # raw, zstd, delta (XOR or zigzag)
def test_differs_judges_from_stored_planes_without_false_alarms(delta_store, delta_kind, key, head_read_max,
                                                                monkeypatch):
    store, raw = delta_store
    codec_id = {"noise": codec.RAW, "kept": codec.ZSTD, "w": delta_kind}[key]
    monkeypatch.setattr(ChunkSource, "_HEAD_READ_MAX", head_read_max)
    src = ChunkSource(store)
    judged = checked = 0
    pos = 0
    for ref in store.read_manifest("c1").item_map()[key].chunks:
        mine, pos = raw[key][pos:pos + ref.length], pos + ref.length
        entry = store.index.lookup(ref.id)
        if entry.codec != codec_id:
            continue
        es = entry.elem_size
        for skip in (0, es, 40 * es, ref.length - 3 * es, ref.length - 300 * es):
            part = mine[skip:].copy()
            assert not src.differs(ref.id, skip, part), (ref.id.hex(), skip)  # equal bytes never "differ"
            part[:es] ^= 0xFF  # every byte of the first element
            judged += src.differs(ref.id, skip, part)
            checked += 1
        assert not src.differs(ref.id, 1, mine[1:].copy()) or es == 1  # off the element grid: no judgement
    assert checked and judged == checked  # each lane is judged from a plane stored as is


def test_differs_reads_each_entry_once(delta_store):
    """A probe reads a coded entry's header and its first plane's probed bytes together: one read per entry
    (two for a delta: it and its keyframe)."""
    store, raw = delta_store
    src = ChunkSource(store)
    reads = []
    real = store.backend.get_range_into
    store.backend.get_range_into = lambda key, off, bufs: reads.append(key) or real(key, off, bufs)
    ref = store.read_manifest("c1").item_map()["w"].chunks[0]
    assert codec.is_delta(store.index.lookup(ref.id).codec)
    mine = raw["w"][:ref.length].copy()
    mine[:4] ^= 0xFF
    assert src.differs(ref.id, 0, mine) and len(reads) == 2


def test_differs_cannot_judge_when_every_plane_is_compressed(tmp_path):
    store = Store.init(MemoryBackend(), cache_dir=tmp_path / "cache", chunk_size_bytes=16384)
    smooth = (np.arange(40_000) % 7).astype(np.float32)  # every byte plane compresses
    store.save("s", {"x": smooth})
    ref = store.read_manifest("s").item_map()["x"].chunks[0]
    assert store.index.lookup(ref.id).codec == codec.ZSTD
    other = np.frombuffer(smooth.tobytes(), np.uint8)[:ref.length].copy()
    other[:4] ^= 0xFF
    assert not ChunkSource(store).differs(ref.id, 0, other)  # unknown: the caller compares decoded bytes


# -- loads coalesced per pack --------------------------------------------------------------------------------


class _CountingLocal(LocalBackend):
    """A LocalBackend counting the pack opens of reads (each get_ranges_into call opens the file once)."""

    opens = 0

    def get_ranges_into(self, key, ranges):
        if key.startswith("packs/"):
            type(self).opens += 1
        return super().get_ranges_into(key, ranges)


def test_load_of_small_chunks_opens_each_pack_once_per_bundle(tmp_path, monkeypatch):
    from deltackpt.store import reader as reader_mod

    monkeypatch.setattr(_CountingLocal, "opens", 0)
    store = Store.init(_CountingLocal(tmp_path / "st", fsync=False), chunk_size_bytes=4096)
    rng = np.random.default_rng(7)
    items = {
        "noise": rng.integers(0, 256, 600 * 4096, dtype=np.uint8),  # raw chunks, read straight into place
        "w": (rng.standard_normal(300 * 1024) * 0.05).astype(np.float32).view(np.uint8),  # coded, via scratch
        "tiled": np.tile(rng.integers(0, 256, 4096, dtype=np.uint8), 200),  # one chunk stored once, used 200x
    }
    store.save("a", items, num_threads=1)  # one coding thread: each item's chunks back to back in the pack
    assert len(list(store.backend.list("packs/"))) == 1
    _CountingLocal.opens = 0
    with store.open_checkpoint("a", num_threads=2) as r:
        for key, want in items.items():
            out = np.full(want.size, 0xEE, np.uint8)
            r.read_into(key, out)
            assert np.array_equal(out, want), key
        threads = r.num_threads
    # a bundle per BUNDLE_BYTES of an item's chunks, or a few per thread, not an open per chunk (1100 chunks)
    assert _CountingLocal.opens <= sum(max(2 * threads, -(-v.nbytes // reader_mod.BUNDLE_BYTES))
                                       for v in items.values())


def _small_items_store(tmp_path, monkeypatch, count: int, seed: int):
    """A store whose opens are counted, with checkpoint "a" of ``count`` items of 4 KiB (a chunk each)."""
    monkeypatch.setattr(_CountingLocal, "opens", 0)
    store = Store.init(_CountingLocal(tmp_path / "st", fsync=False), chunk_size_bytes=8192)
    rng = np.random.default_rng(seed)
    items = {f"p{i:04d}": (rng.standard_normal(1024) * 0.02).astype(np.float32) for i in range(count)}
    store.save("a", items, num_threads=1)
    _CountingLocal.opens = 0
    return store, items


def test_load_of_many_small_items_reads_them_together(tmp_path, monkeypatch):
    from deltackpt.store import reader as reader_mod

    store, items = _small_items_store(tmp_path, monkeypatch, 400, 8)
    got = store.load("a")
    assert got.keys() == items.keys() and all(np.array_equal(got[k], v) for k, v in items.items())
    # the items' chunks coalesced by pack: a few bundles, not an open per item (400)
    assert _CountingLocal.opens <= 2 * 8 + -(-400 * 4096 // reader_mod.BUNDLE_BYTES)
    victim = store.index.lookup(store.read_manifest("a").item_map()["p0123"].chunks[0].id)
    flip_bit(store.backend, pack_key(victim.pack), victim.offset + HEADER_SIZE + 10)
    with pytest.raises(CorruptChunkError) as ei:
        Store.open(store.backend).load("a")
    assert (ei.value.chunk_id, ei.value.item, ei.value.checkpoint) == (victim.chunk_id.hex(), "p0123", "a")


def test_read_many_into_fills_given_buffers_together_and_checks_their_sizes(tmp_path, monkeypatch):
    store, items = _small_items_store(tmp_path, monkeypatch, 200, 9)
    dest = {k: np.full_like(v, np.nan) for k, v in items.items()}  # DCP's tensors: given, any dtype
    with store.open_checkpoint("a") as r:
        r.read_many_into(dest)
        assert all(np.array_equal(dest[k], v) for k, v in items.items())
        assert _CountingLocal.opens < 20, "coalesced by pack, not an open per item"
        with pytest.raises(ValueError, match="p0001"):
            r.read_many_into({"p0001": np.empty(1023, dtype=np.float32)})
        with pytest.raises(KeyError, match="nope"):
            r.read_many_into({"nope": np.empty(4, dtype=np.uint8)})


def test_damaged_chunk_used_many_times_is_a_corrupt_chunk(tmp_path):
    store = Store.init(LocalBackend(tmp_path / "st", fsync=False), chunk_size_bytes=4096)
    store.save("a", {"z": np.zeros(50 * 4096, np.uint8)})
    (ref,) = {r.id: r for r in store.read_manifest("a").item_map()["z"].chunks}.values()
    entry = store.index.lookup(ref.id)
    flip_bit(store.backend, pack_key(entry.pack), entry.offset + HEADER_SIZE + 10)
    with pytest.raises(CorruptChunkError) as ei:
        store.load("a")
    assert (ei.value.chunk_id, ei.value.item) == (ref.id.hex(), "z")


# -- bundles checked in arrays (ChunkSource.check_reads) ------------------------------------------------------


def _mixed_store(path, delta_kind_store=True):
    """A store whose "c1" holds raw, zstd (elem sizes 1, 2, 4, 8, a partial last element) and delta chunks, and
    one chunk used many times; 4 KiB chunks. Returns (store, {item: bytes})."""
    store = Store.init(LocalBackend(path, fsync=False), chunk_size_bytes=4096)
    rng = np.random.default_rng(11)
    w = (rng.standard_normal(60_000) * 0.05).astype(np.float32)
    items = {"w": w, "noise": rng.integers(0, 256, 50_001, dtype=np.uint8),
             "h": (rng.standard_normal(30_001) * 0.05).astype(np.float16),
             "d": (rng.standard_normal(10_000) * 0.05).astype(np.float64),
             "b": rng.integers(0, 3, 40_000, dtype=np.uint8),
             "tiled": np.tile(rng.integers(0, 256, 4096, dtype=np.uint8), 30)}
    store.save("c0", items, num_threads=1)
    items = dict(items, w=(w + rng.standard_normal(w.size).astype(np.float32) * 1e-6).astype(np.float32))
    store.save("c1", items, num_threads=1)
    return store, {k: np.ascontiguousarray(v).view(np.uint8).reshape(-1) for k, v in items.items()}


def test_bundles_checked_in_arrays_load_what_each_chunk_read_alone_loads(tmp_path, delta_kind, monkeypatch):
    store, want = _mixed_store(tmp_path / "st")
    codecs = {(e.codec, e.elem_size) for e in store.index.iter_entries()}
    assert {(codec.RAW, 1), (codec.ZSTD, 1), (codec.ZSTD, 2), (codec.ZSTD, 4), (codec.ZSTD, 8),
            (delta_kind, 4)} <= codecs
    alone = []  # the chunks a bundle left to decode_read: its deltas only
    real = ChunkSource.decode_read
    monkeypatch.setattr(ChunkSource, "decode_read", lambda self, e, *a, **k: alone.append(e.codec) or real(
        self, e, *a, **k))
    with store.open_checkpoint("c1", num_threads=1) as r:
        for key, data in want.items():
            bundled, single = np.full(data.size, 0xEE, np.uint8), np.full(data.size, 0xDD, np.uint8)
            jobs = r.coalesce(r.chunk_jobs(key, bundled))
            assert len(jobs) < len(r.item(key).chunks) / 4, key  # bundles, not a job per chunk
            for job in jobs:
                r.run_job(job)
            for job in r.chunk_jobs(key, single):  # the general path: each chunk read and decoded on its own
                r.run_job(job)
            assert bundled.tobytes() == single.tobytes() == data.tobytes(), key
    assert alone and set(alone) == {delta_kind}


def _victims(store: Store, key: str) -> dict:
    """One entry of item ``key`` of "c1" for each kind of chunk in it: {codec or "delta": PackEntry}."""
    out = {}
    for ref in store.read_manifest("c1").item_map()[key].chunks:
        e = store.index.lookup(ref.id)
        out.setdefault("delta" if codec.is_delta(e.codec) else e.codec, e)
    return out


@pytest.mark.parametrize("where", ["payload", "header field", "header hash", "truncated"])
@pytest.mark.parametrize("key, kind", [("noise", codec.RAW), ("d", codec.ZSTD), ("h", codec.ZSTD), ("b", codec.ZSTD),
                                       ("w", "delta")])
def test_damage_in_a_bundle_is_named_as_a_single_read_names_it(tmp_path, where, key, kind):
    store, _want = _mixed_store(tmp_path / "st")
    e = _victims(store, key)[kind]
    key_of_pack = pack_key(e.pack)
    if where == "payload":
        flip_bit(store.backend, key_of_pack, e.offset + HEADER_SIZE + e.stored_len - 5)
    elif where == "header field":
        flip_bit(store.backend, key_of_pack, e.offset + 8)  # raw_len: the header disagrees with the index
    elif where == "header hash":
        flip_bit(store.backend, key_of_pack, e.offset + 60)
    else:
        path = store.backend.root / key_of_pack
        os.truncate(path, e.offset + HEADER_SIZE + e.stored_len // 2)
    shutil.copytree(tmp_path / "st", tmp_path / "copy")  # each path reads the damage afresh (a read may rebuild)
    errors = []
    for bundled, root in ((True, tmp_path / "st"), (False, tmp_path / "copy")):
        with Store.open(root).open_checkpoint("c1", num_threads=1) as r:
            out = np.empty(r.item(key).nbytes, np.uint8)
            jobs = r.coalesce(r.chunk_jobs(key, out)) if bundled else r.chunk_jobs(key, out)
            with pytest.raises((CorruptChunkError, MissingChunkError)) as info:
                for job in jobs:
                    r.run_job(job)
            err = info.value
            errors.append((type(err), str(err), err.chunk_id, getattr(err, "pack", None), err.checkpoint, err.item))
    assert errors[0] == errors[1]
    assert errors[0][2] == e.chunk_id.hex() and errors[0][4:] == ("c1", key)
    assert where == "truncated" or (errors[0][0], errors[0][3]) == (CorruptChunkError, e.pack), errors[0]


def _read_entries(store, entries):
    """(buf, at, heads, counts): the entries read one after another into one buffer, as a bundle reads them."""
    buf = np.zeros(sum(e.span for e in entries), np.uint8)
    heads = np.zeros((len(entries), HEADER_SIZE), np.uint8)
    at, counts, pos = [], [], 0
    for k, e in enumerate(entries):
        counts.append(store.backend.get_range_into(pack_key(e.pack), e.offset, [buf[pos:pos + e.span]]))
        heads[k] = buf[pos:pos + HEADER_SIZE]
        at.append(pos + HEADER_SIZE)
        pos += e.span
    return buf, np.array(at), heads, counts


def test_check_reads_passes_good_keyframes_and_leaves_the_rest(tmp_path):
    """check_reads decodes and hashes keyframes itself and says False (raising nothing) for damage."""
    store, want = _mixed_store(tmp_path / "st")
    refs = store.read_manifest("c1").item_map()["d"].chunks[:6]
    entries = [store.index.lookup(ref.id) for ref in refs]
    recs, found = store.index.records([ref.id for ref in refs])
    assert found.all()
    buf, at, heads, counts = _read_entries(store, entries)
    outs = [np.empty(e.raw_len, np.uint8) for e in entries]
    assert recs["codec"].tolist() == [codec.ZSTD] * 6
    heads[1, 20] ^= 1  # a damaged header (its hash no longer matches)
    buf[at[2] + entries[2].stored_len - 1] ^= 0xFF  # damaged stored bytes
    counts[3] -= 1  # a short read
    ok = ChunkSource(store).check_reads(recs, b"".join(ref.id for ref in refs), heads, counts, buf, at, outs)
    assert ok.tolist() == [True, False, False, False, True, True]
    for k in np.flatnonzero(ok):
        assert outs[k].tobytes() == want["d"][4096 * k:4096 * (k + 1)].tobytes()

"""Object-storage I/O: packs upload in a small pool while coding goes on, and loads coalesce nearby chunks into
few ranged requests. Exercised on stores with no local path (a MemoryBackend with counters and hooks, and
the moto S3 server)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from deltackpt.errors import CorruptChunkError
from deltackpt.store import LocalBackend, MemoryBackend, Store
from deltackpt.store import reader as reader_mod
from deltackpt.store import cachedir as cachedir_mod
from deltackpt.store import threads as threads_mod
from deltackpt.store.gc import plan_gc
from deltackpt.store.packsink import UPLOADS_IN_FLIGHT

from store_helpers import assert_items_equal, flip_bit

CHUNK = 64 * 1024


class SlowCountingBackend(MemoryBackend):
    """A MemoryBackend whose pack puts take ``put_s`` and may fail, counting concurrent puts and reads."""

    def __init__(self, put_s: float = 0.0) -> None:
        super().__init__()
        self.put_s = put_s
        self.fail_on_put: int | None = None  # the n-th pack put (1-based) raises self.error
        self.error = OSError("injected: connection reset by peer")
        self.pack_puts = 0
        self.active = 0
        self.max_active = 0
        self.reads = 0
        self.closed = False  # set by a test once abort() returned: no put may start after
        self.late_puts = 0
        self._lock = threading.Lock()

    def put(self, key, data):
        if not key.startswith("packs/"):
            return super().put(key, data)
        with self._lock:
            self.pack_puts += 1
            n = self.pack_puts
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.late_puts += self.closed
        try:
            time.sleep(self.put_s)
            if n == self.fail_on_put:
                raise self.error
            super().put(key, data)
        finally:
            with self._lock:
                self.active -= 1

    def get_range(self, key, offset, length):
        if key.startswith("packs/"):
            with self._lock:
                self.reads += 1
        return super().get_range(key, offset, length)


def _store(tmp_path, backend, **config) -> Store:
    cfg = dict(chunk_size_bytes=CHUNK, pack_target_bytes=4 * CHUNK)
    cfg.update(config)
    return Store.init(backend, cache_dir=tmp_path / "cache", **cfg)


def _items(rng, n_items=6, chunks=8) -> dict:
    return {f"t{i}": rng.standard_normal(chunks * CHUNK // 4).astype(np.float32) for i in range(n_items)}


# -- uploads --------------------------------------------------------------------------------------------------
def test_packs_upload_several_at_once_and_load_bit_exact(tmp_path, rng):
    backend = SlowCountingBackend(put_s=0.02)
    store = _store(tmp_path, backend)
    items = _items(rng)
    store.save("a", items, num_threads=1)  # coding in the caller's thread: without a pool, one put at a time
    assert backend.pack_puts >= 10  # many packs
    # Uploads overlapped each other (and the coding), never more than the pool's size at once.
    assert 2 <= backend.max_active <= UPLOADS_IN_FLIGHT
    assert backend.active == 0
    got = store.load("a")
    for k, v in items.items():
        assert np.array_equal(got[k], v)


def test_failed_upload_surfaces_original_error_and_commits_nothing(tmp_path, rng):
    backend = SlowCountingBackend(put_s=0.005)
    store = _store(tmp_path, backend)
    first = _items(rng, n_items=2)
    store.save("a", first)
    backend.fail_on_put = backend.pack_puts + 3
    with pytest.raises(OSError) as info:
        store.save("b", _items(rng), num_threads=2)
    assert info.value is backend.error
    assert backend.active == 0  # every upload ended before save returned
    assert [o.key for o in backend.list("manifests/")] == ["manifests/a"]
    assert store.checkpoint_names() == ["a"]
    got = store.load("a")
    for k, v in first.items():
        assert np.array_equal(got[k], v)


def test_abort_waits_for_running_uploads(tmp_path, rng):
    backend = SlowCountingBackend(put_s=0.1)
    store = _store(tmp_path, backend)
    w = store.writer(num_threads=2)
    for k, v in _items(rng).items():
        w.add_array(k, v.view(np.uint8), dtype="<f4", elem_size=4, shape=v.shape)
    deadline = time.monotonic() + 10
    while backend.active == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert backend.active >= 1  # an upload is under way when abort comes
    w.abort()
    with backend._lock:
        backend.closed = True
        assert backend.active == 0
    time.sleep(0.3)
    assert backend.late_puts == 0
    assert store.checkpoint_names() == []


# -- coalesced reads ------------------------------------------------------------------------------------------
def _chunks_and_bases(store, name) -> int:
    m = store.read_manifest(name)
    ids = {r.id for it in m.items for r in it.chunks}
    bases = {store.index.lookup(c).base_id for c in ids} - {None}
    return len(ids) + len(bases - ids)


def test_coalesced_loads_are_bit_exact_with_fewer_requests(tmp_path, rng):
    backend = SlowCountingBackend()
    store = _store(tmp_path, backend, pack_target_bytes=16 * CHUNK)
    items = _items(rng)
    store.save("a", items)
    changed = {k: (v + np.float32(1e-3) * rng.standard_normal(v.shape).astype(np.float32) if i % 2 else v)
               for i, (k, v) in enumerate(items.items())}
    store.save("b", changed)
    for name, want in (("a", items), ("b", changed)):
        backend.reads = 0
        with store.open_checkpoint(name) as reader:
            got = reader.read_all()
        for k, v in want.items():
            assert np.array_equal(got[k].view(np.float32), v), (name, k)
        assert backend.reads * 3 <= _chunks_and_bases(store, name), (name, backend.reads)
    # Deltas were decoded through bases fetched in bundles, not one request each.
    m = store.read_manifest("b")
    assert any(store.index.lookup(r.id).base_id for it in m.items for r in it.chunks)


def test_coalesced_bundle_reports_the_damaged_chunk(tmp_path, rng):
    backend = SlowCountingBackend()
    store = _store(tmp_path, backend, pack_target_bytes=16 * CHUNK)
    store.save("a", _items(rng, n_items=2))
    m = store.read_manifest("a")
    victim = m.items[0].chunks[3].id
    entry = store.index.lookup(victim)
    flip_bit(backend, f"packs/{entry.pack[:2]}/{entry.pack}", entry.offset + 64 + entry.stored_len // 2)
    with store.open_checkpoint("a") as reader, pytest.raises(CorruptChunkError) as info:
        reader.read_all()
    assert info.value.chunk_id == victim.hex()


def test_local_store_reads_are_bundled_under_their_own_cap(make_store, rng, monkeypatch):
    monkeypatch.setattr(reader_mod, "BUNDLE_BYTES", 3 * CHUNK)  # not COALESCE_MAX_BYTES: no round trips here
    store = make_store("local", chunk_size_bytes=CHUNK, pack_target_bytes=16 * CHUNK)
    data = rng.integers(0, 256, 8 * CHUNK, dtype=np.uint8)  # raw chunks: the cap fits two
    store.save("a", {"t": data})
    with store.open_checkpoint("a", num_threads=2) as reader:
        out = np.empty(8 * CHUNK, dtype=np.uint8)
        jobs = reader.coalesce(reader.chunk_jobs("t", out))
        assert [len(job[1]) for job in jobs] == [2, 2, 2, 2]
        for job in jobs:
            reader.run_job(job)
    assert np.array_equal(out, data)
    with store.open_checkpoint("a", num_threads=8) as reader:  # a bundle per thread at least: one chunk each
        assert len(reader.coalesce(reader.chunk_jobs("t", out))) == 8


def test_bundles_stay_under_the_size_cap(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(reader_mod, "COALESCE_MAX_BYTES", 3 * CHUNK)
    backend = SlowCountingBackend()
    store = _store(tmp_path, backend, pack_target_bytes=16 * CHUNK)
    data = {"t": rng.integers(0, 256, 8 * CHUNK, dtype=np.uint8)}  # raw chunks: the cap fits two
    store.save("a", data)
    with store.open_checkpoint("a") as reader:
        out = np.empty(8 * CHUNK, dtype=np.uint8)
        jobs = reader.coalesce(reader.chunk_jobs("t", out))
        sizes = [sum(store.index.lookup(j[2].id).span for j in job[1]) if job[0] is reader_mod._BUNDLE
                 else store.index.lookup(job[2].id).span for job in jobs]
        assert max(sizes) <= 3 * CHUNK and len(jobs) < 8
        for job in jobs:
            reader.run_job(job)
    assert np.array_equal(out, data["t"])


@pytest.mark.timeout(120)
def test_s3_store_loads_with_coalesced_ranged_gets(s3_server, s3_url, tmp_path, rng):
    from deltackpt.store.fsspec_backend import FsspecBackend

    class Counting(FsspecBackend):
        gets = 0

        def get_range(self, key, offset, length):
            if key.startswith("packs/"):
                type(self).gets += 1
            return super().get_range(key, offset, length)

    backend = Counting(s3_url, s3_server.storage_options)
    store = Store.init(backend, cache_dir=tmp_path / "cache", chunk_size_bytes=CHUNK, pack_target_bytes=16 * CHUNK)
    items = _items(rng, n_items=4)
    store.save("a", items, num_threads=1)  # one coding thread: each item's chunks back to back in the packs
    fresh = Store.open(backend, cache_dir=tmp_path / "cache2")
    fresh.refresh_index()  # the index cache rebuilt from the pack tables (two ranged GETs a pack)
    Counting.gets = 0
    got = fresh.load("a")
    for k, v in items.items():
        assert np.array_equal(got[k], v)
    assert Counting.gets <= 8  # 32 chunks of 64 KiB, 16 to a pack: a GET or two per item


# -- pack tables ----------------------------------------------------------------------------------------------
class SlowPackReads:
    """A backend mix-in whose ranged reads of packs take ``read_s``, counting how many run at once."""

    def __init__(self, *args, read_s: float = 0.0) -> None:
        super().__init__(*args)
        self.read_s = read_s
        self.active = 0
        self.max_active = 0
        self._count_lock = threading.Lock()

    def get_range(self, key, offset, length):
        if not key.startswith("packs/"):
            return super().get_range(key, offset, length)
        with self._count_lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.read_s)
            return super().get_range(key, offset, length)
        finally:
            with self._count_lock:
                self.active -= 1


class SlowTableBackend(SlowPackReads, MemoryBackend):
    """Object storage whose pack reads wait (a MemoryBackend is not a local directory)."""


class SlowLocalTables(SlowPackReads, LocalBackend):
    """A directory whose pack reads wait, as on a file system mounted over the network."""


def test_a_new_cache_reads_the_pack_tables_of_object_storage_several_at_once(tmp_path, rng):
    """A host with an empty cache (a spare that took over a dead node's work) reads every pack's table: a
    request each, which waits on the network, so several are in flight; the index is the same as one read
    at a time builds, and gc's plan reads them the same way."""
    backend = SlowTableBackend()
    store = _store(tmp_path, backend)
    items = _items(rng, n_items=8)
    store.save("a", items)
    assert len(list(backend.list("packs/"))) >= 10
    backend.read_s = 0.01
    fresh = Store.open(backend, cache_dir=tmp_path / "fresh")
    assert fresh.index.num_chunks() == store.index.num_chunks()
    assert backend.max_active > 1
    assert_items_equal(items, fresh.load("a"))
    one_at_a_time = Store.open(backend, cache_dir=tmp_path / "serial")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threads_mod, "REMOTE_TABLE_THREADS", 1)
        backend.max_active = 0
        one_at_a_time.index.num_chunks()
        assert backend.max_active == 1
    located = [fresh.index.lookup(cid) for cid in _ids(store)]
    assert located == [one_at_a_time.index.lookup(cid) for cid in _ids(store)]
    backend.max_active = 0
    assert plan_gc(fresh, grace_s=0).delete_packs == {}
    assert backend.max_active > 1


def _ids(store) -> list[bytes]:
    return sorted({ref.id for it in store.read_manifest("a").items for ref in it.chunks})


def test_ordered_map_keeps_the_order_bounds_what_waits_and_raises_in_place():
    from deltackpt.store.threads import ordered_map

    started = []

    def slow_square(x):
        started.append(x)
        time.sleep(0.002 * (x % 3))
        if x == 40:
            raise ValueError(x)
        return x * x

    got = []
    with pytest.raises(ValueError, match="40"):
        for i, y in enumerate(ordered_map(slow_square, range(100), 4)):
            assert len(started) <= i + 1 + 2 * 4  # never more than 2 x threads ahead of the consumer
            got.append(y)
    assert got == [x * x for x in range(40)]
    assert list(ordered_map(slow_square, range(5), 1)) == [0, 1, 4, 9, 16]


@pytest.mark.parametrize("shared", [True, False])
def test_a_store_on_a_shared_file_system_reads_its_pack_tables_several_at_once(tmp_path, rng, monkeypatch, shared):
    """A directory several hosts mount (NFS, Lustre, ...) waits on the network for each read, as object
    storage does; a local disk's does not, and reads them one at a time."""
    root = tmp_path / "store"
    store = Store.init(root, chunk_size_bytes=CHUNK, pack_target_bytes=4 * CHUNK)
    store.save("a", _items(rng, n_items=8))
    monkeypatch.setattr(cachedir_mod, "on_shared_filesystem", lambda path: shared)
    backend = SlowLocalTables(root, read_s=0.005)
    fresh = Store.open(backend, cache_dir=tmp_path / "fresh")
    assert fresh.index.num_chunks() == store.index.num_chunks()
    assert (backend.max_active > 1) == shared


@pytest.mark.parametrize("url", ["memory://bucket/run", "file:///tmp/deltackpt-listing-cache-test"])
def test_no_filesystem_answers_from_a_listing_cache(url):
    """Other hosts add and delete objects: a cached listing would let a save trust a pack a gc deleted, or
    `latest` miss a newer checkpoint. gcsfs and adlfs cache listings per instance, never expiring, unless told
    not to; the backend now tells every filesystem, not only s3fs."""
    from deltackpt.store.fsspec_backend import FsspecBackend

    backend = FsspecBackend(url)
    assert backend.fs.dircache.use_listings_cache is False
    kept = FsspecBackend(url, {"use_listings_cache": True})  # a caller's explicit choice stands
    assert kept.fs.dircache.use_listings_cache is True

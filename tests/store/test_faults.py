"""Failures during a save never publish a checkpoint and never damage earlier ones."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Mapping

import numpy as np
import pytest

from deltackpt.errors import MissingChunkError
from deltackpt.store import ChunkRef, Item, LocalBackend, MemoryBackend, Store

from store_helpers import SMALL, assert_items_equal, random_array


class FaultyMixin:
    """Raises OSError(ENOSPC) on the ``fail_on``-th pack put (1-based), and on every one after if sticky."""

    def setup_faults(self):
        self.fail_on = None
        self.sticky = False
        self.pack_puts = 0
        self.failures = 0
        self._count_lock = threading.Lock()

    def _maybe_fail(self, key):
        if key.startswith("packs/"):
            with self._count_lock:
                self.pack_puts += 1
                n = self.pack_puts
            if self.fail_on is not None and (n == self.fail_on or (self.sticky and n > self.fail_on)):
                self.failures += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), key)

    def put(self, key, data):
        self._maybe_fail(key)
        super().put(key, data)

    def put_spooled(self, key, f):  # packs streamed to a spool file (LocalBackend)
        try:
            self._maybe_fail(key)
        except OSError:
            f.close()
            raise
        super().put_spooled(key, f)


class FaultyMemory(FaultyMixin, MemoryBackend):
    def __init__(self):
        super().__init__()
        self.setup_faults()


class FaultyLocal(FaultyMixin, LocalBackend):
    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.setup_faults()


@pytest.fixture(params=["memory", "local"])
def faulty_store(request, tmp_path, make_store):
    if request.param == "memory":
        store = Store.init(FaultyMemory(), cache_dir=tmp_path / "fcache", **SMALL)
    else:
        store = Store.init(FaultyLocal(tmp_path / "fstore"), **SMALL)
    make_store.caches.append(store.cache_dir)
    return store


def _writer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("deltackpt-write")]


@pytest.mark.parametrize("fail_on,sticky", [(1, False), (3, False), (2, True)])
def test_enospc_on_pack_put(faulty_store, rng, fail_on, sticky):
    be = faulty_store.backend
    first = {"w": random_array(rng, "float32", (60_000,)), "b": rng.bytes(30_000)}
    faulty_store.save("first", first)
    listed = faulty_store.list_checkpoints()
    manifests = sorted(i.key for i in be.list("manifests/"))

    big = {"w": random_array(rng, "float32", (150_000,)), "b": rng.bytes(100_000)}  # ~10 packs
    be.pack_puts = 0
    be.fail_on, be.sticky = fail_on, sticky
    with pytest.raises(OSError) as ei:
        faulty_store.save("second", big)
    assert ei.value.errno == errno.ENOSPC
    assert be.failures >= 1
    assert not faulty_store.exists("second")
    assert sorted(i.key for i in be.list("manifests/")) == manifests
    assert faulty_store.list_checkpoints() == listed
    assert_items_equal(first, faulty_store.load("first"))
    assert_items_equal(first, faulty_store.load())
    assert not _writer_threads()

    # Once space is back, the same save succeeds and is complete (also through a fresh Store).
    be.fail_on = None
    faulty_store.save("second", big)
    assert_items_equal(big, faulty_store.load("second"))
    fresh = Store.open(be, cache_dir=faulty_store.cache_dir)
    assert_items_equal(big, fresh.load("second"))
    assert_items_equal(first, fresh.load("first"))


def test_enospc_on_manifest_put_commits_nothing(mem_store, rng, monkeypatch):
    mem_store.save("first", {"x": b"1" * 10_000})
    real_put, real_put_new = mem_store.backend.put, mem_store.backend.put_new

    def failing(real):
        def put(key, data):
            if key.startswith("manifests/"):
                raise OSError(errno.ENOSPC, "full")
            real(key, data)
        return put

    monkeypatch.setattr(mem_store.backend, "put", failing(real_put))
    monkeypatch.setattr(mem_store.backend, "put_new", failing(real_put_new))
    with pytest.raises(OSError):
        mem_store.save("second", {"x": random_array(rng, "float32", (20_000,))})
    monkeypatch.undo()
    assert [i.name for i in mem_store.list_checkpoints()] == ["first"]
    assert not mem_store.exists("second")


class ExplodingMapping(Mapping):
    """A dict whose iteration raises after yielding ``good`` items."""

    def __init__(self, items, good):
        self._items, self._good = items, good

    def __getitem__(self, k):
        return self._items[k]

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        for i, k in enumerate(self._items):
            if i == self._good:
                raise RuntimeError("boom while iterating items")
            yield k


def test_exception_during_item_iteration_commits_nothing(store, rng):
    store.save("keep", {"k": b"keep" * 100})
    items = {f"w{i}": random_array(rng, "float32", (30_000,)) for i in range(4)}
    with pytest.raises(RuntimeError, match="boom"):
        store.save("broken", ExplodingMapping(items, good=3))
    assert not store.exists("broken")
    assert [i.name for i in store.list_checkpoints()] == ["keep"]
    assert not _writer_threads()
    assert store.load("keep") == {"k": b"keep" * 100}
    # the store stays usable, and the same name can be saved afterwards
    store.save("broken", items)
    assert_items_equal(items, store.load("broken"))


@pytest.mark.parametrize("bad", [[1, 2, 3], 3.5, None, "a string", {"nested": b"x"}])
def test_bad_item_type_commits_nothing(store, rng, bad):
    items = {"good": random_array(rng, "float32", (20_000,)), "bad": bad, "after": b"x"}
    with pytest.raises(TypeError):
        store.save("typed", items)
    assert not store.exists("typed")
    assert store.list_checkpoints() == []
    assert not _writer_threads()


def test_commit_with_unwritten_chunk_is_missing_chunk(store, rng):
    x = random_array(rng, "float32", (10_000,))
    m = store.save("real", {"x": x})
    good = m.items[0]
    ghost_id = bytes(rng.bytes(16))
    ghost = Item(key="ghost", kind="bytes", nbytes=100, chunks=[ChunkRef(ghost_id, 100)])
    with pytest.raises(MissingChunkError) as ei:
        store.commit("ghosted", [good, ghost])
    assert ei.value.chunk_id == ghost_id.hex()
    assert ei.value.checkpoint == "ghosted" and ei.value.item == "ghost"
    assert isinstance(ei.value, KeyError)
    assert not store.exists("ghosted")
    assert [i.name for i in store.list_checkpoints()] == ["real"]
    # an item mixing real chunks with one unwritten chunk is refused the same way
    mixed = Item(key="mixed", kind="array", nbytes=good.nbytes + 4096, dtype="<f4", elem_size=4,
                 chunks=list(good.chunks) + [ChunkRef(ghost_id, 4096)])
    with pytest.raises(MissingChunkError):
        store.commit("mixed", [mixed])
    assert not store.exists("mixed")
    # while referencing only real chunks works
    store.commit("reuse", [good])
    np.testing.assert_array_equal(store.load("reuse")["x"], x)


def test_commit_accepts_entries_as_iterator(mem_store, rng):
    x = random_array(rng, "float32", (10_000,))
    w = mem_store.writer()
    w.add_array("x", x, dtype=x.dtype.str, elem_size=4, shape=x.shape)
    s = w.finish()
    m = mem_store.commit("gen", s.items, entries=iter(s.entries), packs=s.packs)
    assert m.stats.new_chunks == len(s.entries)
    np.testing.assert_array_equal(mem_store.load("gen")["x"], x)


def test_writer_misuse(mem_store):
    w = mem_store.writer()
    with pytest.raises(ValueError):
        w.add_array("x", np.zeros(4, np.float32), dtype="<f4", elem_size=3)
    with pytest.raises(ValueError):
        w.add_array("x", np.zeros(4, np.float32), dtype="<f4", elem_size=4, global_offset=6)
    with pytest.raises(ValueError):
        w.add_array("x", np.zeros((4, 4), np.float32)[:, ::2], dtype="<f4", elem_size=4)
    s = w.finish()
    assert s.items == [] and s.packs == {}
    with pytest.raises(RuntimeError):
        w.finish()
    with pytest.raises(RuntimeError):
        w.add_bytes("late", b"x")


class _HalfWriteFile:
    """A spool file whose first write of >= 64 KiB writes half its bytes, then fails with ENOSPC (what a
    buffered write does when the disk fills mid-write); later writes succeed (space came back)."""

    def __init__(self, f, armed):
        self._f, self._armed = f, armed

    def write(self, data):
        if self._armed[0] and len(data) >= 64 * 1024:
            self._armed[0] = False
            self._f.write(bytes(memoryview(data)[:len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.fixture
def half_write(monkeypatch):
    from deltackpt.store.pack import PackBuilder

    armed = [True]
    init = PackBuilder.__init__

    def flaky_init(self, spool=None):
        init(self, spool)
        if self._file is not None:
            self._file = _HalfWriteFile(self._file, armed)

    monkeypatch.setattr(PackBuilder, "__init__", flaky_init)
    return armed


def test_a_pack_whose_write_failed_part_way_is_never_published(tmp_path, half_write):
    """Part of a failed write was in the spool file, and the pack stayed open: another coding thread's add
    sealed and published it under a name that was not its hash, with its later chunks' offsets wrong; the
    failed save indexed it, and a retry deduplicated against it and committed a checkpoint that did not load."""
    import xxhash

    from deltackpt.errors import DiskFullError
    from deltackpt.store.packsink import PackSink

    store = Store.init(tmp_path / "s", chunk_size_bytes=256 * 1024, pack_target_bytes=512 * 1024)
    sink = PackSink(store)
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 255, 300 * 1024, dtype=np.uint8).tobytes() for _ in range(3))
    with pytest.raises(DiskFullError):
        sink.add(xxhash.xxh3_128_digest(a), 0, 1, len(a), a, None, 0)  # one coding thread: fails mid-write
    for data in (b, c):  # the others go on: they fail too, and nothing is published
        with pytest.raises(DiskFullError):
            sink.add(xxhash.xxh3_128_digest(data), 0, 1, len(data), data, None, 0)
    assert sink.packs == {}
    sink.abort()
    assert [i.key for i in store.backend.list("packs/")] == []


def test_a_save_retried_after_a_write_failed_part_way_loads(tmp_path, half_write):
    store = Store.init(tmp_path / "s", chunk_size_bytes=256 * 1024, pack_target_bytes=512 * 1024)
    rng = np.random.default_rng(1)
    items = {f"t{i}": rng.standard_normal(64 * 1024).astype(np.float32) for i in range(24)}
    with pytest.raises(OSError):
        store.save("step1", items, num_threads=4)
    store.save("step1", items, num_threads=4)
    assert_items_equal(Store.open(tmp_path / "s").load("step1"), items)

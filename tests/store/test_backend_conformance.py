"""One conformance suite for every Backend implementation."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from deltackpt.store import Backend, LocalBackend, MemoryBackend, ObjectInfo
from deltackpt.store.fsspec_backend import FsspecBackend

BACKENDS = ["memory", "local", "fsspec-memory", "s3"]
INVALID_KEYS = ["../x", "a//b", "", "/abs", "a/./b", "a/../b", "a/", "x.tmp-123", "a\\b", "a\0b"]


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path) -> Backend:
    if request.param == "memory":
        return MemoryBackend()
    if request.param == "fsspec-memory":
        return FsspecBackend(f"memory://conformance-{uuid.uuid4().hex}/root")
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        return FsspecBackend(request.getfixturevalue("s3_url"), server.storage_options)
    return LocalBackend(tmp_path / "root")


def keys_of(it) -> list[str]:
    return [i.key for i in it]


def test_put_get_roundtrip(backend):
    payloads = {"a": b"", "b/c": b"hello", "b/d/e": os.urandom(70_000)}
    for k, v in payloads.items():
        backend.put(k, v)
    for k, v in payloads.items():
        assert backend.get(k) == v
        assert isinstance(backend.get(k), bytes)
    # bytearray and memoryview inputs are stored by value
    buf = bytearray(b"xyz")
    backend.put("mv", memoryview(buf))
    backend.put("ba", buf)
    buf[0] = ord("Q")
    assert backend.get("mv") == b"xyz"
    assert backend.get("ba") == b"xyz"


def test_get_missing_raises_file_not_found(backend):
    with pytest.raises(FileNotFoundError):
        backend.get("nope")
    with pytest.raises(FileNotFoundError):
        backend.get_range("nope", 0, 1)
    with pytest.raises(FileNotFoundError):
        backend.size("dir/nope")


def test_get_range(backend):
    data = bytes(range(256)) * 4
    backend.put("k", data)
    assert backend.get_range("k", 0, 10) == data[:10]
    assert backend.get_range("k", 100, 200) == data[100:300]
    assert backend.get_range("k", 1000, 100) == data[1000:]  # past the end: fewer bytes
    assert len(backend.get_range("k", 1000, 100)) == 24
    assert backend.get_range("k", 5000, 10) == b""  # starts past the end
    assert backend.get_range("k", 10, 0) == b""  # zero length
    assert backend.get_range("k", len(data), 0) == b""
    with pytest.raises(ValueError):
        backend.get_range("k", -1, 5)
    with pytest.raises(ValueError):
        backend.get_range("k", 0, -5)


def test_get_ranges_into_reads_each_range_in_order(backend):
    data = bytes(range(256)) * 40
    backend.put("k", data)
    # More buffers than one preadv takes (1024), a gap between ranges, a range running past the end.
    many = [bytearray(3) for _ in range(1500)]
    head, tail = bytearray(10), bytearray(100)
    assert backend.get_ranges_into("k", [(0, many), (5000, [head]), (len(data) - 40, [tail])]) == [4500, 10, 40]
    assert b"".join(many) == data[:4500] and head == data[5000:5010] and tail[:40] == data[-40:]
    assert backend.get_ranges_into("k", []) == []
    with pytest.raises(FileNotFoundError):
        backend.get_ranges_into("nope", [(0, [bytearray(1)])])


def test_list_by_prefix(backend):
    keys = ["a/b/c", "a/b/d", "a/x", "ab", "b", "packs/00/p1", "packs/ff/p2"]
    for k in keys:
        backend.put(k, k.encode() * 3)
    assert set(keys_of(backend.list(""))) >= set(keys)
    assert set(keys_of(backend.list("a/"))) == {"a/b/c", "a/b/d", "a/x"}
    assert set(keys_of(backend.list("a/b/"))) == {"a/b/c", "a/b/d"}
    assert set(keys_of(backend.list("a"))) == {"a/b/c", "a/b/d", "a/x", "ab"}
    assert set(keys_of(backend.list("packs/"))) == {"packs/00/p1", "packs/ff/p2"}
    assert keys_of(backend.list("zzz/")) == []
    assert keys_of(backend.list("a/b/c")) == ["a/b/c"]
    for info in backend.list(""):
        assert isinstance(info, ObjectInfo)
        if info.key in keys:
            assert info.size_bytes == 3 * len(info.key)


def test_list_is_sorted_by_key(request, backend):
    keys = ["m/c", "m/b/x", "m/a", "m/b/y", "m/d/z"]
    for k in keys:
        backend.put(k, b"1")
    assert keys_of(backend.list("m/")) == sorted(keys)


def test_delete_and_exists(backend):
    backend.put("d/k", b"v")
    assert backend.exists("d/k")
    assert not backend.exists("d/other")
    assert not backend.exists("d")  # a "folder" is not an object
    backend.delete("d/k")
    assert not backend.exists("d/k")
    assert keys_of(backend.list("d/")) == []
    backend.delete("d/k")  # missing: no error
    backend.delete("never/was")
    with pytest.raises(FileNotFoundError):
        backend.get("d/k")


def test_size(backend):
    backend.put("s/one", b"x" * 1234)
    backend.put("s/empty", b"")
    assert backend.size("s/one") == 1234
    assert backend.size("s/empty") == 0
    with pytest.raises(FileNotFoundError):
        backend.size("s/missing")


@pytest.mark.parametrize("key", INVALID_KEYS)
def test_put_rejects_invalid_keys(backend, key):
    with pytest.raises(ValueError):
        backend.put(key, b"x")
    assert not any(".." in k or k.startswith("/") for k in keys_of(backend.list("")))


@pytest.mark.parametrize("key", ["../x", "a//b", ""])
def test_every_method_rejects_invalid_keys(request, backend, key):
    for call in (
        lambda: backend.get(key),
        lambda: backend.get_range(key, 0, 1),
        lambda: backend.exists(key),
        lambda: backend.size(key),
        lambda: backend.delete(key),
    ):
        with pytest.raises(ValueError):
            call()


def test_list_cannot_escape_root(request, backend, tmp_path):
    (tmp_path / "outside-secret").write_bytes(b"s")
    backend.put("inside", b"i")
    try:
        listed = keys_of(backend.list("../"))
    except ValueError:
        listed = []
    assert listed == []


def test_overwrite_replaces(backend):
    backend.put("o/k", b"first version, long")
    backend.put("o/k", b"second")
    assert backend.get("o/k") == b"second"
    assert backend.size("o/k") == 6
    assert keys_of(backend.list("o/")) == ["o/k"]


def test_a_rewrite_of_the_same_size_is_told_apart_by_the_listing(backend):
    # gc re-checks its plan by the manifests' listing: S3's LastModified has 1 s resolution, so a manifest
    # written again within the second with the same size is told apart by its version (ETag) only.
    stamps = []
    for data in (b"aaaa", b"bbbb"):
        backend.put("o/k", data)
        (info,) = backend.list("o/")
        stamps.append((info.size_bytes, info.mtime_s, info.version))
    assert stamps[0] != stamps[1]
    on_s3 = isinstance(backend, FsspecBackend) and "s3" in type(backend.fs).__name__.lower()
    if isinstance(backend, LocalBackend) or on_s3:
        assert stamps[0][2] != stamps[1][2]  # not by the mtime alone


def test_overwrite_is_atomic_for_concurrent_readers(backend):
    a, b = b"a" * 300_000, b"b" * 200_000
    backend.put("atom", a)
    stop = threading.Event()
    seen, bad = set(), []

    def reader():
        while not stop.is_set():
            got = backend.get("atom")
            if got not in (a, b):
                bad.append(len(got))
            seen.add(got[:1])

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(40):
            backend.put("atom", b if i % 2 == 0 else a)
    finally:
        stop.set()
        t.join(10)
    assert not bad, f"readers saw torn objects of sizes {bad[:5]}"
    assert seen <= {b"a", b"b"}


def test_put_new_stores_only_where_nothing_is(backend):
    backend.put_new("n/k", b"first")
    with pytest.raises(FileExistsError):
        backend.put_new("n/k", b"second")
    assert backend.get("n/k") == b"first"
    backend.put_new("n/other", b"second")
    assert keys_of(backend.list("n/")) == ["n/k", "n/other"]


# -- LocalBackend specifics --------------------------------------------------------------------------------


def test_local_put_leaves_no_temp_files(tmp_path):
    be = LocalBackend(tmp_path / "r")
    for i in range(5):
        be.put(f"packs/ab/k{i}", os.urandom(1000))
        be.put("manifests/m", os.urandom(100 + i))
    leftovers = [p for p in (tmp_path / "r").rglob("*") if ".tmp-" in p.name]
    assert leftovers == []
    assert be.list_temp() == []


def test_local_failed_put_keeps_old_object_and_no_temp(tmp_path, monkeypatch):
    be = LocalBackend(tmp_path / "r")
    be.put("k/v", b"old")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        be.put("k/v", b"new")
    monkeypatch.undo()
    assert be.get("k/v") == b"old"
    assert be.list_temp() == []
    assert [p.name for p in (tmp_path / "r" / "k").iterdir()] == ["v"]


def test_local_list_ignores_stray_temp_files(tmp_path):
    be = LocalBackend(tmp_path / "r")
    be.put("packs/ab/real", b"1")
    (tmp_path / "r" / "packs" / "ab" / "real.tmp-0123456789ab").write_bytes(b"partial")
    (tmp_path / "r" / "manifests").mkdir()
    (tmp_path / "r" / "manifests" / "step.tmp-deadbeef0000").write_bytes(b"partial")
    assert keys_of(be.list("")) == ["packs/ab/real"]
    assert keys_of(be.list("manifests/")) == []
    assert not be.exists("manifests/step") and be.exists("packs/ab/real")
    assert [p for p, _t in be.list_temp()] == sorted(["manifests/step.tmp-deadbeef0000", "packs/ab/real.tmp-0123456789ab"])


def test_local_key_cannot_escape_root(tmp_path):
    be = LocalBackend(tmp_path / "r")
    with pytest.raises(ValueError):
        be.put("../escaped", b"x")
    with pytest.raises(ValueError):
        be.get("../escaped")
    assert not (tmp_path / "escaped").exists()


def test_the_core_is_all_a_backend_must_implement():
    """Object storage and memory implement the core only; local-only speedups are a separate capability."""
    from deltackpt.store.backend import LocalFiles

    core = {"put", "put_new", "get", "get_range", "list", "delete", "exists"}
    assert Backend.__abstractmethods__ == frozenset(core)
    assert not isinstance(MemoryBackend(), LocalFiles)
    assert not issubclass(FsspecBackend, LocalFiles)
    assert issubclass(LocalBackend, LocalFiles)

"""Opening and creating stores: every wrong location gives a typed error."""

from __future__ import annotations

import json

import pytest

from deltackpt.errors import (
    DeltackptError,
    ManifestFormatError,
    StoreExistsError,
    StoreNotFoundError,
    UnsupportedFormatError,
)
from deltackpt.store import FORMAT_VERSION, LocalBackend, MemoryBackend, Store


def test_open_missing_path(tmp_path):
    with pytest.raises(StoreNotFoundError) as ei:
        Store.open(tmp_path / "does-not-exist")
    assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, DeltackptError)
    assert "not a deltackpt store" in str(ei.value)
    assert not (tmp_path / "does-not-exist").exists()  # opening never creates


def test_open_empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreNotFoundError):
        Store.open(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []


def test_open_dir_with_random_files(tmp_path, rng):
    d = tmp_path / "junk"
    (d / "sub").mkdir(parents=True)
    (d / "data.bin").write_bytes(rng.bytes(1000))
    (d / "sub" / "notes.txt").write_text("hello")
    (d / "manifests").mkdir()
    with pytest.raises(StoreNotFoundError):
        Store.open(d)


def test_open_a_file_path(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(StoreNotFoundError):
        Store.open(f)


def test_open_empty_memory_backend(tmp_path):
    with pytest.raises(StoreNotFoundError):
        Store.open(MemoryBackend(), cache_dir=tmp_path / "c")


def test_open_dir_with_config_subdirectory(tmp_path):
    d = tmp_path / "project"
    (d / "config").mkdir(parents=True)
    (d / "config" / "settings.yaml").write_text("a: 1")
    with pytest.raises(StoreNotFoundError):
        Store.open(d)


def _write_config(path, obj):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config").write_bytes(obj if isinstance(obj, bytes) else json.dumps(obj).encode())


def test_newer_format_version_is_unsupported(tmp_path):
    s = Store.init(tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config").read_bytes())
    cfg["format_version"] = 99
    cfg["some_future_field"] = {"x": 1}  # a newer format may add fields: still reported as a version issue
    (tmp_path / "s" / "config").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFormatError) as ei:
        Store.open(tmp_path / "s")
    assert "99" in str(ei.value)
    assert s.config.format_version == FORMAT_VERSION


@pytest.mark.parametrize("config", [
    b"",
    b"\x00\x01garbage\xff",
    b"[1, 2, 3]",
    b'"a string"',
    b"{}",
    b'{"format_version": "1"}',
    b'{"format_version": 1, "chunk_size_bytes": "big"}',
    b'{"format_version": 1, "chunk_size_bytes": 100}',
    b'{"format_version": 1, "unknown_field": 3}',
    b'{"format_version": 1, "cdc_avg_bytes": 1000}',
    b"\x80\x04\x95pickle",
])
def test_garbage_config_is_manifest_format_error(tmp_path, config):
    _write_config(tmp_path / "s", config)
    with pytest.raises(ManifestFormatError) as ei:
        Store.open(tmp_path / "s")
    assert isinstance(ei.value, ValueError)


def test_init_on_existing_store(tmp_path, make_store):
    Store.init(tmp_path / "s")
    cfg = (tmp_path / "s" / "config").read_bytes()
    with pytest.raises(StoreExistsError) as ei:
        Store.init(tmp_path / "s")
    assert isinstance(ei.value, FileExistsError)
    assert (tmp_path / "s" / "config").read_bytes() == cfg  # untouched
    again = Store.init(tmp_path / "s", exist_ok=True)
    assert again.config == Store.open(tmp_path / "s").config
    # same for a memory backend
    mem = make_store("memory")
    with pytest.raises(StoreExistsError):
        Store.init(mem.backend, cache_dir=tmp_path / "cc")


def test_init_on_non_empty_non_store_dir(tmp_path):
    """Other files may share the directory (DCP writes beside model.pt); the store leaves them alone."""
    d = tmp_path / "busy"
    d.mkdir()
    (d / "important.txt").write_text("keep me")
    store = Store.init(d)
    assert (d / "config").is_file() and (d / "important.txt").read_text() == "keep me"
    assert Store.open(d).config == store.config


def test_init_missing_or_empty_dir_works(tmp_path):
    s1 = Store.init(tmp_path / "new" / "nested")
    (tmp_path / "empty").mkdir()
    s2 = Store.init(tmp_path / "empty")
    assert Store.open(tmp_path / "new" / "nested").config.store_id == s1.config.store_id
    assert Store.open(tmp_path / "empty").config.store_id == s2.config.store_id
    assert s1.config.store_id != s2.config.store_id


@pytest.mark.parametrize("overrides", [
    dict(chunk_size_bytes=100),
    dict(chunk_size_bytes=4097),
    dict(cdc_min_bytes=10),
    dict(cdc_min_bytes=2048, cdc_avg_bytes=1024),
    dict(cdc_avg_bytes=3000, cdc_max_bytes=8192),
    dict(chunk_size_bytes=1 << 20, pack_target_bytes=1 << 16),
    dict(zstd_level=99),
    dict(min_gain=1.0),
    # Readers refuse chunks and refs above 1 GiB: a save in such a store committed what no load could read.
    dict(chunk_size_bytes=(1 << 30) + 8, pack_target_bytes=1 << 31),
    dict(cdc_max_bytes=1 << 31),
])
def test_invalid_config_overrides(tmp_path, overrides):
    with pytest.raises(ValueError):
        Store.init(tmp_path / "s", **overrides)
    assert not (tmp_path / "s" / "config").exists()
    with pytest.raises(ValueError):
        Store.init(MemoryBackend(), cache_dir=tmp_path / "c", **overrides)


def test_init_rejects_non_path_location(tmp_path):
    with pytest.raises(TypeError):
        Store.init(12345)


def test_config_roundtrip_and_open_or_init(tmp_path):
    s = Store.open_or_init(tmp_path / "s", chunk_size_bytes=8192)
    assert s.config.chunk_size_bytes == 8192
    t = Store.open_or_init(tmp_path / "s", chunk_size_bytes=16384)  # existing store: config unchanged
    assert t.config == s.config
    assert isinstance(t.backend, LocalBackend)

"""Store locations: a URL is never a local folder; unknown schemes and missing packages are one-line errors."""

from __future__ import annotations

import importlib.util

import pytest

from deltackpt.errors import BackendError, StoreNotFoundError
from deltackpt.store import LocalBackend, Store
from deltackpt.store.fsspec_backend import FsspecBackend
from deltackpt.store.location import open_backend, scheme_of


def test_urls_and_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert isinstance(open_backend("s3://bucket/run"), FsspecBackend)
    assert isinstance(open_backend(f"file://{tmp_path}/x"), LocalBackend)
    assert isinstance(open_backend("relative/dir"), LocalBackend)
    assert scheme_of("S3://b/x") == "s3" and scheme_of("s3:/b") is None and scheme_of(tmp_path) is None
    with pytest.raises(StoreNotFoundError):
        Store.open("memory://no-store-here/run")
    assert list(tmp_path.iterdir()) == [], "a URL never becomes a local folder (no 's3:' or 'memory:' dir)"


def test_unknown_scheme_is_one_line(tmp_path):
    with pytest.raises(BackendError, match="unknown storage scheme 'zz'") as e:
        Store.open("zz://bucket/run")
    assert "\n" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_scheme_whose_package_is_missing_names_it():
    with pytest.raises(BackendError, match="pip install gcsfs"):
        open_backend("gs://bucket/run")


def test_storage_options_need_a_url(tmp_path):
    with pytest.raises(ValueError, match="URL"):
        open_backend(str(tmp_path / "s"), {"key": "x"})

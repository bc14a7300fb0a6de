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


@pytest.mark.parametrize("url", ["s3://bucket//run", "s3://bucket/a//b", "memory://x//y/"])
def test_an_empty_path_segment_is_refused(url):
    """s3fs reads and writes "bucket//run/..." but lists nothing under it: saves that then seem gone."""
    with pytest.raises(BackendError, match="empty path segment"):
        open_backend(url)
    assert isinstance(open_backend("s3://bucket/run/"), FsspecBackend)  # a trailing slash is fine


def test_a_storage_option_the_client_refuses_is_a_backend_error(s3_server, s3_url):
    from deltackpt import cli

    with pytest.raises(BackendError, match="check the storage options.*region_nam"):
        Store.open(s3_url, storage_options={**s3_server.storage_options, "region_nam": "x"})
    args = ["ls", s3_url] + [f"--storage-option={k}={v}" for k, v in (
        ("endpoint_url", s3_server.storage_options["endpoint_url"]), ("profile_nme", "x"))]
    assert cli.main(args) == 3  # a one-line error, not a traceback


def test_missing_credentials_fail_at_once(s3_server, s3_url, monkeypatch, tmp_path):
    """Not retried six times with backoff: no attempt finds credentials that are not there."""
    for var in [v for v in __import__("os").environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata look-up off this machine
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws
    with pytest.raises(BackendError, match="credentials") as ei:
        Store.open(s3_url, storage_options={"endpoint_url": s3_server.endpoint})
    assert "attempts" not in str(ei.value)

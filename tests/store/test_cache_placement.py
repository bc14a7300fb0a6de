"""Where the index cache lives: inside a store on a local disk; node-local (the user's cache directory) for
object storage and for a store on a file system several hosts mount, where LMDB's locks do not hold."""

from __future__ import annotations

import numpy as np

from deltackpt.store import Store
from deltackpt.store import cachedir
from deltackpt.store.fsspec_backend import FsspecBackend


def test_local_store_keeps_its_cache_inside(tmp_path, monkeypatch):
    monkeypatch.delenv("DELTACKPT_CACHE_DIR", raising=False)
    s = Store.init(tmp_path / "s")
    assert s.cache_dir == tmp_path / "s" / "cache"
    assert cachedir.mount_type(tmp_path) is not None


def test_store_on_a_shared_filesystem_keeps_its_cache_on_the_node(tmp_path, monkeypatch):
    monkeypatch.delenv("DELTACKPT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cachedir, "mount_type", lambda path: "nfs4")
    s = Store.init(tmp_path / "s")
    assert s.cache_dir == tmp_path / "xdg" / "deltackpt" / s.config.store_id
    s.save("a", {"w": np.arange(1000.0)})
    assert not (tmp_path / "s" / "cache").exists()
    np.testing.assert_array_equal(Store.open(tmp_path / "s").load("a")["w"], np.arange(1000.0))


def test_object_store_cache_is_per_user_and_keyed_by_store_id(tmp_path, monkeypatch):
    monkeypatch.delenv("DELTACKPT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    s = Store.init(FsspecBackend(f"memory://cache-placement-{tmp_path.name}/run"))
    assert s.cache_dir == tmp_path / "xdg" / "deltackpt" / s.config.store_id
    monkeypatch.setenv("DELTACKPT_CACHE_DIR", str(tmp_path / "env"))
    assert Store.open(s.backend).cache_dir == tmp_path / "env" / s.config.store_id

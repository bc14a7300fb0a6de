"""The engine is torch-free and its Store objects travel between processes."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from deltackpt.store import LocalBackend

from store_helpers import REPO_ROOT, assert_items_equal, random_array, subprocess_env

NO_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys, tempfile

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch import attempted: " + name)
            return None

    sys.meta_path.insert(0, BlockTorch())
    import numpy as np
    import deltackpt.store
    from deltackpt.store import (backend, chunking, codec, config, index, manifest, pack, reader,
                                 repository, source, threads, writer)
    from deltackpt.store import Store, MemoryBackend
    s = Store.init(MemoryBackend(), cache_dir=tempfile.mkdtemp())
    x = np.arange(100_000, dtype=np.float32)
    s.save("a", {"x": x, "b": b"bytes" * 1000})
    assert (s.load("a")["x"] == x).all()
    bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print("TORCH_MODULES", bad)
    """
)


def test_store_package_never_imports_torch():
    r = subprocess.run([sys.executable, "-c", NO_TORCH], cwd=REPO_ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TORCH_MODULES []" in r.stdout


def test_pickled_state_excludes_lmdb(store, rng):
    store.save("a", {"x": b"1"})
    assert store._index is not None  # the index is open in this process
    state = store.__getstate__()
    assert state["_index"] is None and "_index_lock" not in state
    with pytest.raises(TypeError):
        pickle.dumps(store.index)  # the LMDB environment itself refuses to be pickled


READ_PICKLED = textwrap.dedent(
    """
    import pickle, sys, hashlib
    store = pickle.load(open(sys.argv[1], "rb"))
    x = store.load("a")["x"]
    print("SHA", hashlib.sha256(x.tobytes()).hexdigest())
    """
)


def test_store_pickle_roundtrip_can_read(store, rng, tmp_path):
    import hashlib

    x = random_array(rng, "float32", (50_000,))
    store.save("a", {"x": x, "b": b"payload"})
    data = pickle.dumps(store)
    copy = pickle.loads(data)
    assert copy is not store and copy.config == store.config
    assert_items_equal({"x": x, "b": b"payload"}, copy.load("a"))
    copy.save("b", {"x": x + 1})  # the copy can write too
    np.testing.assert_array_equal(copy.load("b")["x"], x + 1)
    if isinstance(store.backend, LocalBackend):  # same directory: the original sees the copy's commit
        np.testing.assert_array_equal(store.load("b")["x"], x + 1)
    # ... and another process can read through an unpickled copy
    (tmp_path / "store.pkl").write_bytes(pickle.dumps(store))
    r = subprocess.run([sys.executable, "-c", READ_PICKLED, str(tmp_path / "store.pkl")], cwd=REPO_ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"SHA {hashlib.sha256(x.tobytes()).hexdigest()}" in r.stdout

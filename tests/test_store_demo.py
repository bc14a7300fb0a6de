"""examples/store_demo.py never deletes a path it did not make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from deltackpt.store import Store

DEMO = Path(__file__).resolve().parents[1] / "examples" / "store_demo.py"


def _demo(store, tmp_path):
    return subprocess.run([sys.executable, str(DEMO), "--store", str(store), "--checkpoints", "2"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_demo_reruns_over_its_own_store_and_refuses_anything_else(tmp_path):
    own = tmp_path / "demo"
    assert _demo(own, tmp_path).returncode == 0
    assert _demo(own, tmp_path).returncode == 0, "its own store is replaced"
    assert len(Store.open(own).list_checkpoints()) == 2

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "model.pt").write_bytes(b"precious")
    r = _demo(foreign, tmp_path)
    assert r.returncode != 0 and "not a store made by this demo" in r.stderr
    assert (foreign / "model.pt").read_bytes() == b"precious"

    users = tmp_path / "user-store"  # a real store with the user's checkpoint
    Store.init(users).save("mine", {"w": np.arange(10.0)})
    r = _demo(users, tmp_path)
    assert r.returncode != 0
    assert [i.name for i in Store.open(users).list_checkpoints()] == ["mine"]

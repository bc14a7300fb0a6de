"""Fixtures shared by the CLI test modules: a small four-checkpoint store, LMDB environments closed after
each test, and a way to run the CLI in-process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deltackpt.cli import main
from deltackpt.store import Store
from deltackpt.store import index as index_mod
from deltackpt.testing import SMALL_CONFIG as SMALL

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _close_new_lmdb_envs():
    before = set(index_mod._envs)
    yield
    for key in set(index_mod._envs) - before:
        index_mod._close_env(Path(key))


@pytest.fixture
def store_path(tmp_path):
    """Four checkpoints s0..s3 (steps 0..30), one pack each."""
    root = tmp_path / "store"
    store = Store.init(root, **SMALL)
    for i in range(4):
        x = np.random.default_rng(i).standard_normal(3000).astype(np.float32)
        store.save(f"s{i}", {"x": x}, metadata={"step": 10 * i})
    index_mod._close_env(root / "cache" / "index.lmdb")
    return root


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err

"""Fixtures for the torch-free storage engine tests (deltackpt.store)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from deltackpt.store import LocalBackend, MemoryBackend, Store
from deltackpt.store import index as index_mod

from store_helpers import SMALL


class SeededRNG:
    """A numpy Generator whose seed shows in its repr (so a failure can be replayed with that seed)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gen = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self._gen, name)

    def __repr__(self) -> str:
        return f"SeededRNG(seed={self.seed})"


@pytest.fixture
def rng(request) -> SeededRNG:
    """Seed = $DELTACKPT_TEST_SEED if set, else a stable hash of the test id."""
    env = os.environ.get("DELTACKPT_TEST_SEED")
    seed = int(env) if env else int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:4], "little")
    r = SeededRNG(seed)
    request.node.user_properties.append(("rng", repr(r)))
    return r


@pytest.fixture
def make_store(tmp_path):
    """Factory: ``make_store(kind="memory"|"local", name="s", **config)`` -> a new Store (SMALL defaults).

    Every LMDB environment the test opened is closed at teardown.
    """
    caches: list[Path] = []
    counter = iter(range(1_000_000))

    def make(kind: str = "memory", name: str | None = None, **config) -> Store:
        name = name or f"s{next(counter)}"
        cfg = {**SMALL, **config}
        if kind == "memory":
            store = Store.init(MemoryBackend(), cache_dir=tmp_path / f"cache-{name}", **cfg)
        elif kind == "local":
            store = Store.init(LocalBackend(tmp_path / name, fsync=False), **cfg)
        else:
            raise ValueError(kind)
        caches.append(Path(store.cache_dir))
        return store

    make.caches = caches
    yield make
    for c in caches:
        index_mod._close_env(Path(c) / "index.lmdb")


@pytest.fixture(autouse=True)
def _close_new_lmdb_envs():
    """Close every LMDB environment a test opened (the engine keeps them in a process-wide registry)."""
    before = set(index_mod._envs)
    yield
    for key in set(index_mod._envs) - before:
        index_mod._close_env(Path(key))


@pytest.fixture
def mem_store(make_store) -> Store:
    """An in-memory store (MemoryBackend) with its index cache under tmp_path."""
    return make_store("memory", "mem")


@pytest.fixture
def local_store(make_store) -> Store:
    """A LocalBackend store in tmp_path/local (index cache in tmp_path/local/cache)."""
    return make_store("local", "local")


@pytest.fixture(params=["memory", "local"])
def store(request, make_store) -> Store:
    """Both kinds of store, for behaviour that must not depend on the backend."""
    return make_store(request.param, f"store-{request.param}")

"""Shared helpers for the storage-engine tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from deltackpt.store import LocalBackend, MemoryBackend, Store
from deltackpt.store import index as index_mod
from deltackpt.store.pack import pack_name_from_key
from deltackpt.testing import SMALL_CONFIG

SMALL = SMALL_CONFIG  # small sizes so that modest test data spans many chunks and many packs

DTYPES = ("float32", "float16", "int64", "uint8", "bool")
REPO_ROOT = Path(__file__).resolve().parents[2]


def random_array(rng, dtype: str, shape) -> np.ndarray:
    """Random contents for any of DTYPES (floats include exact bit patterns, not only nice values)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        return (rng.integers(0, 2, size=n, dtype=np.uint8).astype(bool)).reshape(shape)
    if dt.kind == "f":
        return rng.standard_normal(n).astype(dt).reshape(shape)
    return rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape)


def assert_items_equal(expected: dict, got: dict) -> None:
    """Bit-exact equality of a loaded checkpoint: same keys, same types, same dtype/shape/bytes."""
    assert set(got) == set(expected)
    for key, exp in expected.items():
        val = got[key]
        if isinstance(exp, np.ndarray):
            assert isinstance(val, np.ndarray), key
            assert val.dtype == exp.dtype, (key, val.dtype, exp.dtype)
            assert val.shape == exp.shape, (key, val.shape, exp.shape)
            assert val.tobytes() == np.ascontiguousarray(exp).tobytes(), key
        else:
            assert isinstance(val, bytes), key
            assert val == bytes(exp), key


def raw_bytes(value) -> bytes:
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).tobytes()
    return bytes(value)


def pack_keys(store: Store) -> list[str]:
    return [i.key for i in store.backend.list("packs/") if pack_name_from_key(i.key)]


def pack_names(store: Store) -> set[str]:
    return {pack_name_from_key(k) for k in pack_keys(store)}


def packs_of_checkpoint(store: Store, name: str) -> set[str]:
    m = store.read_manifest(name)
    ids = {ref.id for it in m.items for ref in it.chunks}
    return {e.pack for e in store.index.lookup_many(ids).values()}


def mutate_object(backend, key: str, fn) -> None:
    """Replace object ``key`` by ``fn(bytes)`` bypassing the engine's own writers."""
    if isinstance(backend, MemoryBackend):
        with backend._lock:
            backend._objects[key] = bytes(fn(backend._objects[key]))
    elif isinstance(backend, LocalBackend):
        path = backend.root / key
        path.write_bytes(bytes(fn(path.read_bytes())))
    else:  # pragma: no cover
        raise TypeError(type(backend))


def flip_bit(backend, key: str, byte_index: int, bit: int = 0) -> None:
    def fn(data):
        b = bytearray(data)
        b[byte_index] ^= 1 << bit
        return b

    mutate_object(backend, key, fn)


def close_index(store: Store) -> None:
    """Close this process's LMDB environment of ``store`` (as if the process had exited).

    LMDB allows one environment per path per process, so the engine keeps a process-wide registry; tests
    that delete or replace a cache directory must close it first to simulate a fresh process.
    """
    path = Path(store.cache_dir) / "index.lmdb"
    index_mod._close_env(path)
    store._index = None


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def count_index_writes(index, fn) -> int:
    """How many LMDB write transactions ``index`` begins while ``fn`` runs."""
    env, count = index.env, [0]

    class Counting:  # the environment, counting the write transactions begun
        def __getattr__(self, name):
            return getattr(env, name)

        def begin(self, *args, **kwargs):
            count[0] += bool(kwargs.get("write"))
            return env.begin(*args, **kwargs)

    index._env = Counting()
    try:
        fn()
    finally:
        index._env = env
    return count[0]

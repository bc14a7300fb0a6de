"""BaseCache: byte cap, least-recently-used eviction limited to older saves' entries, read-only copies."""

from __future__ import annotations

import numpy as np
import pytest

from deltackpt.store.basecache import BaseCache


def _b(n: int, fill: int) -> bytes:
    return bytes([fill]) * n


def test_copies_are_private_and_read_only():
    cache = BaseCache(100)
    cache.new_generation()
    src = bytearray(_b(10, 1))
    cache.put("s", b"a", memoryview(src))
    src[:] = _b(10, 9)  # the caller reuses its buffer
    got = cache.get("s", b"a")
    assert bytes(got) == _b(10, 1)
    with pytest.raises(ValueError):
        got[0] = 5


def test_evicts_least_recent_older_entries_and_never_this_saves():
    cache = BaseCache(30)
    cache.new_generation()
    for k in (b"a", b"b", b"c"):
        cache.put("s", k, _b(10, 1))
    assert cache.size_bytes == 30
    cache.put("s", b"d", _b(10, 2))  # full, and every entry belongs to this save: d is dropped
    assert cache.get("s", b"d") is None and cache.size_bytes == 30

    cache.new_generation()
    assert cache.get("s", b"a") is not None  # used by the new save: now the most recent
    cache.put("s", b"b", _b(10, 1))  # re-put: also counts as used by the new save
    cache.put("s", b"e", _b(10, 3))  # evicts c, the only entry no newer save has used
    assert cache.get("s", b"c") is None
    assert {k for k in (b"a", b"b", b"e") if cache.get("s", k) is not None} == {b"a", b"b", b"e"}
    cache.put("s", b"f", _b(10, 4))  # nothing older is left: dropped
    assert cache.get("s", b"f") is None and cache.size_bytes == 30


def test_eviction_frees_enough_for_a_large_entry_and_respects_the_cap():
    cache = BaseCache(40)
    cache.new_generation()
    for i in range(4):
        cache.put("s", bytes([i]), _b(10, i))
    cache.new_generation()
    cache.put("s", b"big", _b(25, 7))  # needs three of the four old entries evicted, oldest first
    assert cache.size_bytes <= 40
    assert cache.get("s", b"big") is not None
    assert [cache.get("s", bytes([i])) is not None for i in range(4)] == [False, False, False, True]
    cache.put("s", b"huge", _b(41, 1))  # larger than the cap: never cached
    assert cache.get("s", b"huge") is None
    assert np.frombuffer(cache.get("s", b"big"), dtype=np.uint8).tolist() == [7] * 25


def test_the_cap_bounds_each_store_so_stores_never_evict_each_other():
    cache = BaseCache(30)
    cache.new_generation()
    for k in (b"a", b"b", b"c"):
        cache.put("local", k, _b(10, 1))
    cache.new_generation()  # a save into another store of the same process
    for k in (b"a", b"b", b"c", b"d"):
        cache.put("remote", k, _b(10, 2))
    assert [bytes(cache.get("local", k))[:1] for k in (b"a", b"b", b"c")] == [b"\x01"] * 3
    assert cache.get("remote", b"d") is None  # the remote store's own share is full (this save's entries)
    assert cache.size_bytes == 60
    cache.new_generation()
    cache.put("remote", b"e", _b(10, 3))  # evicts only the remote store's oldest entry
    assert cache.get("remote", b"a") is None and cache.get("local", b"a") is not None
    assert cache.size_bytes == 60

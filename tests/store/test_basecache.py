"""BaseCache: byte cap, least-recently-used eviction limited to older saves' entries, read-only copies."""

from __future__ import annotations

import numpy as np
import pytest

from deltackpt.store.basecache import AUTO_CAP_BYTES, BaseCache


def _b(n: int, fill: int) -> bytes:
    return bytes([fill]) * n


def test_copies_are_private_and_read_only():
    cache = BaseCache(100)
    cache.new_generation()
    src = bytearray(_b(10, 1))
    cache.put(b"a", memoryview(src))
    src[:] = _b(10, 9)  # the caller reuses its buffer
    got = cache.get(b"a")
    assert bytes(got) == _b(10, 1)
    with pytest.raises(ValueError):
        got[0] = 5


def test_evicts_least_recent_older_entries_and_never_this_saves():
    cache = BaseCache(30)
    cache.new_generation()
    for k in (b"a", b"b", b"c"):
        cache.put(k, _b(10, 1))
    assert cache.size_bytes == 30
    cache.put(b"d", _b(10, 2))  # full, and every entry belongs to this save: d is dropped
    assert cache.get(b"d") is None and cache.size_bytes == 30

    cache.new_generation()
    assert cache.get(b"a") is not None  # used by the new save: now the most recent
    cache.put(b"b", _b(10, 1))  # re-put: also counts as used by the new save
    cache.put(b"e", _b(10, 3))  # evicts c, the only entry no newer save has used
    assert cache.get(b"c") is None
    assert {k for k in (b"a", b"b", b"e") if cache.get(k) is not None} == {b"a", b"b", b"e"}
    cache.put(b"f", _b(10, 4))  # nothing older is left: dropped
    assert cache.get(b"f") is None and cache.size_bytes == 30


def test_eviction_frees_enough_for_a_large_entry_and_respects_the_cap():
    cache = BaseCache(40)
    cache.new_generation()
    for i in range(4):
        cache.put(bytes([i]), _b(10, i))
    cache.new_generation()
    cache.put(b"big", _b(25, 7))  # needs three of the four old entries evicted, oldest first
    assert cache.size_bytes <= 40
    assert cache.get(b"big") is not None
    assert [cache.get(bytes([i])) is not None for i in range(4)] == [False, False, False, True]
    cache.put(b"huge", _b(41, 1))  # larger than the cap: never cached
    assert cache.get(b"huge") is None
    assert np.frombuffer(cache.get(b"big"), dtype=np.uint8).tolist() == [7] * 25


def test_the_environment_fixes_the_cap_and_limit_overrides_auto_growth(monkeypatch):
    monkeypatch.setenv("DELTACKPT_BASE_CACHE_BYTES", "1000")
    fixed = BaseCache.from_settings()
    fixed.reserve(1 << 30), fixed.limit(5), fixed.note_use(), fixed.note_use()
    assert fixed.cap_bytes == 1000
    monkeypatch.delenv("DELTACKPT_BASE_CACHE_BYTES")
    auto = BaseCache.from_settings()
    assert auto.cap_bytes == 0
    auto.note_use()
    assert auto.cap_bytes == 0
    auto.note_use()  # the second use: a training loop
    assert auto.cap_bytes == AUTO_CAP_BYTES
    off = BaseCache.from_settings()
    off.limit(0)
    off.note_use(), off.note_use(), off.reserve(1 << 20)
    assert off.cap_bytes == 0

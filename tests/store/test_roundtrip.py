"""Save -> load round trips, bit-exact, and random-range reads, across many chunks and packs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltackpt.store import Store

from store_helpers import DTYPES, assert_items_equal, pack_keys, random_array, raw_bytes

HYP = settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Element counts: 0, tiny, odd, and big enough to span several 4 KiB chunks and 64 KiB packs.
lengths = st.one_of(st.sampled_from([0, 1, 3, 4095, 4097]), st.integers(0, 40_000))
array_spec = st.tuples(st.just("array"), st.sampled_from(DTYPES), lengths, st.integers(0, 2**32 - 1))
bytes_spec = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=300)),
    st.tuples(st.just("bigbytes"), st.integers(0, 100_000), st.integers(0, 2**32 - 1)),
)
item_specs = st.dictionaries(
    st.text("abcdefghij/._-", min_size=1, max_size=12), st.one_of(array_spec, bytes_spec), min_size=1, max_size=6
)


def build(spec):
    kind = spec[0]
    if kind == "array":
        _, dtype, n, seed = spec
        r = np.random.default_rng(seed)
        shape = (n,) if n % 3 else ((3, n // 3) if n else (0, 5))
        return random_array(r, dtype, shape)
    if kind == "bytes":
        return spec[1]
    _, n, seed = spec
    return np.random.default_rng(seed).bytes(n)


_names = itertools.count()


@HYP
@given(specs=item_specs, data=st.data())
def test_save_load_bit_exact_and_ranges(store, specs, data):
    items = {k: build(v) for k, v in specs.items()}
    name = f"ckpt-{next(_names)}"
    m = store.save(name, items)
    assert m.stats.logical_bytes == sum(len(raw_bytes(v)) for v in items.values())
    assert_items_equal(items, store.load(name))

    with store.open_checkpoint(name) as r:
        assert set(r.items) == set(items)
        for key, value in items.items():
            raw = raw_bytes(value)
            assert r.item(key).nbytes == len(raw)
            off = data.draw(st.integers(0, len(raw)), label=f"{key} offset")
            length = data.draw(st.integers(0, len(raw) - off), label=f"{key} length")
            got = r.read(key, off, length)
            assert got.dtype == np.uint8 and got.tobytes() == raw[off : off + length]
            buf = bytearray(length)
            r.read_into(key, buf, off)
            assert bytes(buf) == raw[off : off + length]
            # past the end is an error, not a short read
            with pytest.raises(ValueError):
                r.read_into(key, bytearray(len(raw) - off + 1), off)


def test_large_items_span_many_chunks_and_packs(store, rng):
    items = {
        "w": random_array(rng, "float32", (513, 1001)),  # ~2 MiB, odd dims
        "h": random_array(rng, "float16", (77_777,)),
        "i": random_array(rng, "int64", (12_345,)),
        "m": random_array(rng, "bool", (50_001,)),
        "u": random_array(rng, "uint8", (99_999,)),
        "blob": rng.bytes(300_000),
        "empty": np.zeros((0, 7), np.float32),
        "nob": b"",
    }
    m = store.save("big", items)
    refs = {k: len(it.chunks) for k, it in ((it.key, it) for it in m.items)}
    assert refs["w"] == -(-513 * 1001 * 4 // 4096)  # fixed 4 KiB grid
    assert refs["empty"] == 0 and refs["nob"] == 0
    assert refs["blob"] > 300_000 // 4096  # CDC chunks are at most cdc_max_bytes
    assert len(pack_keys(store)) > 10  # 64 KiB packs
    assert_items_equal(items, store.load("big"))
    assert_items_equal(items, store.load())  # latest

    # Reads that cross chunk and pack boundaries, via a fresh Store object (no in-memory state).
    reopened = Store.open(store.backend, cache_dir=store.cache_dir)
    raw = items["w"].tobytes()
    with reopened.open_checkpoint("big") as r:
        for off, n in [(0, 1), (4095, 2), (4096 * 16 - 3, 4096 * 20 + 7), (len(raw) - 5, 5), (123, 0)]:
            assert r.read("w", off, n).tobytes() == raw[off : off + n]
        out = np.empty((100, 1001), np.float32)
        r.read_into("w", out, 4 * 1001 * 200)
        np.testing.assert_array_equal(out, items["w"][200:300])
        assert r.read("blob").tobytes() == items["blob"]
        with pytest.raises(KeyError):
            r.read("no-such-item")
        with pytest.raises(ValueError):
            r.read("w", -1, 4)


def test_non_contiguous_and_exotic_inputs(store, rng):
    base = random_array(rng, "float32", (64, 96))
    items = {
        "strided": base[::3, ::2],
        "fortran": np.asfortranarray(base),
        "bigendian": base.astype(">f4"),
        "f64": base.astype(np.float64),
        "i8": random_array(rng, "int64", (5, 0, 3)),
        "bytearray": bytearray(b"abc" * 1000),
        "memoryview": memoryview(rng.bytes(5000)),
    }
    store.save("exotic", items)
    got = store.load("exotic")
    for key in ("strided", "fortran", "bigendian", "f64", "i8"):
        assert got[key].dtype == items[key].dtype
        assert got[key].shape == items[key].shape
        np.testing.assert_array_equal(got[key], items[key])
    assert got["bytearray"] == bytes(items["bytearray"])
    assert got["memoryview"] == bytes(items["memoryview"])


def test_zero_dim_array_keeps_its_shape(mem_store):
    items = {"step": np.array(7, dtype=np.int64), "lr": np.float32(0.5), "flag": np.bool_(True)}
    mem_store.save("scalar", items)
    got = mem_store.load("scalar")
    for key, value in items.items():
        assert got[key].shape == (), key
        assert got[key].dtype == np.asarray(value).dtype, key
        assert got[key].item() == value.item(), key


def test_read_into_non_contiguous_out_fills_or_raises(mem_store):
    data = np.arange(1, 101, dtype=np.uint8)
    mem_store.save("nc", {"x": data})
    out = np.zeros((10, 20), np.uint8)[:, :10]
    with mem_store.open_checkpoint("nc") as r:
        try:
            r.read_into("x", out, 0)
        except ValueError:
            return  # refusing a non-contiguous destination is fine too
    np.testing.assert_array_equal(out.reshape(-1), data)


def test_readers_verify_and_return_copies(mem_store, rng):
    x = random_array(rng, "float32", (10_000,))
    mem_store.save("c", {"x": x})
    a = mem_store.load("c")["x"]
    a[:] = 0  # the loaded array is writable and owned by the caller
    np.testing.assert_array_equal(mem_store.load("c")["x"], x)

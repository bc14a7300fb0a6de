"""diff on two checkpoints with known edits reports exactly them, reads nothing for equal chunks, and the CLI
prints the top items or JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

import deltackpt
from deltackpt.store import Store
from deltackpt.testing import SMALL_CONFIG
from cli_fixtures import run

pytestmark = pytest.mark.timeout(120)


def _pair(tmp_path):
    rng = np.random.default_rng(5)
    a = {"big": rng.standard_normal(40_000).astype(np.float32),  # 160 KB: 40 chunks of 4 KiB
         "same": rng.standard_normal((30, 30)),
         "gone": np.arange(10, dtype=np.int32),
         "reshaped": np.zeros((4, 6), np.float32),
         "retyped": np.ones(8, np.float32),
         "blob": b"hello world" * 50}
    b = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.items() if k != "gone"}
    b["big"][[7, 8, 30_000]] += np.float32(0.25)  # 3 elements in 2 chunks (7 and 8 share chunk 0)
    b["big"][20_000] = -b["big"][20_000] - 1.0  # a 4th, in a third chunk
    b["new"] = np.ones(3, np.float64)
    b["reshaped"] = np.zeros((6, 4), np.float32)
    b["retyped"] = np.ones(8, np.float64)
    b["blob"] = b"hello WORLD" + b"hello world" * 49
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    store.save("a", a)
    store.save("b", b)
    return store, a, b


def test_diff_reports_exactly_the_known_edits(tmp_path):
    store, a, b = _pair(tmp_path)
    report = deltackpt.diff(store, "a", "b")
    by = {i.name: i for i in report.items}
    assert {n: i.status for n, i in by.items()} == {
        "big": "changed", "same": "unchanged", "gone": "removed", "reshaped": "shape", "retyped": "dtype",
        "blob": "changed", "new": "added"}
    big = by["big"]
    delta = b["big"].astype(np.float64) - a["big"].astype(np.float64)
    assert (big.changed_elements, big.changed_bytes, big.changed_chunks, big.num_chunks) == (4, 16, 3, 40)
    assert big.changed_fraction == 4 / 40_000
    assert big.max_abs_diff == pytest.approx(np.abs(delta).max())
    assert big.rel_l2 == pytest.approx(np.linalg.norm(delta) / np.linalg.norm(a["big"].astype(np.float64)))
    assert by["blob"].changed_bytes == 5
    assert (by["reshaped"].shape_a, by["reshaped"].shape_b) == ([4, 6], [6, 4])
    assert (by["retyped"].dtype_a, by["retyped"].dtype_b) == ("float32", "float64")
    assert by["same"].changed_chunks == 0 and by["same"].rel_l2 == 0.0
    gone, new = by["gone"], by["new"]  # a removed item counts A's chunks, an added one B's: all of them changed
    assert gone.num_chunks == gone.changed_chunks == len(store.read_manifest("a").item_map()["gone"].chunks) > 0
    assert new.num_chunks == new.changed_chunks == len(store.read_manifest("b").item_map()["new"].chunks) > 0
    t = report.totals()
    assert (t["changed"], t["shape_or_dtype"], t["added"], t["removed"], t["unchanged"]) == (2, 2, 1, 1, 1)
    # no relative change (shape, dtype, added, removed, bytes) sorts first, by changed bytes; then by rel_l2
    assert [i.name for i in report.top()] == ["reshaped", "retyped", "gone", "new", "blob", "big"]


def test_equal_chunks_are_never_decoded(tmp_path):
    store, a, _b = _pair(tmp_path)
    store.save("a-again", a)
    report = deltackpt.diff(store, "a", "a-again")
    assert report.identical and report.decoded_bytes == 0
    # a changed tensor: B's changed chunks and A's whole tensor (for its norm), nothing of the equal items
    report = deltackpt.diff(store, "a", "b")
    assert report.decoded_bytes == a["big"].nbytes + 3 * 4096 + 2 * len(a["blob"])


def test_cli_diff_top_and_json(tmp_path, capsys):
    store, _a, _b = _pair(tmp_path)
    code, out, _err = run(capsys, "diff", tmp_path / "store", "a", "b", "--top", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("a -> b: 7 items, 1 unchanged, 2 changed, 2 shape/dtype changed")
    assert len(lines) == 5 and "4 more changed item(s)" in lines[-1]
    code, out, _err = run(capsys, "diff", tmp_path / "store", "a", "b", "--json")
    data = json.loads(out)
    big = next(i for i in data["items"] if i["name"] == "big")
    assert code == 0 and not data["identical"] and big["changed_elements"] == 4 and big["changed_chunks"] == 3
    code, out, _err = run(capsys, "diff", tmp_path / "store", "a", "a")
    assert code == 0 and out.splitlines()[-1] == "identical"
    code, _out, err = run(capsys, "diff", tmp_path / "store", "a", "nope")
    assert code == 3 and len(err.strip().splitlines()) == 1


def test_diff_of_big_endian_arrays_compares_values_and_64_bit_integers_exactly(tmp_path):
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    x = np.arange(6, dtype=np.float32)
    seed = np.array([10**17, 2**63 - 1, 5], dtype=np.int64)
    u = np.array([2**64 - 1], dtype=np.uint64)
    store.save("a", {"x": x.astype(">f4"), "seed": seed, "u": u})
    changed_seed = seed + np.array([1, -100, 0], dtype=np.int64)
    store.save("b", {"x": x, "seed": changed_seed, "u": u - np.uint64(1)})  # x: the same values, native order
    by = {i.name: i for i in deltackpt.diff(store, "a", "b").items}
    assert by["x"].status == "unchanged" and by["x"].rel_l2 == 0.0
    assert (by["seed"].changed_elements, by["seed"].max_abs_diff) == (2, 100.0)  # float64 saw 0 and 0
    assert (by["u"].changed_elements, by["u"].max_abs_diff) == (1, 1.0)


def test_a_value_that_became_inf_or_nan_is_the_largest_change(tmp_path):
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    ones = np.ones(1000, np.float32)
    store.save("a", {"diverged": ones, "nan": ones, "nudged": ones})
    diverged, nan, nudged = np.full(1000, np.inf, np.float32), ones.copy(), ones.copy()
    nan[3] = np.nan
    nudged[0] += np.float32(1e-6)
    store.save("b", {"diverged": diverged, "nan": nan, "nudged": nudged})
    report = deltackpt.diff(store, "a", "b")
    by = {i.name: i for i in report.items}
    for name in ("diverged", "nan"):
        assert by[name].rel_l2 == by[name].max_abs_diff == float("inf"), name  # was 0.0: ranked last
    assert 0 < by["nudged"].rel_l2 < 1e-6
    assert [i.name for i in report.top(2)] == ["diverged", "nan"]

"""Smoke test of ``benchmarks/delta_bounds.py``: the tiny sparse workload in-process, sane invariants."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "delta_bounds.py"
_spec = importlib.util.spec_from_file_location("delta_bounds", _PATH)
db = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(db)


def test_measure_chunk_pairs():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(4096).astype(np.float32)
    b = a.copy()
    b[:41] += 1.0  # 1 % of the elements change
    views = [a.view(np.uint8), a.view(np.uint8).copy(), b.view(np.uint8)]
    import zstandard

    m = db.measure_chunk(views, 4, True, zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=19))
    assert m["h0"][1, 0] == 0 and m["changed"][1, 0] == 0  # an unchanged version: nothing to code
    assert m["changed"][2, 0] == 41 and m["changed"][2, 1] == 41
    assert 0 < m["h0"][2, 0] < 0.2 * a.nbytes < m["h0"][0, 0] <= a.nbytes
    assert np.all(m["bits"] >= 0) and np.all(m["bits"] <= 8)
    assert not np.isnan(m["z19"][2, 1]) and m["z19"][2, 0] < m["z1"][0, 0]
    # Version 1 repeats version 0 (deduplicated); version 2 is a small delta from either.
    best = np.minimum(m["h0"], m["z1"])
    b = db.chunk_bounds(best, m["changed"] == 0)
    assert b["iii"] <= b["ii"] and b["iii"] <= b["i*"] <= b["i"]
    assert b["i"] == pytest.approx(best[0, 0] + min(best[2, 2], best[2, 0]))


@pytest.mark.timeout(120)
def test_tiny_sparse():
    r = db.analyze("sparse", "tiny", l19_every=1, store=True)
    n = r["num_checkpoints"]
    assert n == 4 and r["dcp_measured"] and r["measured_ratio"] > 1
    assert {"weights:emb", "weights:mlp", "exp_avg:emb", "exp_avg_sq:emb"} <= set(r["groups"])
    assert sum(g["raw_bytes"] for g in r["groups"].values()) == r["raw_state_bytes"]
    for name, g in r["groups"].items():
        raw = g["raw_bytes"]
        assert all(v <= raw + 1 for v in g["key_h0"]), name  # an entropy bound never exceeds raw
        assert all(v <= raw * 1.01 + 64 * g["num_chunks"] for v in g["key_z1"]), name  # frame overheads
        for field in ("changed_vs_prev", "changed_vs_first"):
            assert all(0 <= v <= 1 for v in g[field]), (name, field)
        b = g["bounds_bytes"]
        assert b["iii"] <= b["ii"] + 1e-6 and b["iii"] <= b["i*"] + 1e-6 and b["i*"] <= b["i"] + 1e-6, name
        assert b["i"] <= n * raw + 1e-6, name
    emb = r["groups"]["weights:emb"]
    # Each checkpoint touches a few embedding rows only: the row deltas are small, the table is not.
    assert max(emb["changed_vs_prev"]) < 0.05
    assert np.mean(emb["prev_h0"]) < 0.1 * np.mean(emb["key_h0"])
    assert r["groups"]["weights:mlp"]["changed_vs_prev"][0] > 0.5  # dense MLP weights all move
    ratios = r["bound_ratios"]
    assert ratios["iii"] >= ratios["i*"] >= ratios["i"] > 1
    text = db.report(r)
    assert "| weights:emb |" in text and "deltackpt measured" in text

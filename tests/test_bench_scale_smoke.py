"""Smoke test of the scale benchmark (``benchmarks/bench_scale.py``): every sweep at tiny sizes.

The real runs are ``--quick`` (under a minute) and ``--size full``; this only checks that each operation is
measured and fitted, and that the tables land in a markdown file between their markers.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPS = {
    "chunks": ["save", "save 1%", "load", "load 4 MiB chunks", "verify 0", "verify 1", "cli verify 0",
               "cli forget --keep-last 1", "cli gc"],
    "million": ["save", "save 1%", "verify 0", "verify 1", "forget --keep-last 1", "gc"],
    "history": ["save 1%", "ls", "verify 0", "verify 1", "forget --keep-last 1", "gc"],
    "ranks": [f"dcp save{s} {p}" for s in ("", " 1%") for p in ("ranks", "plan", "write", "global plan",
                                                                "commit", "total")],
    "items": ["save", "save 1%", "load", "verify 0"],
}

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "benchmarks" / "bench_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(300)
def test_quick_run_measures_and_fits_every_operation(tmp_path, capsys):
    docs = tmp_path / "performance.md"
    docs.write_text("# Performance\n\nkept text\n")
    argv = ["--quick", "--chunks", "100,200", "--million", "128,256", "--history", "2,4", "--refs", "16",
            "--ranks", "2,4",
            "--state-mib", "1", "--items", "10,20", "--tmp", str(tmp_path), "--json", str(tmp_path / "out.json"),
            "--write-docs", str(docs)]
    bench = _bench()
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads((tmp_path / "out.json").read_text())
    for sweep, ops in OPS.items():
        s = data["summary"][sweep]
        assert s["sizes"] == [int(v) for v in argv[argv.index(f"--{sweep}") + 1].split(",")], sweep
        assert sorted(s["ops"]) == sorted(ops), sweep
        for op in ops:
            o = s["ops"][op]
            assert len(o["time_s"]) == 2 and all(t > 0 for t in o["time_s"]), (sweep, op)
            assert math.isfinite(o["exponent"]) and math.isfinite(o["last_doubling"]), (sweep, op)
            assert f"{op} " in text, (sweep, op)
        if "verify 0" in ops:  # what verify allocates, measured apart from RSS
            assert all(b > 0 for b in s["ops"]["verify 0"]["heap_bytes"]), sweep
    targets = [t for t, _ok, _detail in data["targets"]]
    for name in ("save 1% <=", "load of 200 8 KiB chunks", "gc <= verify --level 0", "verify --level 0 <= 40 B",
                 "per-rank save cost at 4 ranks"):
        assert any(t.startswith(name) or name in t for t in targets), name
    assert all(line.split()[0] in ("PASS", "FAIL", "n/a") for line in text.split("== targets\n")[1].splitlines()
               if line.startswith("  "))
    md = docs.read_text()
    assert md.startswith("# Performance\n\nkept text\n") and md.count("<!-- bench_scale:begin -->") == 1
    for sweep in OPS:
        assert f"### {sweep}:" in md
    # a second run replaces the section instead of adding one
    bench.write_docs(docs, "new tables")
    assert docs.read_text().count("<!-- bench_scale:begin -->") == 1 and "new tables" in docs.read_text()
    assert "kept text" in docs.read_text() and "### chunks:" not in docs.read_text()


@pytest.mark.timeout(120)
def test_successive_saves_change_another_percent_each(tmp_path):
    bench = _bench()
    per = bench.MIN_CHUNK // 4
    state = bench.float_state(200 * bench.MIN_CHUNK, 2, chunk=bench.MIN_CHUNK)
    flat = bench.np.concatenate(list(state.values())).reshape(200, per)
    changed = [bench.change_chunks(state, 0.01, bench.MIN_CHUNK, first=k) for k in (0, 1, 2)]
    for k, c in enumerate(changed):  # chunks k and k + 100 of the 200, counted across items
        diff = bench.np.concatenate(list(c.values())).reshape(200, per) != flat
        assert list(bench.np.flatnonzero(diff.any(axis=1))) == [k, k + 100]
    store, path = bench.new_store(tmp_path, "s", chunk_size_bytes=bench.MIN_CHUNK)
    store.save("c0", state)
    row = bench.measure_successive_saves(store, changed[0], 3)
    assert row["time_s"] > 0
    names = [i.name for i in bench.Store.open(path).list_checkpoints()]
    assert names == ["c0", "c1", "c2", "c3"]
    # each save stored the two chunks it changed, not the state again
    new = [i.stored_bytes for i in bench.Store.open(path).list_checkpoints()[1:]]
    assert all(0 < b < 4 * bench.MIN_CHUNK for b in new), new

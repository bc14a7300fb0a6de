"""Smoke test of the workload benchmark (``deltackpt bench``): tiny sizes, systems in-process, a few seconds.

CI runs only this; the real benchmark is ``deltackpt bench --quick`` / ``make bench``.
"""

from __future__ import annotations

import json

import pytest

from deltackpt.bench import run_bench
from deltackpt.bench.systems import ResticSystem
from deltackpt.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SYSTEM_FIELDS = {"stored_bytes": int, "save_s": float, "load_s": float, "peak_rss_bytes": int,
                 "cumulative_bytes": list, "load_first_s": float, "load_bit_exact": bool}


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    # A system that is "not installed" must be skipped with a note, not fail the run.
    mp.setattr(ResticSystem, "unavailable", classmethod(lambda cls: "restic not installed (test)"))
    request.addfinalizer(mp.undo)
    results = run_bench(out, ["frozen", "sparse"], size="tiny", systems=["dcp", "deltackpt", "restic"],
                        isolate=False, log=lambda msg: None)
    return out, results


def test_json_schema(bench_out):
    out, results = bench_out
    data = json.loads((out / "results.json").read_text())
    assert set(data["workloads"]) == {"frozen", "sparse"}
    assert isinstance(data["machine"], dict) and data["machine"]["cpu_count"] >= 1
    for name, w in data["workloads"].items():
        assert set(w["systems"]) == {"dcp", "deltackpt"}, name
        for sname, r in w["systems"].items():
            for field, typ in SYSTEM_FIELDS.items():
                assert isinstance(r[field], typ), (name, sname, field, r[field])
            assert r["stored_bytes"] > 0 and r["peak_rss_bytes"] > 0 and r["save_s"] > 0 and r["load_s"] > 0
            assert r["cumulative_bytes"] == sorted(r["cumulative_bytes"]) and r["cumulative_bytes"][-1] == r["stored_bytes"]
            assert len(r["cumulative_bytes"]) == 4
            assert r["load_bit_exact"], (name, sname)
        ratios = w["ratio_vs_dcp"]
        assert set(ratios) == {"dcp", "deltackpt"} and all(isinstance(v, float) for v in ratios.values())
        assert ratios["dcp"] == 1.0
        assert ratios["deltackpt"] == pytest.approx(w["systems"]["dcp"]["stored_bytes"]
                                                    / w["systems"]["deltackpt"]["stored_bytes"])
    assert data["skipped_systems"] == {"restic": "restic not installed (test)"}
    assert data == json.loads(json.dumps(results, sort_keys=True))


def test_frozen_is_deduplicated(bench_out):
    _, results = bench_out
    w = results["workloads"]["frozen"]
    dcp, dk = w["systems"]["dcp"]["stored_bytes"], w["systems"]["deltackpt"]["stored_bytes"]
    assert dk < 0.5 * dcp, (dk, dcp)
    assert w["info"]["frozen_fraction"] >= 0.9
    assert 0 < w["info"]["adapter_only_total_bytes"] < dcp


def test_sparse_touches_few_rows(bench_out):
    _, results = bench_out
    info = results["workloads"]["sparse"]["info"]
    assert info["touched_fraction_ok"] and 0 < info["max_touched_fraction"] <= 0.03


def test_markdown_and_png(bench_out):
    out, _ = bench_out
    md = (out / "results.md").read_text()
    assert "| frozen | deltackpt |" in md and "| sparse | DCP FileSystemWriter |" in md
    assert "restic skipped: restic not installed (test)" in md
    png = (out / "cumulative_bytes.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert not any(p.name.startswith("work-") for p in out.iterdir()), "work directory left behind"


def test_cli_rejects_unknown_workload(tmp_path, capsys):
    assert main(["bench", "--workloads", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_load_is_repeated_and_reported_as_the_median():
    import torch

    from deltackpt.bench.systemrun import SystemRun

    class Fake:
        child_peak_bytes = 0

        def __init__(self):
            self.seen = []

        def data_paths(self, name):
            return []

        def load(self, state, name):
            self.seen.append(float(state["t"].abs().sum()))  # zero before every load but the first
            state["t"].fill_(3.0)

        def after_load(self, name):
            pass

    fake = Fake()
    state = {"t": torch.ones(4)}
    rec = SystemRun(fake, load_repeats=3).load(state, "c", "last")
    assert fake.seen == [4.0, 0.0, 0.0]
    assert len(rec["load_s_all"]) == 3 and rec["load_s"] == pytest.approx(sorted(rec["load_s_all"])[1], abs=1e-4)
    assert torch.equal(state["t"], torch.full((4,), 3.0))


def test_frozen_with_its_base_saved_first_adds_about_the_adapters(tmp_path):
    results = run_bench(tmp_path, ["frozen-base"], size="tiny", systems=["dcp", "deltackpt"], isolate=False,
                        log=lambda msg: None)
    w = results["workloads"]["frozen-base"]
    dcp, dk = w["systems"]["dcp"], w["systems"]["deltackpt"]
    ideal = w["info"]["adapter_only_total_bytes"]
    # The base (counted apart) is most of one checkpoint; every checkpoint after it adds about its adapters.
    assert dk["base_stored_bytes"] > 0.5 * w["info"]["state_bytes"] and dcp["base_stored_bytes"] > 0
    assert dk["cumulative_bytes"][-1] == dk["stored_bytes"] and len(dk["cumulative_bytes"]) == 4
    assert dk["cumulative_bytes"][0] < 2 * ideal / 4, (dk["cumulative_bytes"], ideal)
    assert w["info"]["stored_vs_adapter_only"]["deltackpt"] == pytest.approx(dk["stored_bytes"] / ideal)
    assert dk["load_bit_exact"] and dcp["load_bit_exact"]
    assert "the base model was saved first as checkpoint `base`" in (tmp_path / "results.md").read_text()


def test_checkpoint_count_override(tmp_path):
    from deltackpt.bench.workloads import workload_config

    assert workload_config("sparse", "quick", 50)["num_checkpoints"] == 50
    assert workload_config("sparse", "quick")["num_checkpoints"] == 10
    with pytest.raises(ValueError, match="num_checkpoints"):
        run_bench(tmp_path, ["sparse"], size="tiny", systems=["dcp"], num_checkpoints=0)

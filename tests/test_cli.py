"""The CLI basics: init, ls, show, du, index rebuild, --version; --json output; exit codes; one-line errors."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import deltackpt
from deltackpt import kernels
from deltackpt.cli import main
from deltackpt.store import Store


@pytest.fixture
def store_dir(tmp_path):
    path = tmp_path / "s"
    store = Store.init(path, chunk_size_bytes=16384)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    store.save("step-10", {"w": w, "b": b"blob" * 100}, metadata={"step": 10})
    store.save("step-20", {"w": w, "b": b"blob" * 101}, metadata={"step": 20})
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version_shows_kernel_backend(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("deltackpt ") and f"kernels: {kernels.BACKEND}" in out
    code, out, _ = run(capsys, "--json", "--version")  # JSON as every --json output is
    assert code == 0 and json.loads(out) == {"version": deltackpt.__version__, "kernels": kernels.BACKEND}


def test_init_creates_store_and_refuses_twice(tmp_path, capsys):
    code, out, _ = run(capsys, "init", str(tmp_path / "new"), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["format_version"] == 2 and len(data["store_id"]) == 32
    assert data["features"] == ["delta-chains", "plane-container", "zero-sparse-planes", "zigzag-delta"]
    assert Store.open(tmp_path / "new").config.store_id == data["store_id"]
    code, _, err = run(capsys, "init", str(tmp_path / "new"))
    assert code == 3 and err.count("\n") == 1 and "already holds" in err


def test_init_sets_the_chain_settings_and_refuses_a_bad_pair(tmp_path, capsys):
    code, out, _ = run(capsys, "init", str(tmp_path / "all"), "--chain-links", "all", "--max-chain", "4", "--json")
    data = json.loads(out)
    assert code == 0 and data["chain_links"] == "all" and data["max_chain"] == 4
    assert "chain-all-deltas" in data["features"]
    cfg = Store.open(tmp_path / "all").config
    assert (cfg.chain_links, cfg.max_chain) == ("all", 4)
    code, _, err = run(capsys, "init", str(tmp_path / "bad"), "--chain-links", "all", "--max-chain", "1")
    assert code == 2 and "needs max_chain > 1" in err and not (tmp_path / "bad").exists()


def test_ls_lists_names_sizes_and_dedup(store_dir, capsys):
    code, out, _ = run(capsys, "ls", str(store_dir), "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["step-10", "step-20"]
    assert rows[0]["logical_bytes"] == 64 * 128 * 4 + 400
    assert rows[1]["stored_bytes"] < rows[0]["stored_bytes"] / 5  # w was deduplicated
    assert rows[1]["parent"] == "step-10" and rows[1]["metadata"] == {"step": 20}
    code, text, _ = run(capsys, "ls", str(store_dir))
    assert code == 0 and "step-20" in text and "DEDUP" in text


def test_show_items_and_latest(store_dir, capsys):
    code, out, _ = run(capsys, "--json", "show", str(store_dir), "latest")
    assert code == 0
    data = json.loads(out)
    assert data["name"] == "step-20"
    items = {i["key"]: i for i in data["items"]}
    assert items["w"]["shape"] == [64, 128] and items["w"]["kind"] == "array"
    assert items["w"]["num_chunks"] == 2  # 32 KiB in 16 KiB chunks
    assert items["b"]["kind"] == "bytes" and items["b"]["nbytes"] == 404


def test_du_reports_logical_vs_physical(store_dir, capsys):
    code, out, _ = run(capsys, "du", str(store_dir), "--json")
    data = json.loads(out)
    assert code == 0 and data["num_checkpoints"] == 2
    assert data["logical_bytes"] == 2 * 64 * 128 * 4 + 400 + 404
    assert data["physical_bytes"] < data["logical_bytes"] and data["ratio"] > 1.5
    cfg = Store.open(store_dir).config
    assert data["settings"] == {"format_version": 2, "features": list(cfg.features),
                                "chunk_size_bytes": cfg.chunk_size_bytes, "pack_target_bytes": cfg.pack_target_bytes,
                                "max_chain": cfg.max_chain, "chain_links": "sparse"}
    code, text, _ = run(capsys, "du", str(store_dir))
    assert code == 0 and f"max_chain {cfg.max_chain}, chain_links sparse" in text


def test_index_rebuild_after_cache_loss(store_dir, capsys):
    shutil.rmtree(store_dir / "cache")
    code, out, _ = run(capsys, "index", "rebuild", str(store_dir), "--json")
    data = json.loads(out)
    assert code == 0 and data["num_chunks"] > 0 and data["packs_indexed"] >= 1
    assert np.array_equal(Store.open(store_dir).load("step-10")["w"], Store.open(store_dir).load("step-20")["w"])


@pytest.mark.parametrize("argv, code, needle", [
    (["ls", "{tmp}/nope"], 3, "not a deltackpt store"),
    (["show", "{store}", "step-99"], 3, "nearby names"),
    (["show", "{store}", "../etc"], 2, "invalid checkpoint name"),
    (["frobnicate"], 2, "invalid choice"),
    ([], 2, "usage"),
])
def test_errors_are_one_line_with_documented_codes(store_dir, tmp_path, capsys, argv, code, needle):
    argv = [a.format(tmp=tmp_path, store=store_dir) for a in argv]
    got, out, err = run(capsys, *argv)
    assert got == code
    assert needle in err
    assert "Traceback" not in err


def test_debug_shows_traceback(tmp_path, capsys):
    code, _, err = run(capsys, "--debug", "ls", str(tmp_path / "nope"))
    assert code == 3 and "Traceback" in err


def test_help_documents_exit_codes(capsys):
    assert main(["ls", "--help"]) == 0
    out, _ = capsys.readouterr()
    assert "exit status" in out and "130" in out


def test_console_script_and_module_entry_point(store_dir):
    proc = subprocess.run([sys.executable, "-m", "deltackpt", "ls", str(store_dir), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout)[0]["name"] == "step-10"


def test_store_and_cli_do_not_import_torch():
    code = ("import sys, deltackpt.store, deltackpt.cli; import deltackpt; deltackpt.Store; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_copy_all_exits_1_naming_a_checkpoint_it_could_not_read(store_dir, tmp_path, capsys):
    names = [i.name for i in Store.open(store_dir).list_checkpoints()]
    (store_dir / "manifests" / names[0]).write_bytes(b"damaged")
    code, out, _ = run(capsys, "copy", str(store_dir), str(tmp_path / "dst"), "--all")
    assert code == 1
    assert f"not copied, manifest damaged in the source: {names[0]}" in out
    assert [i.name for i in Store.open(tmp_path / "dst").list_checkpoints()] == names[1:]
    code, out, _ = run(capsys, "copy", str(store_dir), str(tmp_path / "dst"), *names[1:])
    assert code == 0 and f"copied 0 checkpoint(s), {len(names) - 1} already there; sent 0 B" in out
    code, _, err = run(capsys, "copy", str(store_dir), str(tmp_path / "dst3"), names[0])
    assert code == 3 and f"manifest {names[0]!r}" in err


def test_json_output_is_strict_when_metadata_holds_nan_or_inf(tmp_path, capsys):
    store = Store.init(tmp_path / "s")
    store.save("c", {"w": np.ones(3, np.float32)}, metadata={"loss": float("nan"), "grad": [float("-inf"), 1.0]})
    for argv in (["ls", str(tmp_path / "s")], ["show", str(tmp_path / "s"), "c"]):
        code, out, _ = run(capsys, "--json", *argv)
        assert code == 0 and "NaN" not in out and "Infinity" not in out
        data = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
        meta = (data[0] if isinstance(data, list) else data)["metadata"]
        assert meta == {"loss": None, "grad": ["-inf", 1.0]}


_WHEN = datetime.datetime(2026, 12, 3, 14, 0, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize("meta, shown", [({"a": b"\x00\x01"}, "0001"), ({"a": {1: 2, "b": 3}}, '"1": 2'),
                                         ({"saved_at": _WHEN}, "2026-12-03T14:00:00+00:00")],
                         ids=["bytes", "int-keys", "datetime"])
@pytest.mark.parametrize("argv", [["show", "{s}", "c"], ["show", "--json", "{s}", "c"], ["ls", "--json", "{s}"]])
def test_show_and_ls_print_metadata_json_has_no_words_for(tmp_path, capsys, meta, shown, argv):
    """Metadata the writer accepts (bytes, int keys, a timezone-aware datetime: msgpack holds them all) made
    show and ls --json fail with a TypeError."""
    store = Store.init(tmp_path / "s")
    store.save("c", {"x": np.arange(10)}, metadata=meta)
    assert main([a.format(s=tmp_path / "s") for a in argv]) == 0
    assert shown in capsys.readouterr().out

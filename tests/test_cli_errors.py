"""CLI errors a user can catch and read: JSON errors with --json, a closed pipe, refused options, forget by
name, ls/show agreeing on stored bytes, and a partial verify that says what it did not check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deltackpt.cli import main
from deltackpt.store import Store
from deltackpt.store.pack import pack_key

from cli_fixtures import REPO_ROOT, SMALL, _close_new_lmdb_envs, run, store_path  # noqa: F401  (fixtures)



def _names(root) -> list[str]:
    return sorted(p.name for p in (root / "manifests").iterdir() if ".tmp-" not in p.name)


def _cli(*argv, shell_tail: str = "") -> subprocess.CompletedProcess:
    """The real entry point in a real process; ``shell_tail`` pipes its stdout (e.g. "| head -1")."""
    cmd = " ".join([sys.executable, "-m", "deltackpt", *map(str, argv)]) + " " + shell_tail
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(["bash", "-c", cmd + "; exit ${PIPESTATUS[0]}"], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=120)


# -- --json errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, code, type_, needle", [
    (["ls", "{tmp}/nope"], 3, "StoreNotFoundError", "not a deltackpt store"),
    (["show", "{store}", "s9"], 3, "CheckpointNotFoundError", "nearby names"),
    (["show", "{store}", "../etc"], 2, "InvalidNameError", "invalid checkpoint name"),
    (["verify", "{store}", "--level", "7"], 2, "UsageError", "--level"),
    (["gc", "{store}", "--max-unused", "lots"], 2, "ValueError", "--max-unused"),
    (["frobnicate"], 2, "UsageError", "invalid choice"),
    (["init", "{tmp}/a-file"], 3, "StoreExistsError", "is a file, not a directory"),
    ([], 2, "UsageError", "command"),
])
@pytest.mark.parametrize("where", ["before", "after"])
def test_json_errors_are_a_json_object_on_stdout(store_path, tmp_path, capsys, argv, code, type_, needle, where):
    (tmp_path / "a-file").write_text("not a store")
    argv = [a.format(tmp=tmp_path, store=store_path) for a in argv]
    argv = ["--json", *argv] if where == "before" or not argv else [*argv, "--json"]
    got, out, err = run(capsys, *argv)
    assert got == code
    assert err == ""
    error = json.loads(out)["error"]
    assert error["type"] == type_ and error["exit_code"] == code and needle in error["message"]


def test_errors_without_json_are_one_line_on_stderr(store_path, capsys):
    code, out, err = run(capsys, "show", store_path, "s9")
    assert code == 3 and out == "" and err.count("\n") == 1 and err.startswith("deltackpt: error: no checkpoint")


def test_json_error_from_a_real_process(tmp_path):
    p = _cli("ls", tmp_path / "nope", "--json")
    assert p.returncode == 3 and p.stderr == ""
    assert json.loads(p.stdout)["error"]["type"] == "StoreNotFoundError"


def test_help_documents_exit_status_and_json_errors(capsys):
    assert main(["forget", "--help"]) == 0
    out, _ = capsys.readouterr()
    assert out.count("exit status:") == 1 and "130" in out
    assert '{"error": {"type"' in out and "exit_code" in out and "head -1" in out


# -- a closed pipe ---------------------------------------------------------------------------------------------


def test_closed_pipe_exits_quietly(tmp_path):
    """`show S latest | head -1` on a listing far larger than a pipe buffer: exit 0, nothing on stderr."""
    store = Store.init(tmp_path / "big", **SMALL)
    store.save("big", {f"item{k:05d}": np.full(4, k, np.float32) for k in range(3000)})
    p = _cli("show", tmp_path / "big", "latest", shell_tail="| head -1")
    assert (p.returncode, p.stderr) == (0, "")
    assert p.stdout.startswith("checkpoint big ") and p.stdout.count("\n") == 1
    p = _cli("show", tmp_path / "big", "latest", "--json", shell_tail="| head -c 10")
    assert (p.returncode, p.stderr) == (0, "")
    p = _cli("show", tmp_path / "big", "latest", shell_tail="| cat > /dev/null")  # a reader that reads all
    assert (p.returncode, p.stderr) == (0, "")


def test_a_closed_pipe_leaves_the_commands_own_exit_status(tmp_path):
    """`verify S | head -1` on a damaged store still exits 1 (it exited 0: the status was dropped with the
    output), and a failed command's JSON error cut short still exits 3."""
    store = Store.init(tmp_path / "s", **SMALL)
    store.save("a", {f"item{k:04d}": np.full(64, k, np.float32) for k in range(200)})
    pack = next(p for p in (tmp_path / "s" / "packs").rglob("*") if p.is_file())
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert _cli("verify", tmp_path / "s").returncode == 1
    p = _cli("verify", tmp_path / "s", shell_tail="| true")
    assert (p.returncode, p.stderr) == (1, "")
    p = _cli("--json", "ls", tmp_path / "nope", shell_tail="| true")
    assert (p.returncode, p.stderr) == (3, "")


# -- refused or explained options ------------------------------------------------------------------------------


@pytest.mark.parametrize("grace", ["-1", "-0.5", "nan", "inf", "soon"])
def test_gc_refuses_a_bad_grace(store_path, capsys, grace):
    packs = sorted((store_path / "packs").rglob("*"))
    code, _, err = run(capsys, "gc", store_path, f"--grace={grace}")
    assert code == 2 and "--grace" in err and "seconds >= 0" in err
    assert sorted((store_path / "packs").rglob("*")) == packs


def test_forget_refuses_keep_within_zero(store_path, capsys):
    for value in ("0s", "0d"):
        code, _, err = run(capsys, "forget", store_path, "--keep-within", value)
        assert code == 2 and "longer than 0" in err
    assert _names(store_path) == ["s0", "s1", "s2", "s3"]


def test_forget_keeps_the_newest_whatever_the_rules(store_path, capsys):
    code, out, _ = run(capsys, "forget", store_path, "--keep-every", "1000", "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["forget"] == ["s1", "s2"]  # s0 has step 0
    assert {"name": "s3", "reasons": ["newest"]} in plan["keep"]


def test_keep_every_without_step_metadata_explains_the_field(tmp_path, capsys):
    store = Store.init(tmp_path / "nostep", **SMALL)
    for i in range(3):
        store.save(f"c{i}", {"x": np.full(100, i, np.uint8)})
    code, _, err = run(capsys, "forget", tmp_path / "nostep", "--keep-every", "2")
    assert code == 2 and "metadata field 'step'" in err and err.count("\n") == 1
    assert _names(tmp_path / "nostep") == ["c0", "c1", "c2"]
    assert main(["forget", "--help"]) == 0
    assert "metadata 'step'" in capsys.readouterr().out


@pytest.mark.parametrize("argv, option", [(["gc", "--max-unused", "ten"], "--max-unused"),
                                          (["verify", "--sample", "ten%"], "--sample")])
def test_percentages_are_parsed_one_way(store_path, capsys, argv, option):
    code, _, err = run(capsys, argv[0], store_path, *argv[1:])
    assert code == 2 and f"{option} must be a fraction or a percentage (0.1 or 10%)" in err


# -- forget by name --------------------------------------------------------------------------------------------


def test_forget_by_name(store_path, capsys):
    code, out, _ = run(capsys, "forget", store_path, "s1", "latest", "--dry-run")
    assert code == 0 and out.split("\n")[:2] == ["forget s1", "forget s3"]
    assert _names(store_path) == ["s0", "s1", "s2", "s3"]
    code, out, _ = run(capsys, "forget", store_path, "s1", "s2", "--json")
    assert code == 0 and json.loads(out)["forgotten"] == ["s1", "s2"]
    assert _names(store_path) == ["s0", "s3"]
    code, out, _ = run(capsys, "forget", store_path, "s0")
    assert code == 0 and out.startswith("forgot 1 checkpoint(s); run `deltackpt gc`")


def test_forget_by_name_refuses_unknown_and_tagged_names_and_forgets_nothing(store_path, capsys):
    code, _, err = run(capsys, "forget", store_path, "s0", "s7")
    assert code == 3 and "no checkpoint named 's7'" in err and "nearby names" in err
    assert run(capsys, "tag", store_path, "s1", "best")[0] == 0
    code, out, err = run(capsys, "forget", store_path, "s0", "s1")
    assert code == 3 and "pinned by tag(s) best" in err and "deltackpt tag STORE s1 --remove best" in err
    code, out, _ = run(capsys, "forget", store_path, "s1", "--json")
    assert code == 3 and json.loads(out)["error"]["type"] == "CheckpointPinnedError"
    assert _names(store_path) == ["s0", "s1", "s2", "s3"]
    code, _, err = run(capsys, "forget", store_path, "s0", "--keep-last", "1")
    assert code == 2 and "not both" in err
    assert _names(store_path) == ["s0", "s1", "s2", "s3"]


# -- ls and show -----------------------------------------------------------------------------------------------


def test_ls_shows_tags_and_agrees_with_show_on_stored_bytes(store_path, capsys):
    assert run(capsys, "tag", store_path, "s2", "best", "v1")[0] == 0
    code, out, _ = run(capsys, "ls", store_path, "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["s2"]["tags"] == ["best", "v1"] and rows["s0"]["tags"] == []
    code, text, _ = run(capsys, "ls", store_path)
    assert "TAGS" in text.splitlines()[0]
    assert [line.split()[-1] for line in text.splitlines()[1:]] == ["-", "-", "best,v1", "-"]
    store = Store.open(store_path)
    for name, row in rows.items():
        code, out, _ = run(capsys, "show", store_path, name, "--json")
        shown = json.loads(out)
        for key in ("stored_bytes", "logical_bytes", "dedup_ratio", "tags", "num_chunks", "new_chunks"):
            assert shown[key] == row[key], (name, key)
        manifest_bytes = (store_path / "manifests" / name).stat().st_size
        assert row["stored_bytes"] == store.read_manifest(name).stats.stored_bytes + manifest_bytes
        assert row["dedup_ratio"] == row["logical_bytes"] / row["stored_bytes"]
        code, out, _ = run(capsys, "show", store_path, name)
        ls_line = next(line for line in text.splitlines() if line.startswith(name + " "))
        stored_text = " ".join(ls_line.split()[5:7])  # NAME DATE TIME LOGICAL(2) STORED(2)
        assert f"new stored {stored_text}" in out.splitlines()[0]


# -- partial verify --------------------------------------------------------------------------------------------


def test_verify_with_no_time_says_what_it_did_not_check(store_path, capsys):
    code, out, _ = run(capsys, "verify", store_path, "--max-duration", "0s")
    lines = out.splitlines()
    assert code == 0
    assert "partial: checked 0 of 4 packs; 4 pack(s) and" in out and "--max-duration" in out
    assert lines[-1] == "no problems found in what was checked" and "no problems found" not in lines
    code, out, _ = run(capsys, "verify", store_path, "--max-duration", "0s", "--json")
    rep = json.loads(out)
    assert rep["complete"] is False and rep["clean"] is False and rep["ok"] is True
    assert rep["packs_checked"] == 0 and rep["packs_skipped"] == 4 and rep["chunks_skipped"] >= 4
    assert rep["skipped_by"] == "max_duration"
    code, out, _ = run(capsys, "verify", store_path, "--json")
    rep = json.loads(out)
    assert rep["complete"] is True and rep["clean"] is True and rep["packs_skipped"] == 0


def test_verify_sample_is_partial_in_the_same_words(store_path, capsys):
    code, out, _ = run(capsys, "verify", store_path, "--sample", "50%")
    assert code == 0 and "partial: checked 2 of 4 packs; 2 pack(s)" in out and "the sample" in out
    assert out.splitlines()[-1] == "no problems found in what was checked"
    rep = json.loads(run(capsys, "verify", store_path, "--sample", "50%", "--json")[1])
    assert (rep["clean"], rep["complete"], rep["skipped_by"], rep["packs_skipped"]) == (False, False, "sample", 2)


def test_partial_verify_with_problems_exits_1(store_path, capsys):
    store = Store.open(store_path)
    pack = store.index.lookup(store.read_manifest("s1").items[0].chunks[0].id).pack
    (store_path / pack_key(pack)).unlink()  # found at level 0, which a time limit never cuts
    code, out, _ = run(capsys, "verify", store_path, "--max-duration", "0s")
    assert code == 1 and "partial: checked 0 of" in out and "damaged: s1" in out
    assert "no problems found" not in out


def test_ctrl_c_exits_130_and_says_interrupted(store_path, capsys, monkeypatch):
    from deltackpt.cli import listing

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(listing, "cmd_ls", interrupted)
    code, out, err = run(capsys, "ls", store_path)
    assert code == 130 and out == "" and err.strip() == "deltackpt: error: interrupted"  # was "KeyboardInterrupt"


def test_copy_of_a_wrong_name_creates_no_destination(store_path, tmp_path, capsys):
    code, _out, err = run(capsys, "copy", store_path, tmp_path / "dst", "nope")
    assert code == 3 and "no checkpoint named 'nope'" in err
    assert not (tmp_path / "dst").exists()


def test_an_error_raised_while_a_ctrl_c_was_handled_exits_as_interrupted():
    """A Ctrl-C that lands in a lazy import comes out as the import's error (numpy's ImportError), its context
    the KeyboardInterrupt: that is an interrupt (130), not a bug shown with a traceback."""
    from deltackpt.cli.status import EXIT_INTERRUPTED, exit_code_for

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ImportError("numpy failed to import")
    except ImportError as e:
        assert exit_code_for(e) == EXIT_INTERRUPTED
    with pytest.raises(RuntimeError):
        exit_code_for(RuntimeError("a bug"))


def test_a_malformed_storage_option_is_refused_on_a_local_path_too(store_path, capsys):
    """On a local store the pairs mean nothing, but a malformed one is still a typo the user should hear of."""
    code, _, err = run(capsys, "ls", store_path, "--storage-option", "anon")
    assert code == 2 and "--storage-option wants KEY=VALUE, got 'anon'" in err
    assert run(capsys, "ls", store_path, "--storage-option", "anon=true")[0] == 0


@pytest.mark.parametrize("argv, needle", [(["--keep-last", "0"], "--keep-last: expected a whole number >= 1"),
                                          (["--keep-every", "two"], "--keep-every: expected a whole number >= 1"),
                                          (["--keep-within", "3q"], "--keep-within: expected a duration longer"),
                                          ([], "give checkpoint names or a retention policy (--keep-last")])
def test_forget_errors_name_the_options_not_the_engine_parameters(store_path, capsys, argv, needle):
    code, _, err = run(capsys, "forget", store_path, *argv)
    assert code == 2 and needle in err and "keep_" not in err
    assert _names(store_path) == ["s0", "s1", "s2", "s3"]


def test_tag_as_a_query_leaves_a_damaged_pin_and_the_placeholder_is_refused(store_path, capsys):
    """`tag S s1` (no TAG, no --remove) shows the tags, but wrote them back too: on a damaged tags object, which
    still pins s1, that deleted the pin. And `tag S s2 '(damaged)'` exited 0 having pinned nothing (the
    placeholder is dropped as the damaged object's stand-in)."""
    (store_path / "tags").mkdir(exist_ok=True)
    (store_path / "tags" / "s1").write_bytes(b"{not json")
    code, out, _ = run(capsys, "tag", store_path, "s1")
    assert code == 0 and out.strip() == "s1: (damaged)"
    assert (store_path / "tags" / "s1").read_bytes() == b"{not json"
    code, _, err = run(capsys, "tag", store_path, "s2", "(damaged)")
    assert code == 2 and "invalid tag" in err
    assert not (store_path / "tags" / "s2").exists()


@pytest.mark.parametrize("opts", [["key=12345678", "secret=87654321", "endpoint_url=http://127.0.0.1:9"],
                                  ["endpoint_url=1"]])
def test_a_storage_option_that_looks_like_a_number_is_a_string_or_a_one_line_error(capsys, opts):
    """An access key of digits was parsed as an int and botocore's TypeError became a traceback (exit 1, and
    with --json nothing on stdout). Credentials and endpoints stay strings; a refusal is a one-line error."""
    pytest.importorskip("s3fs")
    from deltackpt.cli.options import parse_pairs

    assert parse_pairs(["key=12345678", "max_attempts=3"], "--storage-option") == {"key": "12345678",
                                                                                   "max_attempts": 3}
    argv = ["--json", "ls", "s3://bucket/run"] + [x for o in opts for x in ("--storage-option", o)]
    code, out, _ = run(capsys, *argv)
    assert code in (2, 3) and "error" in json.loads(out)


def test_version_with_a_bad_kernel_setting_is_one_line_and_a_usage_exit():
    """``--version`` imported the kernels outside the error handling: a bad DELTACKPT_KERNELS printed a
    traceback and exited 1 (``problems found``), and --json was ignored."""
    cmd = [sys.executable, "-m", "deltackpt", "--version"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), DELTACKPT_KERNELS="bogus")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.strip().splitlines() == [
        "deltackpt: error: DELTACKPT_KERNELS='bogus' is not valid; allowed values: auto, native, numpy"]
    p = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert p.returncode == 2 and json.loads(p.stdout)["error"]["type"] == "ValueError"
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, DELTACKPT_KERNELS="numpy"),
                       cwd=REPO_ROOT, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("(kernels: numpy)")

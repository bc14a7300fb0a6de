"""The maintenance commands of the CLI: verify, gc, forget, tag (exit codes, --json output, effects)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deltackpt.store import Store
from deltackpt.store import index as index_mod
from deltackpt.store.lock import EXCLUSIVE, SHARED
from deltackpt.store.pack import HEADER_SIZE, pack_key
from deltackpt.store.retention import read_tags

from cli_fixtures import REPO_ROOT, SMALL, _close_new_lmdb_envs, run, store_path  # noqa: F401  (fixtures)



def run_json(capsys, *argv) -> tuple[int, dict]:
    code, out, err = run(capsys, *argv, "--json")
    return code, (json.loads(out) if out.strip() else {"stderr": err})


def _names(root) -> list[str]:
    return sorted(p.name for p in (root / "manifests").iterdir() if ".tmp-" not in p.name)


def _damage_one_chunk(root, ckpt="s1"):
    store = Store.open(root)
    ref = store.read_manifest(ckpt).items[0].chunks[0]
    e = store.index.lookup(ref.id)
    path = root / pack_key(e.pack)
    b = bytearray(path.read_bytes())
    b[e.offset + HEADER_SIZE + 10] ^= 0x10
    path.write_bytes(bytes(b))
    index_mod._close_env(root / "cache" / "index.lmdb")


# -- verify ----------------------------------------------------------------------------------------------------


def test_verify_clean_exits_0(store_path, capsys):
    for level in (0, 1, 2):
        code, rep = run_json(capsys, "verify", store_path, "--level", level)
        assert code == 0
        assert rep["ok"] is True and rep["level"] == level and rep["problems"] == []
        assert rep["num_checkpoints"] == 4 and rep["complete"] is True
    code, out, _ = run(capsys, "verify", store_path)
    assert code == 0 and "no problems found" in out


def test_verify_damage_exits_1_and_names_the_checkpoint(store_path, capsys):
    _damage_one_chunk(store_path, "s1")
    code, rep = run_json(capsys, "verify", store_path, "--level", "2")
    assert code == 1
    assert rep["ok"] is False and rep["damaged_checkpoints"] == ["s1"]
    assert any(p["kind"] == "bad-chunk" and p["items"] == ["s1:x"] for p in rep["problems"])
    code, out, _ = run(capsys, "verify", store_path, "--level", "2")
    assert code == 1 and "damaged: s1" in out and "affects s1:x" in out
    # level 0 reads no data: the flip is invisible there
    assert run_json(capsys, "verify", store_path, "--level", "0")[0] == 0


@pytest.mark.parametrize("args", [["--level", "3"], ["--level", "x"], ["--sample", "abc"], ["--sample", "0"],
                                  ["--sample", "150%"], ["--max-duration", "5 minutes"], ["--bogus"]])
def test_verify_usage_errors_exit_2(store_path, capsys, args):
    code, _, err = run(capsys, "verify", store_path, *args)
    assert code == 2, err
    assert err


def test_verify_not_a_store_exits_3(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        code, _, err = run(capsys, "verify", path, "--level", "2")
        assert code == 3 and "not a deltackpt store" in err


def test_verify_sample_percentage_is_partial(store_path, capsys):
    code, rep = run_json(capsys, "verify", store_path, "--level", "1", "--sample", "50%")
    assert code == 0
    assert rep["packs_checked"] == 2 and rep["num_packs"] == 4 and rep["complete"] is False
    code, rep = run_json(capsys, "verify", store_path, "--level", "1", "--sample", "0.5")  # rotates
    assert rep["packs_checked"] == 2
    code, rep = run_json(capsys, "verify", store_path, "--level", "1", "--sample", "100%")
    assert rep["packs_checked"] == 4 and rep["complete"] is True
    code, out, _ = run(capsys, "verify", store_path, "--sample", "25%")
    assert code == 0 and "(partial)" in out


def test_verify_max_duration(store_path, capsys):
    code, rep = run_json(capsys, "verify", store_path, "--level", "2", "--max-duration", "10m")
    assert code == 0 and rep["complete"] is True


def test_verify_as_a_real_process(store_path):
    """The console entry point really exits with these codes (not only main()'s return value)."""
    _damage_one_chunk(store_path, "s2")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    p = subprocess.run([sys.executable, "-m", "deltackpt", "verify", str(store_path), "--level", "2", "--json"],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert p.returncode == 1, p.stderr
    assert json.loads(p.stdout)["damaged_checkpoints"] == ["s2"]
    p = subprocess.run([sys.executable, "-m", "deltackpt", "verify", str(store_path), "--level", "7"],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert p.returncode == 2


# -- forget ----------------------------------------------------------------------------------------------------


def test_forget_dry_run_changes_nothing(store_path, capsys):
    manifests = {p.name: p.read_bytes() for p in (store_path / "manifests").iterdir()}
    code, plan = run_json(capsys, "forget", store_path, "--keep-last", "2", "--dry-run")
    assert code == 0
    assert plan["dry_run"] is True
    assert plan["forget"] == ["s0", "s1"]
    assert [k["name"] for k in plan["keep"]] == ["s2", "s3"]
    assert {p.name: p.read_bytes() for p in (store_path / "manifests").iterdir()} == manifests
    code, out, _ = run(capsys, "forget", store_path, "--keep-last", "2", "--dry-run")
    assert code == 0 and "forget s0" in out and "keep   s3" in out
    assert _names(store_path) == ["s0", "s1", "s2", "s3"]


def test_forget_forgets(store_path, capsys):
    packs = sorted(p.name for p in (store_path / "packs").rglob("*") if p.is_file())
    code, res = run_json(capsys, "forget", store_path, "--keep-last", "2")
    assert code == 0 and res["forgotten"] == ["s0", "s1"] and res["kept"] == ["s2", "s3"]
    assert _names(store_path) == ["s2", "s3"]
    assert sorted(p.name for p in (store_path / "packs").rglob("*") if p.is_file()) == packs  # until gc
    code, out, _ = run(capsys, "forget", store_path, "--keep-last", "1")
    assert code == 0 and "forgot 1 checkpoint(s)" in out and "deltackpt gc" in out
    assert _names(store_path) == ["s3"]


def test_forget_rules(store_path, capsys):
    code, plan = run_json(capsys, "forget", store_path, "--keep-every", "20", "--keep-last", "1", "--dry-run")
    assert code == 0 and plan["forget"] == ["s1"]
    code, plan = run_json(capsys, "forget", store_path, "--keep-within", "7d", "--dry-run")
    assert code == 0 and plan["forget"] == []  # all created seconds ago


@pytest.mark.parametrize("args", [[], ["--keep-last", "-1"], ["--keep-within", "soon"], ["--keep-last", "x"]])
def test_forget_usage_errors_exit_2(store_path, capsys, args):
    code, _, err = run(capsys, "forget", store_path, *args)
    assert code == 2 and err
    assert _names(store_path) == ["s0", "s1", "s2", "s3"]


# -- tag -------------------------------------------------------------------------------------------------------


def test_tag_add_remove_and_pin(store_path, capsys):
    code, res = run_json(capsys, "tag", store_path, "s0", "t1", "t2")
    assert code == 0 and res == {"checkpoint": "s0", "tags": ["t1", "t2"]}
    code, res = run_json(capsys, "tag", store_path, "s0", "--remove", "t1")
    assert code == 0 and res["tags"] == ["t2"]
    code, res = run_json(capsys, "tag", store_path, "latest", "newest")
    assert code == 0 and res["checkpoint"] == "s3" and res["tags"] == ["newest"]
    code, out, _ = run(capsys, "tag", store_path, "s0")
    assert code == 0 and out.strip() == "s0: t2"
    store = Store.open(store_path)
    assert read_tags(store, "s0") == ["t2"]
    # tagged checkpoints survive forget
    code, res = run_json(capsys, "forget", store_path, "--keep-last", "1")
    assert res["forgotten"] == ["s1", "s2"]
    assert _names(store_path) == ["s0", "s3"]
    code, res = run_json(capsys, "tag", store_path, "s0", "--remove", "t2")
    assert res["tags"] == []
    assert not (store_path / "tags" / "s0").exists()


def test_tag_errors(store_path, capsys):
    code, _, err = run(capsys, "tag", store_path, "nope", "t1")
    assert code == 3 and "nope" in err
    code, _, err = run(capsys, "tag", store_path, "s0", "bad tag")
    assert code == 2 and "invalid tag" in err
    code, _, err = run(capsys, "tag", store_path, "../x", "t")
    assert code == 2


# -- gc --------------------------------------------------------------------------------------------------------


def test_gc_dry_run_then_gc(store_path, capsys):
    assert run_json(capsys, "forget", store_path, "--keep-last", "2")[0] == 0
    packs = sorted(p for p in (store_path / "packs").rglob("*") if p.is_file())
    code, plan = run_json(capsys, "gc", store_path, "--dry-run", "--grace", "0")
    assert code == 0 and plan["dry_run"] is True and len(plan["delete_packs"]) == 2
    assert plan["reclaim_bytes"] > 0
    assert sorted(p for p in (store_path / "packs").rglob("*") if p.is_file()) == packs
    code, plan = run_json(capsys, "gc", store_path, "--dry-run")  # default grace: everything is too young
    assert plan["delete_packs"] == [] and plan["kept_young_packs"] == 4
    code, res = run_json(capsys, "gc", store_path, "--grace", "0", "--max-unused", "50%")
    assert code == 0 and res["deleted_packs"] == 2
    assert len([p for p in (store_path / "packs").rglob("*") if p.is_file()]) == 2
    code, rep = run_json(capsys, "verify", store_path, "--level", "2")
    assert code == 0 and rep["orphan_packs"] == []


def test_gc_dry_run_shows_the_merge_of_small_packs(tmp_path, capsys):
    root = tmp_path / "small"
    store = Store.init(root, **SMALL)
    for i in range(20):  # one pack of ~1 KiB a save: under 1/8 of the 64 KiB pack size, 20 KiB together
        store.save(f"c{i}", {"x": np.random.default_rng(i).standard_normal(256).astype(np.float32)})
    index_mod._close_env(root / "cache" / "index.lmdb")
    packs = sorted(p for p in (root / "packs").rglob("*") if p.is_file())
    code, out, _ = run(capsys, "gc", root, "--dry-run", "--grace", "0")
    assert code == 0 and "merge 20 small pack(s) (into about 1 new pack(s)" in out
    code, plan = run_json(capsys, "gc", root, "--dry-run", "--grace", "0", "--no-merge")
    assert plan["merge_packs"] == [] and plan["new_packs"] == 0
    assert sorted(p for p in (root / "packs").rglob("*") if p.is_file()) == packs
    code, out, _ = run(capsys, "gc", root, "--grace", "0")
    assert code == 0 and "merged 20 small pack(s) into 1 (" in out
    assert len([p for p in (root / "packs").rglob("*") if p.is_file()]) == 1
    code, rep = run_json(capsys, "verify", root, "--level", "2")
    assert code == 0 and rep["clean"] and rep["orphan_packs"] == []


def test_gc_while_locked_exits_3(store_path, capsys):
    store = Store.open(store_path)
    with store.lock(SHARED, refresh=False):
        code, _, err = run(capsys, "gc", store_path, "--grace", "0", "--wait", "0.2")  # a save runs: gc waits
        assert code == 3 and "locked" in err and "gave up after waiting" in err
    with store.lock(EXCLUSIVE, refresh=False):
        code, _, err = run(capsys, "verify", store_path)  # verify needs no lock
        assert code == 0
    assert run(capsys, "gc", store_path, "--grace", "0")[0] == 0


def test_gc_reports_a_damaged_pack_it_left_and_reclaims_only_what_went(tmp_path, capsys):
    """gc left a pack planned for repacking that no longer hashes to its name (right), but exited 0 and
    reported the plan's reclaimed bytes, the damaged pack's included; --json said nothing of it."""
    from deltackpt.store.gc import plan_gc

    root = tmp_path / "s"
    store = Store.init(root, chunk_size_bytes=8192, pack_target_bytes=1 << 20)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(16 * 1024).astype(np.float32)
    for i in range(4):
        w = w.copy()
        w[i * 7] += 1
        store.save(f"step-{i}", {"w": w, "b": rng.standard_normal(1000).astype(np.float32)})
    store.forget(["step-0", "step-1"])
    plan = plan_gc(Store.open(root), grace_s=0, max_unused=0.0, merge_small=False)
    assert len(plan.repack) >= 2
    victim = sorted(plan.repack)[0]
    path = root / pack_key(victim)
    b = bytearray(path.read_bytes())
    b[100] ^= 1
    path.write_bytes(bytes(b))
    index_mod._close_env(root / "cache" / "index.lmdb")

    def pack_bytes() -> int:
        return sum(p.stat().st_size for p in (root / "packs").rglob("*") if p.is_file())

    before = pack_bytes()
    code, rep = run_json(capsys, "gc", root, "--grace", "0", "--max-unused", "0", "--no-merge")
    assert code == 1 and rep["damaged_packs"] == [victim]
    assert path.exists() and rep["reclaimed_bytes"] == before - pack_bytes() > 0
    code, out, _err = run(capsys, "gc", root, "--grace", "0", "--max-unused", "0", "--no-merge")
    assert code == 1 and f"damaged pack {victim}" in out

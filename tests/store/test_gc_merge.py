"""gc merges small packs (one per rank and save) into packs of the target size: live chunks moved bit-exact,
deltas and their bases (in other packs) still found, nothing merged within the grace period or below the
threshold, a save that commits between plan and execute keeps its chunks, and a merge killed half way
leaves a store that verifies and that the next gc finishes."""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest

from deltackpt.store import Store
from deltackpt.store.gc import MAX_SMALL_PACKS, SMALL_PACK_SHARE, plan_gc
from deltackpt.store.verify import verify_store

from store_helpers import (REPO_ROOT, assert_items_equal, pack_names, packs_of_checkpoint, random_array,
                           subprocess_env)

TARGET = 64 << 10  # SMALL's pack_target_bytes: packs under 8 KiB are small


def _arr(rng, n: int) -> np.ndarray:
    return random_array(rng, "float32", (n,))


def _check_clean(store, saved: dict[str, dict], orphans=frozenset()) -> None:
    r = verify_store(store, level=2)
    assert r.clean, [p.as_dict() for p in r.problems]
    assert set(r.orphan_packs) == set(orphans)
    for name, items in saved.items():
        assert_items_equal(items, store.load(name))


def _small_saves(store, rng, n: int, prefix: str = "c") -> dict[str, dict]:
    """``n`` checkpoints of their own ~1 KiB each: one small pack a save."""
    saved = {}
    for i in range(n):
        saved[f"{prefix}{i}"] = {"x": _arr(rng, 256), "meta": f"step {i}".encode()}
        store.save(f"{prefix}{i}", saved[f"{prefix}{i}"])
    return saved


def test_small_packs_merge_into_packs_of_the_target_size(store, rng):
    saved = _small_saves(store, rng, 40)
    before = pack_names(store)
    assert len(before) == 40 and all(i.size_bytes < SMALL_PACK_SHARE * TARGET for i in store.backend.list("packs/"))
    plan = plan_gc(store, grace_s=0)
    assert plan.merge == set(plan.repack) == before and not plan.delete_packs
    assert plan.as_dict()["merge_packs"] == sorted(before) and plan.as_dict()["repack_packs"] == []
    result = plan.execute()
    after = pack_names(store)
    assert result.merged_packs == 40 and result.repacked_packs == 0 and result.new_packs == len(after)
    assert len(after) == plan.new_packs == 1 and not after & before
    _check_clean(store, saved)
    again = plan_gc(store, grace_s=0)  # the merged pack is not small: never rewritten again
    assert not again.repack and not again.delete_packs
    reopened = Store.open(store.backend, cache_dir=str(store.cache_dir) + "-fresh")  # index rebuilt from packs
    for name, items in saved.items():
        assert_items_equal(items, reopened.load(name))


def test_nothing_merged_within_the_grace_period(store, rng):
    saved = _small_saves(store, rng, 40)
    plan = plan_gc(store, grace_s=3600)
    assert not plan.repack and not plan.merge and plan.kept_young == 40
    plan.execute()
    assert len(pack_names(store)) == 40
    _check_clean(store, saved)


def test_few_small_packs_are_left_alone(store, rng):
    saved = _small_saves(store, rng, 4)  # ~5 KiB together: merging would make another small pack
    assert not plan_gc(store, grace_s=0).repack
    saved |= _small_saves(store, rng, 40, prefix="more")
    assert not plan_gc(store, grace_s=0, merge_small=False).repack
    _check_clean(store, saved)


def test_many_tiny_packs_merge_even_below_the_byte_share(make_store, rng):
    store = make_store("memory", pack_target_bytes=64 << 20)  # 8 MiB share: never reached by these
    saved = {}
    for i in range(MAX_SMALL_PACKS):
        saved[f"c{i}"] = {"b": f"tiny {i}".encode()}
        store.save(f"c{i}", saved[f"c{i}"])
    plan = plan_gc(store, grace_s=0)
    assert len(plan.merge) == MAX_SMALL_PACKS
    plan.execute()
    assert len(pack_names(store)) == 1
    _check_clean(store, saved)


def test_merge_keeps_deltas_and_their_bases_in_other_packs(make_store, rng):
    """Deltas in small packs whose bases sit in a large pack (not merged) or in another small pack."""
    store = make_store("memory")
    big = _arr(rng, 3 * 4096)  # three 16 KiB chunks: its pack is not small
    w = _arr(rng, 1024)  # one 4 KiB chunk: a small pack
    saved = {"big": {"big": big}, "w": {"w": w}}
    store.save("big", saved["big"])
    store.save("w", saved["w"])
    for i in range(12):
        b2, w2 = big[:4096].copy(), w.copy()
        b2[:: 500] += np.float32(i + 1)
        w2[:: 300] += np.float32(i + 1)
        saved[f"d{i}"] = {"b": b2, "w": w2}
        store.save(f"d{i}", saved[f"d{i}"])
    big_pack = packs_of_checkpoint(store, "big")
    deltas = [store.index.lookup(r.id) for n in saved if n.startswith("d")
              for it in store.read_manifest(n).items for r in it.chunks]
    assert sum(e.base_id is not None for e in deltas) >= 12  # the test is about deltas
    plan = plan_gc(store, grace_s=0)
    assert plan.merge and not plan.merge & big_pack and packs_of_checkpoint(store, "w") <= plan.merge
    plan.execute()
    assert big_pack <= pack_names(store)
    for e in deltas:  # every index record points at a pack that holds the chunk
        now = store.index.lookup(e.chunk_id)
        assert now is not None and now.base_id == e.base_id and now.pack in pack_names(store)
    _check_clean(store, saved)


@pytest.mark.parametrize("reuse", ["live", "dead"])
def test_save_committed_between_plan_and_execute_keeps_its_chunks(store, rng, reuse):
    """A save commits between plan and execute that deduplicates against a chunk of a planned merge pack
    (one that stays live, or a dead one the merge would drop) and writes a delta against another: gc keeps
    every chunk it needs (the pack of the dead one is left out of the merge)."""
    saved = _small_saves(store, rng, 40)
    w, dead = _arr(rng, 1024), b"dead bytes" * 20
    saved["w"] = {"w": w}
    store.save("w", saved["w"])
    store.save("mixed", {"x": saved["c5"]["x"], "y": _arr(rng, 256), "dead": dead})
    saved["y"] = {"y": store.load("mixed")["y"]}
    store.save("y", saved["y"])  # deduplicated: y stays live in mixed's pack, beside the dead chunk
    mixed = packs_of_checkpoint(store, "y")
    store.forget(["mixed"])
    plan = plan_gc(store, grace_s=0, max_unused=0.9)  # mixed's pack is kept, not repacked: it is merged
    assert mixed <= plan.merge and packs_of_checkpoint(store, "w") <= plan.merge
    w2 = w.copy()
    w2[::300] += 1.0
    new = {"x": saved["c7"]["x"] if reuse == "live" else dead, "w": w2}
    store.save("late", new)
    saved["late"] = new
    again = plan.revalidate()
    assert (mixed <= again.merge) == (reuse == "live")
    result = plan.execute()
    assert result.merged_packs == len(again.merge) > 0
    _check_clean(store, saved)


@pytest.mark.timeout(120)
def test_merge_killed_after_its_first_new_pack_leaves_a_store_the_next_gc_finishes(make_store, rng):
    """kill -9 right after the first merged pack is published (the old small packs all still there): every
    checkpoint verifies and loads; the next gc deletes the old packs whose chunks moved, and merges the rest."""
    store = make_store("local", pack_target_bytes=16 << 10)  # small: under 2 KiB; a merged pack holds ~12
    saved = _small_saves(store, rng, 40)
    before = pack_names(store)
    env = subprocess_env()
    env["DELTACKPT_CRASH_POINT"] = "gc:after-repack"
    code = ("import sys; from deltackpt.store import Store; from deltackpt.store.gc import plan_gc; "
            "plan_gc(Store.open(sys.argv[1]), grace_s=0).execute()")
    proc = subprocess.run([sys.executable, "-c", code, str(store.backend.root)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    store = Store.open(store.backend.root)
    assert before < pack_names(store) and len(pack_names(store) - before) == 1
    plan = plan_gc(store, grace_s=0)
    moved = set(plan.delete_packs)  # every chunk of theirs now lives in the merged pack
    assert moved and moved <= before and not moved & plan.merge
    _check_clean(store, saved, orphans=moved)
    plan.execute()
    assert not pack_names(store) & before and len(pack_names(store)) < 10
    _check_clean(store, saved)


def test_a_gc_after_a_merge_killed_after_its_repack_keeps_the_only_copy_of_a_live_chunk(tmp_path):
    """A merge gc killed after its repack leaves the merged pack R = {X, Y} beside c0's P0 = {X} and c1's
    P1 = {Y, a delta on X}. With c1 forgotten, the next gc finds X's indexed copy in R, so P0 is a dead
    duplicate, deleted after the repack since it holds the base of R's Y; R is repacked to {X}, byte for byte
    P0, so under P0's name. That pack, just published, was deleted as dead P0, and R as repacked: X had no
    copy left and c0 did not restore."""
    from deltackpt.testing import floats

    from store_helpers import SMALL

    root = tmp_path / "store"
    store = Store.init(root, **{**SMALL, "pack_target_bytes": 32768})  # two small packs, together >= 1/8
    w0 = floats(1, 1024)
    w1 = w0.copy()
    w1[::3] += np.float32(1e-3)
    store.save("c0", {"w": w0})
    store.save("c1", {"w": w1})
    before = pack_names(store)
    env = subprocess_env()
    env["DELTACKPT_CRASH_POINT"] = "gc:after-repack"
    code = ("import sys; from deltackpt.store import Store; from deltackpt.store.gc import plan_gc; "
            "plan_gc(Store.open(sys.argv[1]), grace_s=0).execute()")
    proc = subprocess.run([sys.executable, "-c", code, str(root)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    store = Store.open(root)
    assert len(pack_names(store) - before) == 1  # the merged pack, beside P0 and P1
    store.forget(["c1"])
    plan_gc(store, grace_s=0).execute()
    again = Store.open(root, cache_dir=tmp_path / "fresh")  # another process, its own cache
    np.testing.assert_array_equal(again.load("c0")["w"], w0)
    np.testing.assert_array_equal(store.load("c0")["w"], w0)
    assert verify_store(again, level=2).clean

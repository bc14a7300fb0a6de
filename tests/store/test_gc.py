"""gc: plan then execute; dead packs deleted, mixed packs repacked, delta bases kept, young packs and an
in-flight writer's packs spared, locks honoured, stale locks and temp files cleaned up."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import xxhash

from deltackpt.errors import DeltackptError, StoreLockedError
from deltackpt.store import MemoryBackend, Store, codec
from deltackpt.store.gc import live_chunk_ids, plan_gc
from deltackpt.store import lock as lock_mod
from deltackpt.store.lock import EXCLUSIVE, SHARED, STALE_AFTER_S, list_locks
from deltackpt.store.manifest import manifest_key
from deltackpt.store.pack import pack_key
from deltackpt.store.verify import verify_store

from store_helpers import (SMALL, assert_items_equal, count_index_writes, mutate_object, pack_names,
                           packs_of_checkpoint, random_array)


def _arr(rng, n: int) -> np.ndarray:
    return random_array(rng, "float32", (n,))


def _drift(rng, w: np.ndarray, step: int) -> np.ndarray:
    """``w`` with every ``step``-th element changed (a delta against ``w``)."""
    w2 = w.copy()
    w2[::step] += rng.standard_normal(w2[::step].size).astype(np.float32)
    return w2


def _pack_bytes(store) -> dict[str, bytes]:
    return {n: store.backend.get(pack_key(n)) for n in pack_names(store)}


def _check_clean(store, saved: dict[str, dict]) -> None:
    r = verify_store(store, level=2)
    assert r.ok, [p.as_dict() for p in r.problems]
    assert r.orphan_packs == []
    assert sorted(store.checkpoint_names()) == sorted(saved)
    for name, items in saved.items():
        assert_items_equal(items, store.load(name))


def _nothing_planned(plan) -> bool:
    return not plan.delete_packs and not plan.repack and not plan.temp_files


# -- dead packs --------------------------------------------------------------------------------------------------


def test_forget_then_gc_deletes_dead_packs(store, rng):
    saved = {f"c{i}": {"x": _arr(rng, 3000), "s": b"shared" * 100} for i in range(4)}
    for name, items in saved.items():
        store.save(name, items)
    packs_before = pack_names(store)
    only_c1 = packs_of_checkpoint(store, "c1") - packs_of_checkpoint(store, "c0") - packs_of_checkpoint(store, "c2")
    assert only_c1
    store.forget(["c1"])
    del saved["c1"]
    assert pack_names(store) == packs_before  # forget touches no pack

    plan = plan_gc(store, grace_s=0)
    assert set(plan.delete_packs) == only_c1
    assert plan.repack == {}
    assert plan.reclaim_bytes == sum(plan.delete_packs.values()) > 0
    assert plan.as_dict()["delete_packs"] == sorted(only_c1)
    result = plan.execute()
    assert result.deleted_packs == len(only_c1) and result.repacked_packs == 0
    assert pack_names(store) == packs_before - only_c1
    _check_clean(store, saved)
    assert _nothing_planned(plan_gc(store, grace_s=0))


def test_gc_of_everything_forgotten_empties_the_store(local_store, rng):
    store = local_store
    store.save("a", {"x": _arr(rng, 3000)})
    store.forget("a")
    plan_gc(store, grace_s=0).execute()
    assert pack_names(store) == set()
    assert store.index.num_chunks() == 0
    assert verify_store(store, level=2).ok


def test_gc_with_nothing_dead_plans_nothing(store, rng):
    for i in range(3):
        store.save(f"c{i}", {"x": _arr(rng, 3000)})
    before = _pack_bytes(store)
    plan = plan_gc(store, grace_s=0)
    assert _nothing_planned(plan) and plan.reclaim_bytes == 0
    plan.execute()
    assert _pack_bytes(store) == before


# -- repack ------------------------------------------------------------------------------------------------------


def _mixed(store, rng):
    """a = {p, q} in one pack; b = {p (deduplicated: a's chunks), r}. Forgetting a leaves a's pack mixed."""
    p = _arr(rng, 4096)
    a = {"p": p, "q": _arr(rng, 8192)}
    b = {"p": p, "r": _arr(rng, 2048)}
    store.save("a", a)
    (a_pack,) = packs_of_checkpoint(store, "a")
    store.save("b", b)
    assert a_pack in packs_of_checkpoint(store, "b")
    return a_pack, a, b


def test_mixed_pack_is_repacked(store, rng):
    a_pack, a, b = _mixed(store, rng)
    p_ids = {r.id for r in store.read_manifest("a").item_map()["p"].chunks}
    store.forget("a")
    plan = plan_gc(store, grace_s=0, max_unused=0.1)
    assert list(plan.repack) == [a_pack] and plan.delete_packs == {}
    assert {e.chunk_id for e in plan.repack[a_pack]} == p_ids  # exactly the live entries
    assert 0 < plan.reclaim_bytes < plan.repack_sizes[a_pack]
    result = plan.execute()
    assert result.repacked_packs == 1 and result.moved_chunks == len(p_ids)
    assert a_pack not in pack_names(store)
    for cid in p_ids:  # the index follows the move
        assert store.index.lookup(cid).pack != a_pack
    _check_clean(store, {"b": b})
    assert _nothing_planned(plan_gc(store, grace_s=0, max_unused=0.1))
    # and a fresh process (index rebuilt from the new packs) reads the same
    fresh = Store.open(store.backend, cache_dir=store.cache_dir)
    fresh.rebuild_index()
    assert_items_equal(b, fresh.load("b"))


def test_gc_leaves_no_index_record_in_a_pack_it_removed(store, rng):
    """The index forgets the chunks of deleted and repacked packs by looking up their tables' ids (not by a
    pass over every record): none is left pointing at a pack that is gone."""
    a_pack, a, b = _mixed(store, rng)
    store.save("dead", {"x": _arr(rng, 4096)})
    dead_packs = set(packs_of_checkpoint(store, "dead"))
    store.forget("a")
    store.forget("dead")
    result = plan_gc(store, grace_s=0, max_unused=0.1).execute()
    assert result.repacked_packs == 1 and result.deleted_packs == len(dead_packs) >= 1
    gone = {a_pack} | dead_packs
    assert not gone & set(pack_names(store))
    assert not gone & {e.pack for e in store.index.iter_entries()}
    assert not gone & store.index.known_packs()
    _check_clean(store, {"b": b})


def test_mixed_pack_below_max_unused_is_left_alone(store, rng):
    a_pack, a, b = _mixed(store, rng)
    store.forget("a")
    plan = plan_gc(store, grace_s=0, max_unused=1.0)
    assert _nothing_planned(plan)
    plan.execute()
    assert a_pack in pack_names(store)
    assert_items_equal(b, store.load("b"))


def test_bad_max_unused_is_refused(mem_store):
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            plan_gc(mem_store, max_unused=bad)


# -- delta bases -------------------------------------------------------------------------------------------------


def base_packs_of(store, bases):
    return {store.index.lookup(c).pack for c in bases}


def _delta_pair(store, rng, junk: bool):
    w = _arr(rng, 8192)
    w2 = _drift(rng, w, 50)  # deltas of a few hundred bytes
    a = {"w": w}
    if junk:
        a["junk"] = _arr(rng, 3 * 8192)
    b = {"w": w2}
    store.save("a", a)
    store.save("b", b)
    deltas = [store.index.lookup(r.id) for r in store.read_manifest("b").item_map()["w"].chunks]
    deltas = [e for e in deltas if codec.is_delta(e.codec)]
    assert deltas, "b must be stored as deltas against a"
    return a, b, deltas


@pytest.mark.parametrize("junk", [False, True], ids=["bases-only", "mixed-with-dead"])
def test_delta_bases_survive_forgetting_their_checkpoint(store, rng, junk):
    a, b, deltas = _delta_pair(store, rng, junk)
    bases = {e.base_id for e in deltas}
    live = live_chunk_ids(store)
    store.forget("a")
    # b's all-live pack of small deltas stays out of the repack (test_gc_leaves_a_fully_live_pack_of_small_chunks_alone)
    plan = plan_gc(store, grace_s=0)
    assert not set(plan.repack) & packs_of_checkpoint(store, "b") - base_packs_of(store, bases)
    base_packs = {store.index.lookup(c).pack for c in bases}
    assert not (base_packs & set(plan.delete_packs))
    if junk:
        assert base_packs <= set(plan.repack)  # moved, not dropped
        assert bases <= {e.chunk_id for es in plan.repack.values() for e in es}
    plan.execute()
    for c in bases:
        assert store.index.lookup(c) is not None
    _check_clean(store, {"b": b})
    # the bases are in the live set even though no manifest references them any more
    live_after = live_chunk_ids(store)
    assert {bytes(x) for x in live_after.view("V16").tolist()} >= bases
    assert live.size >= live_after.size


# -- grace period / in-flight writers ---------------------------------------------------------------------------


def test_uncommitted_writers_packs_survive_gc_with_default_grace(store, rng):
    store.save("old", {"x": _arr(rng, 3000)})
    w = store.writer()
    x = _arr(rng, 5000)
    w.add_array("x", x, dtype=x.dtype.str, elem_size=4, shape=x.shape)
    summary = w.finish()
    assert summary.packs
    # with no grace these packs look like orphans
    assert set(summary.packs) <= set(plan_gc(store, grace_s=0).delete_packs)
    plan = plan_gc(store)  # default grace (an hour)
    assert plan.kept_young >= len(summary.packs)
    assert not set(summary.packs) & set(plan.delete_packs)
    plan.execute()
    assert set(summary.packs) <= pack_names(store)
    store.commit("new", summary.items, entries=summary.entries, packs=summary.packs)
    assert_items_equal({"x": x}, store.load("new"))
    assert verify_store(store, level=2).ok


def test_grace_protects_young_dead_packs(store, rng):
    store.save("a", {"x": _arr(rng, 3000)})
    store.forget("a")
    plan = plan_gc(store, grace_s=3600)
    assert plan.delete_packs == {} and plan.kept_young == len(pack_names(store)) > 0
    assert plan_gc(store, grace_s=0).delete_packs


def test_temp_files_older_than_grace_are_removed(local_store, rng):
    store = local_store
    items = {"x": _arr(rng, 3000)}
    store.save("a", items)
    root = store.backend.local_path()
    (name,) = pack_names(store)
    old = root / "packs" / name[:2] / f"{name}.tmp-deadbeef0001"
    young = root / "manifests" / "a.tmp-deadbeef0002"
    for p in (old, young):
        p.write_bytes(b"half written")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    plan = plan_gc(store, grace_s=3600)
    assert plan.temp_files == [os.path.relpath(old, root)]
    result = plan.execute()
    assert result.removed_temp_files == 1
    assert not old.exists() and young.exists()
    assert store.backend.list_temp() == [(os.path.relpath(young, root), young.stat().st_mtime)]
    assert_items_equal(items, store.load("a"))  # store untouched
    assert verify_store(store, level=2).ok


def test_gc_never_removes_a_lock_being_taken(local_store, rng):
    """A temp file under locks/ may be a save's lock object being written right now: gc leaves it alone until
    a lock that old would be stale anyway, whatever the grace period."""
    store = local_store
    store.save("a", {"x": _arr(rng, 3000)})
    root = store.backend.local_path()
    (root / "locks").mkdir(exist_ok=True)
    taking = root / "locks" / "shared-0123456789abcdef.tmp-deadbeef0003"
    abandoned = root / "locks" / "shared-fedcba9876543210.tmp-deadbeef0004"
    stray = root / "manifests" / "b.tmp-deadbeef0005"
    for p in (taking, abandoned, stray):
        p.write_bytes(b"{}")
    old = time.time() - STALE_AFTER_S - 10
    os.utime(abandoned, (old, old))
    plan = plan_gc(store, grace_s=0)
    assert sorted(plan.temp_files) == sorted(os.path.relpath(p, root) for p in (abandoned, stray))
    assert plan.execute().removed_temp_files == 2
    assert taking.exists() and not abandoned.exists() and not stray.exists()


# -- locks ---------------------------------------------------------------------------------------------------


def test_gc_waits_for_a_running_save_and_gives_up_after_wait_s(store, rng):
    store.save("a", {"x": _arr(rng, 3000)})
    store.forget("a")
    plan = plan_gc(store, grace_s=0)
    before = pack_names(store)
    with store.lock(SHARED) as running:
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match="gave up after waiting"):
            plan.execute(wait_s=0.3)
        assert time.monotonic() - t0 >= 0.3
        assert pack_names(store) == before
        assert [i.key for i in store.backend.list("locks/")] == [running.key]  # gc's pending lock is gone
    running = store.lock(SHARED).acquire()
    threading.Timer(0.4, running.release).start()  # the save ends while gc waits: then gc runs
    t0 = time.monotonic()
    result = plan.execute(wait_s=30)
    assert time.monotonic() - t0 >= 0.35
    assert result.deleted_packs == 1 and pack_names(store) == set()


def test_save_waits_for_gc_then_commits(store, rng, caplog):
    x = {"x": _arr(rng, 3000)}
    gc_lock = store.lock(EXCLUSIVE).acquire()
    threading.Timer(0.5, gc_lock.release).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="deltackpt"):
        store.save("a", x)
    assert time.monotonic() - t0 >= 0.45
    assert any("waiting for gc" in r.getMessage() for r in caplog.records)
    assert_items_equal(x, store.load("a"))
    plan = plan_gc(store, grace_s=0)
    with store.lock(EXCLUSIVE):
        with pytest.raises(StoreLockedError, match="a gc is running; gave up after waiting"):
            store.save("b", x, lock_wait_s=0.2)  # the wait is bounded
        assert not store.exists("b")
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match="another gc is running"):
            plan.execute()  # two gcs never wait for each other
        assert time.monotonic() - t0 < 5
    assert list(store.backend.list("locks/")) == []


def test_save_in_flight_while_gc_waits_commits_and_keeps_its_claims(store, rng):
    """A save running when gc wants the store alone reuses chunks the gc plan meant to delete: it commits,
    gc re-checks its plan and spares them, and a save that starts meanwhile waits for gc, then commits."""
    x, junk, y = {"x": _arr(rng, 3000)}, {"j": _arr(rng, 3000)}, {"y": _arr(rng, 3000)}
    store.save("old", x)
    store.save("junk", junk)
    x_packs, junk_packs = packs_of_checkpoint(store, "old"), packs_of_checkpoint(store, "junk")
    store.forget(["old", "junk"])
    plan = plan_gc(store, grace_s=0)
    assert set(plan.delete_packs) == x_packs | junk_packs and not x_packs & junk_packs
    running = store.lock(SHARED).acquire()
    w = store.writer()
    w.add_array("x", x["x"], dtype=x["x"].dtype.str, elem_size=4, shape=x["x"].shape)
    summary = w.finish()
    assert summary.packs == {}  # every chunk claimed from the forgotten checkpoint
    results, saved = [], []
    gc = threading.Thread(target=lambda: results.append(plan.execute(wait_s=60)))
    gc.start()
    deadline = time.monotonic() + 30
    while not any(lk["kind"] == EXCLUSIVE for lk in list_locks(store.backend)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    later = threading.Thread(target=lambda: saved.append(store.save("later", y)))
    later.start()
    time.sleep(0.3)
    assert not store.exists("later") and gc.is_alive()  # both wait: gc for us, the later save for gc
    store.commit("inflight", summary.items, entries=summary.entries, packs=summary.packs, lock=running)
    running.release()
    gc.join(60)
    later.join(60)
    assert results and saved
    assert results[0].deleted_packs == len(junk_packs)
    assert x_packs <= pack_names(store) and not junk_packs & pack_names(store)
    _check_clean(store, {"inflight": x, "later": y})


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("case", ["dead-pid", "old-time", "garbage"])
def test_stale_locks_are_ignored_and_removed(store, rng, case):
    store.save("a", {"x": _arr(rng, 3000)})
    store.forget("a")
    info = {"kind": "shared", "host": socket.gethostname(), "pid": os.getpid(), "space": lock_mod._process_space(),
            "time": time.time(), "id": "x"}
    if case == "dead-pid":
        info["pid"] = _dead_pid()
    elif case == "old-time":
        info.update(host="some-other-host", time=time.time() - 10_000)
    payload = b"\x00not json" if case == "garbage" else json.dumps(info).encode()
    store.backend.put("locks/shared-stale0001", payload)
    result = plan_gc(store, grace_s=0).execute()
    assert result.deleted_packs == 1
    assert not store.backend.exists("locks/shared-stale0001")
    assert list(store.backend.list("locks/")) == []


def test_a_live_lock_on_another_host_blocks_gc(store):
    info = {"kind": "shared", "host": "some-other-host", "pid": 1, "time": time.time(), "id": "y"}
    store.backend.put("locks/shared-live0001", json.dumps(info).encode())
    with pytest.raises(StoreLockedError, match="some-other-host"):
        plan_gc(store, grace_s=0).execute(wait_s=0.2)
    assert store.backend.exists("locks/shared-live0001")
    assert [i.key for i in store.backend.list("locks/")] == ["locks/shared-live0001"]  # ours backed off


def test_writer_whose_lock_was_removed_refuses_to_commit(store, rng):
    x = _arr(rng, 3000)
    lock = store.lock(SHARED, refresh=False).acquire()
    try:
        w = store.writer()
        w.add_array("x", x, dtype=x.dtype.str, elem_size=4, shape=x.shape)
        summary = w.finish()
        store.backend.delete(lock.key)  # e.g. another host's gc judged it stale
        with pytest.raises(StoreLockedError):
            lock.check()
        with pytest.raises(StoreLockedError):
            store.commit("x", summary.items, entries=summary.entries, packs=summary.packs, lock=lock)
        assert not store.exists("x")
    finally:
        lock.release()
    assert store.checkpoint_names() == []


def test_writer_whose_lock_went_stale_refuses_to_commit(store, rng):
    x = _arr(rng, 3000)
    lock = store.lock(SHARED, stale_after_s=0.05, refresh=False).acquire()
    w = store.writer()
    w.add_array("x", x, dtype=x.dtype.str, elem_size=4, shape=x.shape)
    summary = w.finish()
    time.sleep(0.1)
    with pytest.raises(StoreLockedError):
        store.commit("x", summary.items, entries=summary.entries, packs=summary.packs, lock=lock)
    lock.release()
    assert not store.exists("x")


# -- safety ---------------------------------------------------------------------------------------------------


def test_gc_replans_under_the_lock(store, rng):
    """A plan made before a save reused the 'dead' chunks must not delete them when executed."""
    x = {"x": _arr(rng, 3000)}
    store.save("a", x)
    store.forget("a")
    stale_plan = plan_gc(store, grace_s=0)
    assert stale_plan.delete_packs
    store.save("a2", x)  # deduplicated against the forgotten checkpoint's chunks: no new pack
    stale_plan.execute()
    _check_clean(store, {"a2": x})


def _dead_deltas_beside_live_chunks(store, rng):
    """a = {w}; b = {w2 as deltas against a's keyframes, k} in one pack; c = {k}. Forgetting a and b leaves
    b's pack holding dead deltas whose bases (a's pack) are dead too."""
    w = _arr(rng, 8192)
    w2 = _drift(rng, w, 50)
    k = _arr(rng, 2048)
    store.save("a", {"w": w})
    a_packs = packs_of_checkpoint(store, "a")
    store.save("b", {"w": w2, "k": k})
    deltas = [store.index.lookup(r.id) for r in store.read_manifest("b").item_map()["w"].chunks]
    assert all(codec.is_delta(e.codec) for e in deltas)
    (b_pack,) = packs_of_checkpoint(store, "b") - a_packs
    store.save("c", {"k": k})
    store.forget(["a", "b"])
    return w2, k, deltas, a_packs, b_pack


def test_gc_never_keeps_a_delta_whose_base_it_deletes(store, rng):
    w2, k, deltas, a_packs, b_pack = _dead_deltas_beside_live_chunks(store, rng)
    plan = plan_gc(store, grace_s=0, max_unused=1.0)  # b's pack is mostly live: it would be kept as it is
    assert set(plan.delete_packs) == a_packs and list(plan.repack) == [b_pack]
    plan.execute()
    assert all(store.index.lookup(e.chunk_id) is None for e in deltas)
    store.save("d", {"w": w2})
    _check_clean(store, {"c": {"k": k}, "d": {"w": w2}})


def test_save_never_reuses_a_delta_whose_base_is_gone(store, rng):
    """However a delta lost its base (an older gc, a lost pack), a save of the same bytes does not
    deduplicate against it (it could not be restored): it writes the chunk again and commits."""
    w2, k, deltas, a_packs, b_pack = _dead_deltas_beside_live_chunks(store, rng)
    for name in a_packs:
        store.backend.delete(pack_key(name))
    store.index.remove_packs(a_packs)
    store.save("d", {"w": w2})
    assert_items_equal({"w": w2}, store.load("d"))
    plan_gc(store, grace_s=0).execute()  # the unrestorable copies in b's pack are garbage
    _check_clean(store, {"c": {"k": k}, "d": {"w": w2}})


def test_gc_refuses_when_a_manifest_is_unreadable(store, rng):
    store.save("a", {"x": _arr(rng, 3000)})
    store.save("b", {"y": _arr(rng, 3000)})
    mutate_object(store.backend, manifest_key("b"), lambda d: d[:-1] + bytes([d[-1] ^ 1]))
    before = pack_names(store)
    with pytest.raises(DeltackptError):
        plan_gc(store, grace_s=0).execute()
    assert pack_names(store) == before  # b's chunks are not treated as garbage


def test_live_chunk_ids_is_a_sorted_unique_16_byte_array(store, rng, make_store):
    w = _arr(rng, 8192)
    store.save("a", {"w": w, "again": w})  # every chunk referenced twice
    w2 = _drift(rng, w, 700)
    store.save("b", {"w": w2})
    live = live_chunk_ids(store)
    assert isinstance(live, np.ndarray) and live.dtype.itemsize == 16 and live.ndim == 1
    raw = [live[i:i + 1].tobytes() for i in range(live.size)]
    assert raw == sorted(set(raw))
    refs = {r.id for n in ("a", "b") for it in store.read_manifest(n).items for r in it.chunks}
    bases = {store.index.lookup(c).base_id for c in refs} - {None}
    assert set(raw) == refs | bases
    empty = live_chunk_ids(make_store("memory", "empty"))
    assert empty.dtype.itemsize == 16 and empty.size == 0


def _chunk_ending_in_nul(rng) -> np.ndarray:
    while True:
        x = rng.integers(0, 256, 4096, dtype=np.uint8)
        if xxhash.xxh3_128_digest(x.tobytes())[-1] == 0:
            return x


def test_gc_keeps_a_live_chunk_whose_id_ends_in_nul(store, rng):
    x = _chunk_ending_in_nul(rng)
    store.save("a", {"x": x})
    plan = plan_gc(store, grace_s=0)
    assert plan.delete_packs == {} and plan.repack == {}
    plan.execute()
    assert_items_equal({"x": x}, store.load("a"))


@pytest.mark.parametrize("kind", ["small-bytes-item", "small-deltas"])
def test_gc_leaves_a_fully_live_pack_of_small_chunks_alone(store, rng, kind):
    w = _arr(rng, 8192)
    if kind == "small-bytes-item":
        saved = {"a": {"w": w, "step": b"step 1"}, "b": {"w": w, "step": b"step 2"}}
    else:
        w2 = w.copy()
        w2[::1000] += 1.0
        saved = {"a": {"w": w}, "b": {"w": w2}}
    for name, items in saved.items():
        store.save(name, items)
    plan = plan_gc(store, grace_s=0)  # nothing was forgotten: nothing is dead
    assert _nothing_planned(plan), plan.as_dict()
    plan.execute()
    _check_clean(store, saved)


def test_gc_never_drops_a_live_chunk_because_of_a_bad_cache_record(local_store, rng):
    store = local_store
    items = {"x": _arr(rng, 3000)}
    store.save("a", items)
    ref = store.read_manifest("a").items[0].chunks[0]
    e = store.index.lookup(ref.id)
    store.index.relocate([dataclasses.replace(e, pack="00" * 16)], {})
    plan_gc(store, grace_s=0).execute()
    store.rebuild_index()
    assert_items_equal(items, store.load("a"))


# -- cost: one plan, packs merged, linear passes ------------------------------------------------------------------


def test_execute_reuses_the_plan_when_nothing_changed(store, rng, monkeypatch):
    store.save("a", {"x": _arr(rng, 3000)})
    store.save("b", {"y": _arr(rng, 3000)})
    store.forget("a")
    plan = plan_gc(store, grace_s=0)
    reads = []
    real = type(store).read_manifest
    monkeypatch.setattr(type(store), "read_manifest", lambda self, name: reads.append(name) or real(self, name))
    assert plan.revalidate() is plan  # nothing committed, published or collected since the mark
    result = plan.execute()
    assert reads == [] and result.deleted_packs == len(plan.delete_packs) > 0


def test_execute_rechecks_the_plan_when_a_checkpoint_was_committed(store, rng):
    x = _arr(rng, 3000)
    store.save("a", {"x": x})
    store.forget("a")
    plan = plan_gc(store, grace_s=0)
    assert plan.delete_packs
    store.save("c", {"x": x})  # deduplicates against the chunks the plan meant to delete
    again = plan.revalidate()
    assert again is not plan and not again.delete_packs
    plan.execute()
    _check_clean(store, {"c": {"x": x}})


def test_repacks_merge_into_packs_of_the_target_size(make_store, rng):
    """Many small mixed packs (one per save) are rewritten into few packs, not one new pack each."""
    store = make_store("memory", pack_target_bytes=1 << 20)
    kept = {}
    for i in range(12):
        kept[f"k{i}"] = {"k": _arr(rng, 1024)}
        store.save(f"s{i}", {"k": kept[f"k{i}"]["k"], "dead": _arr(rng, 4096)})
    for i in range(12):
        store.save(f"k{i}", kept[f"k{i}"])  # the same bytes: deduplicated, so the live chunks stay in s{i}'s pack
        store.forget(f"s{i}")
    before = pack_names(store)
    plan = plan_gc(store, grace_s=0)
    assert len(plan.repack) == 12
    plan.execute()
    assert len(pack_names(store) - before) == 1  # 12 packs' live chunks fit one pack of the target size
    _check_clean(store, kept)


def test_forget_of_many_checkpoints_is_one_index_transaction(local_store, rng):
    from deltackpt.store.retention import plan_forget
    x = _arr(rng, 2000)
    for i in range(6):
        local_store.save(f"c{i}", {"x": x})
    local_store.list_checkpoints()  # caches the summaries forget drops
    plan = plan_forget(local_store, keep_last=1)
    writes = _count_index_writes(local_store, plan.execute)
    assert writes == 1 and local_store.checkpoint_names() == ["c5"]
    assert set(local_store.index.get_summaries()) == {"c5"}


def _count_index_writes(store, fn) -> int:
    return count_index_writes(store.index, fn)


class _CoarseClock(MemoryBackend):
    """Listings as S3's, and coarser: every object written at the same second, told apart by its ETag."""

    def list(self, prefix=""):
        return iter([dataclasses.replace(i, mtime_s=0.0, version=repr(i.mtime_s)) for i in super().list(prefix)])


def test_a_manifest_written_again_between_plan_and_execute_keeps_its_chunks(tmp_path, rng):
    store = Store.init(_CoarseClock(), cache_dir=tmp_path / "cache", **SMALL)
    x, y = random_array(rng, "float32", (3000,)), random_array(rng, "float32", (3000,))
    store.save("b", {"w": y})
    store.save("a", {"w": x})
    store.forget("a")  # x's chunks are dead
    plan = plan_gc(store, grace_s=0)
    assert plan.delete_packs
    store.save("b", {"w": x}, overwrite=True)  # same size, same mtime: x's chunks are b's now
    plan.execute()
    assert_items_equal({"w": x}, store.load("b"))


def test_other_files_under_manifests_are_no_checkpoints(make_store, rng):
    # A Finder or editor file there stopped gc ("invalid checkpoint name") and verify called it damaged.
    store = make_store("local")
    items = {"w": random_array(rng, "float32", (3000,))}
    store.save("c", items)
    for stray in ("manifests/.DS_Store", "manifests/c~", "manifests/latest"):
        store.backend.put(stray, b"not a manifest")
    assert store.checkpoint_names() == ["c"]
    assert [i.name for i in store.list_checkpoints(include_damaged=True)] == ["c"]
    plan_gc(store, grace_s=0).execute()
    assert verify_store(store, level=2).ok
    assert_items_equal(items, store.load("c"))


def test_gc_on_another_host_keeps_the_good_copy_of_a_chunk_written_again_after_damage(tmp_path):
    """Host A found a chunk damaged (verify marks its pack in A's cache only) and its next save wrote the chunk
    again. Host B's gc saw two copies and kept the one its index located, the damaged one, deleting the good
    one: no host could load the checkpoint any more. A located copy is now decoded and hashed before the
    other copies of its chunk go."""
    from deltackpt.store.pack import read_pack_table
    from deltackpt.testing import SMALL_CONFIG

    root = tmp_path / "store"
    Store.init(root, **SMALL_CONFIG)
    a, b = (Store.open(root, cache_dir=tmp_path / f"cache-{h}") for h in "ab")
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32)  # 4 chunks
    a.save("c0", {"x": x})
    b.load("c0")  # B's cache locates x's chunks in the first pack
    [info] = list(a.backend.list("packs/"))
    table = read_pack_table(a.backend, info.key.split("/")[-1], info.size_bytes)
    path = root / info.key
    data = bytearray(path.read_bytes())
    data[int(table.offsets[0]) + 64 + 10] ^= 0x01  # a payload byte, past the header
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    assert not verify_store(a, level=2).ok  # A marks the pack damaged
    a.save("c1", {"x": x, "y": np.arange(3000, dtype=np.int64)})  # x's chunks written again: good copies
    plan_gc(b, grace_s=0).execute()
    for host in (a, b, Store.open(root, cache_dir=tmp_path / "cache-c")):
        assert np.array_equal(host.load("c1")["x"], x)


def test_gc_stops_deleting_once_its_lock_went_stale(tmp_path, monkeypatch):
    """gc's refreshes failing (EIO, a full disk) past the stale limit let a save take the store, deduplicate
    against a pack gc was about to delete and commit; gc then deleted it. gc now looks at its lock between
    deletes and stops with StoreLockedError. (Stale limit 1 s here; 300 s by default.)"""
    from deltackpt.store.localbackend import LocalBackend

    monkeypatch.setitem(lock_mod.StoreLock.__init__.__kwdefaults__, "stale_after_s", 1.0)
    root = tmp_path / "s"
    store = Store.init(root, chunk_size_bytes=64 * 1024, pack_target_bytes=256 * 1024)
    rng = np.random.default_rng(0)
    xs = {f"x{i}": rng.standard_normal(16 * 1024).astype(np.float32) for i in range(12)}
    for i, (k, v) in enumerate(xs.items()):
        store.save(f"a{i}", {k: v})  # a pack each
    store.save("b", {"y": np.zeros(10, np.float32)})
    store.forget([f"a{i}" for i in range(12)])
    plan = plan_gc(store, grace_s=0)
    assert len(plan.delete_packs) == 12
    real_put, real_delete = LocalBackend.put_transient, LocalBackend.delete
    deleting = threading.Event()

    def put_transient(self, key, data):
        if threading.current_thread().name == "deltackpt-lock" and key.startswith("locks/exclusive"):
            raise OSError(5, "Input/output error")
        return real_put(self, key, data)

    def delete(self, key):
        if key.startswith("packs/") and threading.current_thread().name == "gc":
            deleting.set()
            time.sleep(0.3)
        return real_delete(self, key)

    monkeypatch.setattr(LocalBackend, "put_transient", put_transient)
    monkeypatch.setattr(LocalBackend, "delete", delete)
    errors = []
    gc_thread = threading.Thread(target=lambda: _run_catching(plan.execute, errors), name="gc")
    gc_thread.start()
    assert deleting.wait(10)
    time.sleep(1.1)  # gc's lock object, never refreshed, is stale now
    Store.open(root, cache_dir=tmp_path / "other-cache").save("c", xs)  # another process
    gc_thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], StoreLockedError)
    assert_items_equal(Store.open(root, cache_dir=tmp_path / "check-cache").load("c"), xs)


def _run_catching(fn, errors):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        errors.append(e)

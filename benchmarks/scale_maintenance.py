"""How the store-maintenance operations (gc, forget, verify) scale: time and memory as a store grows.

Engine API only (no torch), 8 KiB chunks so that many chunks fit in little memory. Two scenarios:

- ``gc``: one checkpoint of N chunks, a second with 1 % of them changed, ``forget --keep-last 1``, then gc
  (plan, and execute under the exclusive lock); verify level 0 of the same store for comparison.
- ``history``: H checkpoints of R chunks, 1 % changed per save; verify level 0 (time, and peak traced memory
  per unique chunk), verify level 1 (time, LMDB commits it caused, cache size, cached ``ls`` summaries kept),
  ``forget --keep-last 1`` (time), then gc (time, packs deleted / repacked of all).

    PYTHONPATH=$PWD python benchmarks/scale_maintenance.py --chunks 10000 40000 160000 --history 200 --refs 4096
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from deltackpt.store import LocalBackend, Store
from deltackpt.store.gc import plan_gc
from deltackpt.store.retention import plan_forget
from deltackpt.store.verify import verify_store

CHUNK = 8192
ROW = CHUNK // 8  # uint64 elements per chunk


def _state(n_chunks: int, rng) -> np.ndarray:
    """N distinct chunks of random bytes (incompressible, so packs reach their target size as in training)."""
    return rng.integers(0, 2**63, size=(n_chunks, ROW), dtype=np.uint64)


def _change(arr: np.ndarray, rng, fraction: float, step: int) -> None:
    rows = rng.choice(arr.shape[0], max(1, int(arr.shape[0] * fraction)), replace=False)
    arr[rows, 1 + step % (ROW - 1)] += np.uint64(step + 1)


def _open(root: Path) -> Store:
    return Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=CHUNK)


def _cache_bytes(store: Store) -> int:
    return sum(p.stat().st_size for p in Path(store.cache_dir).rglob("*") if p.is_file())


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _traced_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _count_commits(store: Store, fn):
    """Run ``fn`` counting the LMDB write transactions the index opens meanwhile."""
    env = store.index.env
    count = [0]
    real = type(env).begin

    class Counting:
        def __getattr__(self, name):
            return getattr(env, name)

        def begin(self, *args, **kwargs):
            if kwargs.get("write"):
                count[0] += 1
            return real(env, *args, **kwargs)

    index = store.index
    index._env = Counting()
    try:
        out = fn()
    finally:
        index._env = env
    return out, count[0]


def bench_gc(root: Path, n_chunks: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    store = _open(root)
    arr = _state(n_chunks, rng)
    store.save("c0", {"w": arr})
    _change(arr, rng, 0.01, 1)
    store.save("c1", {"w": arr})
    del arr
    plan_forget(store, keep_last=1).execute()
    fresh = Store.open(LocalBackend(root, fsync=False))
    plan, plan_s = _timed(lambda: plan_gc(fresh, grace_s=0))
    result, exec_s = _timed(lambda: plan.execute())
    _, v0_s = _timed(lambda: verify_store(fresh, level=0))
    return {"chunks": n_chunks, "gc_plan_s": round(plan_s, 3), "gc_execute_s": round(exec_s, 3),
            "gc_total_s": round(plan_s + exec_s, 3), "verify0_s": round(v0_s, 3),
            "deleted_packs": result.deleted_packs, "repacked_packs": result.repacked_packs}


def bench_history(root: Path, history: int, refs: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    store = _open(root)
    arr = _state(refs, rng)
    for step in range(history):
        if step:
            _change(arr, rng, 0.01, step)
        store.save(f"c{step:05d}", {"w": arr})
    del arr
    store.list_checkpoints()  # caches the summaries ``ls`` shows
    summaries = len(store.index.get_summaries())
    unique = store.index.num_chunks()
    total_refs = history * refs
    peak = _traced_peak(lambda: verify_store(store, level=0))
    _, v0_s = _timed(lambda: verify_store(store, level=0))
    cache_before = _cache_bytes(store)
    (_, v1_s), v1_commits = _count_commits(store, lambda: _timed(lambda: verify_store(store, level=1)))
    cache_after = _cache_bytes(store)
    kept = len(store.index.get_summaries())
    plan = plan_forget(store, keep_last=1)
    (_, forget_s), forget_commits = _count_commits(store, lambda: _timed(plan.execute))
    packs = len(list(store.backend.list("packs/")))
    gplan, gplan_s = _timed(lambda: plan_gc(store, grace_s=0))
    result, gexec_s = _timed(lambda: gplan.execute())
    return {"checkpoints": history, "refs_per_checkpoint": refs, "unique_chunks": unique,
            "verify0_s": round(v0_s, 3), "verify0_peak_MiB": round(peak / 2**20, 2),
            "verify0_bytes_per_unique_chunk": round(peak / unique, 1),
            "verify0_bytes_per_ref": round(peak / total_refs, 1),
            "verify1_s": round(v1_s, 3), "verify1_lmdb_commits": v1_commits,
            "cache_MiB_before_verify1": round(cache_before / 2**20, 2),
            "cache_MiB_after_verify1": round(cache_after / 2**20, 2),
            "summaries_before_verify1": summaries, "summaries_after_verify1": kept,
            "forget_s": round(forget_s, 3), "forget_lmdb_commits": forget_commits,
            "gc_s": round(gplan_s + gexec_s, 3), "packs": packs,
            "gc_deleted_packs": result.deleted_packs, "gc_repacked_packs": result.repacked_packs,
            "packs_after_gc": len(list(store.backend.list("packs/")))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, nargs="*", default=[10_000, 40_000, 160_000])
    p.add_argument("--history", type=int, default=200)
    p.add_argument("--refs", type=int, default=4096)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = p.parse_args(argv)
    base = Path(args.dir or tempfile.mkdtemp(prefix="dc-scale-"))
    try:
        for n in args.chunks:
            print(json.dumps(bench_gc(base / f"gc-{n}", n)), flush=True)
        if args.history:
            print(json.dumps(bench_history(base / "history", args.history, args.refs)), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

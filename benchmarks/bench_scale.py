"""How deltackpt's costs grow with the size of the job (issue 19): chunks per checkpoint, history, ranks, items.

Five sweeps, each on fresh stores in a temp directory, synthetic numpy data (float32 noise, so chunks are
coded as real state is), 8 KiB chunks to reach many chunks in little memory:

  chunks   one checkpoint of N chunks (64 items), then one with 1 % of its chunks changed:
           save, save 1 %, load (into arrays allocated before, as DCP loads), load of the same bytes from
           4 MiB chunks, verify --level 0 and 1 (engine),
           and through the CLI (a process each): verify --level 0, forget --keep-last 1, gc
  million  as chunks up to 1.2M chunks of 4 KiB (the smallest chunk a store takes), engine only and without
           the loads: save, save 1 %, verify --level 0 and 1, forget --keep-last 1, gc
  history  H checkpoints of ``--refs`` chunks, 1 % changed each: the last save, ls, verify --level 0 and 1,
           then on a copy of the store forget --keep-last 1 and gc (engine)
  ranks    a DCP save of a fixed state (``--state-mib``, 64 MiB) row-sharded over R simulated ranks in one
           process: per rank the real DeltaStorageWriter path (set_up_storage_writer, prepare_local_plan,
           write_data) with its own planner, the coordinator's prepare_global_plan and finish; first save
           and a save with 1 % of the rows changed, each phase summed over ranks
  items    N items of 4 KiB: save, save 1 % (1 % of the items changed), load (into arrays allocated
           before), verify --level 0

For every operation: its time (median of ``--repeat`` runs; the chunks and items saves each into a new store,
the million and history saves once) and peak memory above the process's
baseline (VmHWM; for a CLI command the child's own peak), and the fitted exponent of time against the
sweep's size: the log-log slope over all points and that of the last doubling. Then the issue's targets,
PASS or FAIL each. ``--write-docs`` puts the tables into docs/performance.md (between markers; replaced on
the next run). The store parts never import torch; the ranks sweep does (skipped if torch is missing).

Usage:
  python benchmarks/bench_scale.py --quick                    # small sizes, < 60 s
  python benchmarks/bench_scale.py --size full --write-docs   # 10k-160k (1.2M) chunks, 10-1000 ckpts, 8-1024 ranks
  python benchmarks/bench_scale.py --quick --sweeps chunks --chunks 1000,2000,4000 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import trim_heap  # noqa: E402

from deltackpt.bench.measure import PeakRSS, run_child  # noqa: E402
from deltackpt.store import Store, plan_forget, verify_store  # noqa: E402
from deltackpt.store.gc import plan_gc  # noqa: E402

MiB = 1 << 20
CHUNK = 8 * 1024
MIN_CHUNK = 4 * 1024  # the smallest chunk size a store takes: the million sweep's
SWEEPS = ("chunks", "million", "history", "ranks", "items")
SIZES = {
    "quick": dict(chunks=[2_000, 4_000, 8_000], million=[8_000, 32_000], history=[4, 8, 16], refs=256,
                  ranks=[4, 8, 16], state_mib=8,
                  items=[250, 500, 1_000], repeat=1),
    "full": dict(chunks=[10_000, 20_000, 40_000, 80_000, 160_000], million=[75_000, 300_000, 1_200_000],
                 history=[10, 30, 100, 300, 1_000], refs=4_096,
                 ranks=[8, 16, 64, 256, 1_024], state_mib=64, items=[1_000, 4_000, 16_000, 64_000, 100_000],
                 repeat=3),
}
# Issue 19's targets: fitted exponents of time, and ratios at the largest sizes.
MAX_EXPONENT, MAX_LAST_DOUBLING = 1.1, 1.15
SAVE_1PCT_RATIO = 0.1  # a 1 % changed save vs the first save, at the most chunks
RANK_COST_RATIO = 1.2  # per-rank save cost at the most ranks vs at 64 (or the fewest above it)
VERIFY0_BYTES_PER_CHUNK = 40
LOAD_RATIO = 2.0  # a load of 8 KiB chunks vs the same bytes in 4 MiB chunks
MIN_FIT_S = 0.02  # an operation faster than this at every size has no exponent target (n/a)
# Baselines and the phases of a total: reported with their exponents, not held to the target.
NOT_FITTED = {"load 4 MiB chunks"} | {f"dcp save{s} {p}" for s in ("", " 1%")
                                      for p in ("plan", "write", "global plan", "commit")}
DOCS_BEGIN, DOCS_END = "<!-- bench_scale:begin -->", "<!-- bench_scale:end -->"


# -- measuring --------------------------------------------------------------------------------------------------
def measure(fn, repeat: int = 1, heap: bool = False) -> dict:
    """{"time_s": median wall time, "mem_bytes": peak RSS above the baseline} of ``fn()`` run ``repeat``
    times; with ``heap``, also "heap_bytes": the peak of what one more run allocates (tracemalloc: Python
    objects and numpy arrays), exact where RSS moves by a MiB with what the process did before and counts the
    index pages LMDB maps as they are first read."""
    times, peak = [], 0
    for _ in range(max(1, repeat)):
        gc.collect()
        trim_heap()  # freed memory left resident would hide this run's allocations from its peak
        os.sync()  # an earlier save's gigabytes written back during this run would be timed with it
        with PeakRSS() as m:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        peak = max(peak, m.overhead)
    out = {"time_s": statistics.median(times), "mem_bytes": peak}
    if heap:
        gc.collect()
        tracemalloc.start()
        try:
            fn()
            out["heap_bytes"] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    return out


def measure_saves(root: Path, name: str, first: dict, second: dict, repeat: int, **config) -> tuple:
    """(first save, save of ``second`` after it, the store, its path): each save the median of ``repeat``
    runs, every run into a store made anew (a save changes its store, so none is timed twice in one; single
    saves moved the last doublings by up to 0.4 between runs). The last run's store is left for the reads."""
    runs = []
    for _ in range(max(1, repeat)):
        store, path = new_store(root, name, **config)
        runs.append((measure(lambda: store.save("c0", first)), measure(lambda: store.save("c1", second))))
    rows = tuple({"time_s": statistics.median(r[k]["time_s"] for r in runs),
                  "mem_bytes": max(r[k]["mem_bytes"] for r in runs)} for k in (0, 1))
    return (*rows, store, path)


def measure_successive_saves(store: Store, state: dict, repeat: int, after_first=None) -> dict:
    """Median of ``repeat`` saves into one store: ``state``, then each time ``state`` with another 1 % of its
    chunks changed, so each is a 1 % save against the one before (a store made anew per run, as
    :func:`measure_saves` does, would save the million sweep's gigabytes again each time; one save moved the
    last doubling between 0.92 and 1.30). ``after_first()`` runs after the first save (untimed): a snapshot
    of the store as one 1 % save left it, for the operations measured next."""
    runs = []
    for k in range(max(1, repeat)):
        if k:
            state = change_chunks(state, 0.01, MIN_CHUNK, first=k, inplace=True)
        runs.append(measure(lambda: store.save(f"c{k + 1}", state)))
        if k == 0 and after_first is not None:
            after_first()
    return {"time_s": statistics.median(r["time_s"] for r in runs), "mem_bytes": max(r["mem_bytes"] for r in runs)}


def load_into(path: Path, dest: dict[str, np.ndarray]) -> None:
    """Checkpoint c1 read into ``dest``'s arrays, allocated (and their pages touched) before, as DCP loads into
    the state dict's tensors: a load into new arrays also timed how the machine hands out fresh memory (on
    this VM 1-30 GB/s, depending on whether the host still backs the pages: 1.25 GiB took 0.05-1.3 s)."""
    with Store.open(path).open_checkpoint("c1") as reader:
        reader.read_many_into(dest)


def link_copy(src: Path, dst: Path) -> None:
    """A copy of store ``src`` at ``dst`` whose packs are hard links (packs are never written in place: gc and
    repack write new ones and delete old ones), so a run that changes the store costs a copy of its metadata
    only (1.2M chunks: 4.4 GB of packs)."""
    def copy(s: str, d: str) -> None:
        if Path(s).parent.name == "packs" or Path(s).parent.parent.name == "packs":
            os.link(s, d)
        else:
            shutil.copy2(s, d)
    shutil.copytree(src, dst, copy_function=copy)


def measure_on_copies(path: Path, fn, repeat: int) -> dict:
    """:func:`measure` of ``fn(copy)`` for an operation that changes the store (gc): each of ``repeat`` runs
    on a copy of its own (:func:`link_copy`), the median taken; one run moved the last doubling by 0.4."""
    runs = []
    for _ in range(max(1, repeat)):
        copy = path.with_name(path.name + "-run")
        shutil.rmtree(copy, ignore_errors=True)  # left by a run that was killed
        link_copy(path, copy)
        try:
            runs.append(measure(lambda: fn(copy)))
        finally:
            shutil.rmtree(copy)
    return {"time_s": statistics.median(r["time_s"] for r in runs), "mem_bytes": max(r["mem_bytes"] for r in runs)}


def run_cli(*args: str) -> dict:
    """A ``deltackpt`` command in its own process: wall time and the child's peak RSS."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    _out, peak = run_child([sys.executable, "-m", "deltackpt", *args], env=env)
    return {"time_s": time.perf_counter() - t0, "mem_bytes": peak, "cli": True}


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(log-log slope over all points, slope of the last step) of ``ys`` against ``xs``."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-6)) for y in ys]
    if len(xs) < 2:
        return float("nan"), float("nan")
    slope = float(np.polyfit(lx, ly, 1)[0])
    return slope, (ly[-1] - ly[-2]) / (lx[-1] - lx[-2])


# -- data -------------------------------------------------------------------------------------------------------
def float_state(total_bytes: int, n_items: int, seed: int = 0, chunk: int = CHUNK) -> dict[str, np.ndarray]:
    """``n_items`` float32 arrays of ``total_bytes`` in all, in whole chunks of ``chunk`` bytes."""
    rng = np.random.default_rng(seed)
    per = max(chunk, total_bytes // n_items // chunk * chunk)
    return {f"layer{i:05d}": (rng.standard_normal(per // 4, dtype=np.float32) * 0.02) for i in range(n_items)}


def change_chunks(items: dict[str, np.ndarray], fraction: float, chunk_bytes: int = CHUNK, first: int = 0, *,
                  inplace: bool = False) -> dict:
    """A copy of ``items`` with one element changed in every 1/``fraction``-th chunk (counted over all),
    starting at chunk ``first``; with ``inplace``, ``items`` itself so changed (the million sweep: a second
    4.9 GB copy of the state beside the first pushed the store's packs out of this machine's page cache, and
    the 1 % saves read their delta bases from disk)."""
    out, every, n = {}, max(1, round(1 / fraction)), -first
    per = chunk_bytes // 4
    for key, arr in items.items():
        arr = arr if inplace else arr.copy()
        for start in range(0, arr.size, per):
            if n % every == 0:
                arr[start] += np.float32(1e-3)
            n += 1
        out[key] = arr
    return out


def new_store(root: Path, name: str, **config) -> tuple[Store, Path]:
    path = root / name
    if path.exists():
        shutil.rmtree(path)
    return Store.init(path, **{"chunk_size_bytes": CHUNK, **config}), path


# -- sweeps -----------------------------------------------------------------------------------------------------
def sweep_chunks(root: Path, sizes: list[int], repeat: int, cli: bool, log) -> dict:
    points = []
    for n in sizes:
        log(f"chunks: {n}")
        items = float_state(n * CHUNK, 64)
        changed = change_chunks(items, 0.01)
        row = {}
        row["save"], row["save 1%"], store, path = measure_saves(root, f"chunks-{n}", items, changed, repeat)
        items = None  # the memory back before the loads
        dest = {key: np.ones_like(arr) for key, arr in changed.items()}  # touched once, reused by every load
        row["load"] = measure(lambda: load_into(path, dest), repeat)
        big, big_path = new_store(root, f"chunks-{n}-4mib", chunk_size_bytes=4 * MiB)
        big.save("c1", changed)
        row["load 4 MiB chunks"] = measure(lambda: load_into(big_path, dest), repeat)
        shutil.rmtree(big_path)
        dest = None
        changed = None
        row["verify 0"] = measure(lambda: verify_store(Store.open(path), level=0), repeat, heap=True)
        row["verify 1"] = measure(lambda: verify_store(Store.open(path), level=1), repeat)
        row["unique chunks"] = Store.open(path).index.num_chunks()
        if cli:
            row["cli verify 0"] = run_cli("verify", str(path), "--level", "0")
            row["cli forget --keep-last 1"] = run_cli("forget", str(path), "--keep-last", "1")
            row["cli gc"] = run_cli("gc", str(path), "--grace", "0")
        shutil.rmtree(path)
        points.append((n, row))
    return {"x": "chunks per checkpoint", "points": points}


def sweep_million(root: Path, sizes: list[int], repeat: int, log) -> dict:
    """The chunks sweep's metadata operations up to a million chunks: chunks of 4 KiB (the smallest a store
    takes), no loads (1.2M chunks are 4.9 GB of state, held twice by a load beside its baseline)."""
    points = []
    for n in sizes:
        log(f"million: {n}")
        items = float_state(n * MIN_CHUNK, 64, chunk=MIN_CHUNK)
        store, path = new_store(root, f"million-{n}", chunk_size_bytes=MIN_CHUNK)
        row = {"save": measure(lambda: store.save("c0", items))}
        changed = change_chunks(items, 0.01, MIN_CHUNK, inplace=True)
        items = None
        # verify, forget and gc run on the store as one 1 % save left it: more saves add small packs that gc
        # merges (36k chunks moved at 1.2M chunks after three), which is another operation than before
        after_one = path.with_name(path.name + "-c1")
        shutil.rmtree(after_one, ignore_errors=True)
        row["save 1%"] = measure_successive_saves(store, changed, repeat, lambda: link_copy(path, after_one))
        changed = None
        shutil.rmtree(path)
        path = after_one
        row["verify 0"] = measure(lambda: verify_store(Store.open(path), level=0), repeat, heap=True)
        row["verify 1"] = measure(lambda: verify_store(Store.open(path), level=1), repeat)
        row["unique chunks"] = Store.open(path).index.num_chunks()
        row["forget --keep-last 1"] = measure(lambda: plan_forget(Store.open(path), keep_last=1).execute())
        row["gc"] = measure_on_copies(path, lambda p: plan_gc(Store.open(p), grace_s=0).execute(), repeat)
        shutil.rmtree(path)
        points.append((n, row))
    return {"x": "chunks per checkpoint (4 KiB)", "points": points}


def sweep_history(root: Path, sizes: list[int], refs: int, repeat: int, log) -> dict:
    points = []
    store, path = new_store(root, "history")
    state = float_state(refs * CHUNK, 16)
    made = 0
    for h in sizes:
        log(f"history: {h}")
        last = None
        while made < h:
            state = change_chunks(state, 0.01)
            last = measure(lambda: store.save(f"c{made:05d}", state))
            made += 1
        row = {"save 1%": last}
        row["ls"] = measure(lambda: len(Store.open(path).list_checkpoints()), repeat)
        row["verify 0"] = measure(lambda: verify_store(Store.open(path), level=0), repeat, heap=True)
        row["verify 1"] = measure(lambda: verify_store(Store.open(path), level=1), repeat)
        row["unique chunks"] = store.index.num_chunks()
        copy = root / "history-copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(path, copy)
        other = Store.open(copy)  # with a copy of the index cache, valid for the copy (the same store id)
        other.index.num_chunks()
        row["forget --keep-last 1"] = measure(lambda: plan_forget(other, keep_last=1).execute())
        row["gc"] = measure(lambda: plan_gc(other, grace_s=0).execute())
        shutil.rmtree(copy)
        points.append((h, row))
    shutil.rmtree(path)
    return {"x": "checkpoints in history", "points": points}


def sweep_items(root: Path, sizes: list[int], repeat: int, log) -> dict:
    points = []
    for n in sizes:
        log(f"items: {n}")
        rows = np.random.default_rng(2).standard_normal((n, 1024), dtype=np.float32) * 0.02
        items = {f"param{i:06d}": row for i, row in enumerate(rows)}  # 4 KiB each, a chunk each
        changed = dict(items)
        for k in list(items)[::100]:
            changed[k] = items[k] + np.float32(1e-3)
        row = {}
        row["save"], row["save 1%"], store, path = measure_saves(root, f"items-{n}", items, changed, repeat)
        dest = {key: np.ones_like(arr) for key, arr in changed.items()}
        row["load"] = measure(lambda: load_into(path, dest), repeat)
        dest = None
        row["verify 0"] = measure(lambda: verify_store(Store.open(path), level=0), repeat, heap=True)
        shutil.rmtree(path)
        points.append((n, row))
    return {"x": "items per checkpoint", "points": points}


def sweep_ranks(root: Path, sizes: list[int], state_mib: int, log) -> dict:
    from _simranks import simulated_dcp_save  # torch: imported only for this sweep

    points = []
    rows_total = 1024
    cols = state_mib * MiB // 16 // rows_total // 4  # 16 float32 tensors of rows_total x cols
    rng = np.random.default_rng(1)
    state = {f"layers.{i}.weight": (rng.standard_normal((rows_total, cols), dtype=np.float32) * 0.02)
             for i in range(16)}
    changed = {k: v.copy() for k, v in state.items()}
    for v in changed.values():
        v[::100, 0] += np.float32(1e-3)  # 1 % of the rows
    for r in sizes:
        log(f"ranks: {r}")
        if rows_total % r:
            raise ValueError(f"ranks must divide {rows_total}, got {r}")
        path = root / f"ranks-{r}"
        shutil.rmtree(path, ignore_errors=True)
        Store.init(path, chunk_size_bytes=4 * MiB)
        first = simulated_dcp_save(path, "c0", state, r)
        second = simulated_dcp_save(path, "c1", changed, r)
        row = {f"dcp save {k}": v for k, v in first.items()}
        row.update({f"dcp save 1% {k}": v for k, v in second.items()})
        shutil.rmtree(path)
        points.append((r, row))
    return {"x": "simulated ranks", "points": points}


# -- report -----------------------------------------------------------------------------------------------------
def ops_of(sweep: dict) -> list[str]:
    ops: list[str] = []
    for _x, row in sweep["points"]:
        ops += [k for k, v in row.items() if isinstance(v, dict) and k not in ops]
    return ops


def summarize(results: dict) -> dict:
    """Per sweep and operation: times, memory, fitted exponents."""
    out = {}
    for name, sweep in results.items():
        xs = [x for x, _row in sweep["points"]]
        ops = {}
        for op in ops_of(sweep):
            pts = [(x, row[op]) for x, row in sweep["points"] if op in row]
            t = [p["time_s"] for _x, p in pts]
            slope, last = fit([x for x, _p in pts], t)
            ops[op] = {"time_s": t, "mem_bytes": [p.get("mem_bytes") for _x, p in pts],
                       "heap_bytes": [p.get("heap_bytes") for _x, p in pts], "exponent": slope,
                       "last_doubling": last, "cli": any(p.get("cli") for _x, p in pts)}
        out[name] = {"x": sweep["x"], "sizes": xs, "ops": ops,
                     "unique_chunks": [row.get("unique chunks") for _x, row in sweep["points"]]}
    return out


def check_targets(summary: dict) -> list[tuple[str, bool | None, str]]:
    """(target, passed (None: too fast at these sizes to fit), the numbers). The exponent targets cover
    each sweep's operations but the baselines and the phases that make up a total (NOT_FITTED)."""
    checks = []
    for name, s in summary.items():
        if len(s["sizes"]) < 2:
            continue
        for op, o in s["ops"].items():
            if op in NOT_FITTED:
                continue
            ok = o["exponent"] <= MAX_EXPONENT and o["last_doubling"] <= MAX_LAST_DOUBLING
            if max(o["time_s"]) < MIN_FIT_S:
                ok = None  # milliseconds: the constant overheads and the noise decide the slope
            checks.append((f"{name}: {op}, exponent <= {MAX_EXPONENT} (last doubling <= {MAX_LAST_DOUBLING})",
                           ok, f"{o['exponent']:.2f} (last {o['last_doubling']:.2f})"))
    c = summary.get("chunks")
    if c:
        ops, n = c["ops"], c["sizes"][-1]
        first, inc = ops["save"]["time_s"][-1], ops["save 1%"]["time_s"][-1]
        checks.append((f"save 1% <= {SAVE_1PCT_RATIO}x first save at {n} chunks", inc <= SAVE_1PCT_RATIO * first,
                       f"{inc:.3f} s vs {first:.3f} s = {inc / first:.2f}x"))
        small, big = ops["load"]["time_s"][-1], ops["load 4 MiB chunks"]["time_s"][-1]
        checks.append((f"load of {n} 8 KiB chunks <= {LOAD_RATIO}x the same bytes in 4 MiB chunks",
                       small <= LOAD_RATIO * big, f"{small:.3f} s vs {big:.3f} s = {small / big:.2f}x"))
        if "cli gc" in ops:
            gc_s, v0 = ops["cli gc"]["time_s"][-1], ops["cli verify 0"]["time_s"][-1]
            checks.append((f"gc <= verify --level 0 at {n} chunks (CLI)", gc_s <= v0,
                           f"{gc_s:.3f} s vs {v0:.3f} s"))
    for name in ("history", "chunks", "million"):
        s = summary.get(name)
        if s and s["unique_chunks"][-1]:
            # What verify allocates (tracemalloc): RSS, given beside it, moves by a MiB with what the process
            # did before, and counts the index pages LMDB maps as verify first reads them (page cache).
            v0, unique = s["ops"]["verify 0"], s["unique_chunks"][-1]
            mem, rss = v0["heap_bytes"][-1], v0["mem_bytes"][-1]
            checks.append((f"{name}: verify --level 0 <= {VERIFY0_BYTES_PER_CHUNK} B of memory per unique chunk "
                           "(allocated)", mem / unique <= VERIFY0_BYTES_PER_CHUNK,
                           f"{mem / MiB:.1f} MiB for {unique} chunks = {mem / unique:.0f} B (RSS {rss / unique:.0f} B)"))
            # The growth alone (no target): a fixed cost (a zstd context, Python objects) weighs on few chunks.
            mem0, unique0 = v0["heap_bytes"][0], s["unique_chunks"][0]
            if unique0 and unique > unique0:
                checks.append((f"{name}: verify --level 0 memory per added unique chunk (first to last size)", None,
                               f"{(mem - mem0) / (unique - unique0):.0f} B"))
    r = summary.get("ranks")
    if r and len(r["sizes"]) >= 2:
        sizes = r["sizes"]
        ref = next((i for i, x in enumerate(sizes) if x >= 64), 0)
        per = [t / x for t, x in zip(r["ops"]["dcp save 1% ranks"]["time_s"], sizes)]
        checks.append((f"per-rank save cost at {sizes[-1]} ranks <= {RANK_COST_RATIO}x at {sizes[ref]}",
                       per[-1] <= RANK_COST_RATIO * per[ref],
                       f"{per[-1] * 1e3:.2f} ms vs {per[ref] * 1e3:.2f} ms = {per[-1] / per[ref]:.2f}x"))
    return checks


def fmt_s(t: float) -> str:
    return f"{t:.3f}" if t < 10 else f"{t:.1f}"


def render(summary: dict, checks: list, args_line: str) -> str:
    """Markdown: a table per sweep (time in s / peak MiB per size, exponents), then the targets."""
    lines = []
    for name, s in summary.items():
        sizes = s["sizes"]
        lines += [f"### {name}: {s['x']}", "",
                  "| operation | " + " | ".join(f"{x:,}" for x in sizes) + " | exponent (last doubling) |",
                  "|---|" + "---:|" * len(sizes) + "---:|"]
        for op, o in s["ops"].items():
            cells = [f"{fmt_s(t)} s" + ("" if m is None else f" / {m / MiB:.0f} MiB")
                     for t, m in zip(o["time_s"], o["mem_bytes"])]
            cells += [""] * (len(sizes) - len(cells))
            lines.append(f"| {op}{' (CLI)' if o['cli'] and not op.startswith('cli') else ''} | "
                         + " | ".join(cells) + f" | {o['exponent']:.2f} ({o['last_doubling']:.2f}) |")
        lines.append("")
    lines += ["### targets", "", "| target | result | measured |", "|---|---|---|"]
    for target, ok, detail in checks:
        lines.append(f"| {target} | {'n/a' if ok is None else 'PASS' if ok else 'FAIL'} | {detail} |")
    lines += ["", f"Command: `{args_line}`; {platform.machine()}, {os.cpu_count()} cores, Python "
              f"{platform.python_version()}. Memory is the peak RSS above the process's baseline (a CLI "
              "command's: the child's whole peak)."]
    return "\n".join(lines)


def write_docs(path: Path, body: str) -> None:
    """Put ``body`` between the bench_scale markers of ``path`` (appended under a heading the first time)."""
    text = path.read_text() if path.exists() else ""
    block = f"{DOCS_BEGIN}\n{body}\n{DOCS_END}"
    if DOCS_BEGIN in text and DOCS_END in text:
        head, rest = text.split(DOCS_BEGIN, 1)
        text = head + block + rest.split(DOCS_END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + "## Scale (bench_scale.py)\n\n" + block + "\n"
    path.write_text(text)


def print_text(summary: dict, checks: list) -> None:
    for name, s in summary.items():
        print(f"\n== {name}: {s['x']} {s['sizes']}")
        for op, o in s["ops"].items():
            ts = " ".join(f"{t:8.3f}" for t in o["time_s"])
            ms = " ".join("     -" if m is None else f"{m / MiB:6.0f}" for m in o["mem_bytes"])
            print(f"  {op:28s} time s {ts} | peak MiB {ms} | exponent {o['exponent']:.2f} "
                  f"(last doubling {o['last_doubling']:.2f})")
    print("\n== targets")
    for target, ok, detail in checks:
        print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'FAIL'}  {target}: {detail}")


def parse_sizes(text: str | None) -> list[int] | None:
    return None if text is None else [int(v) for v in text.replace("_", "").split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (the default); under a minute")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="quick (default) or full")
    p.add_argument("--sweeps", default=",".join(SWEEPS), help=f"which of {','.join(SWEEPS)}")
    p.add_argument("--chunks", help="chunks per checkpoint, comma-separated (8 KiB each)")
    p.add_argument("--million", help="chunks per checkpoint of the million sweep, comma-separated (4 KiB each)")
    p.add_argument("--history", help="checkpoints in history, comma-separated")
    p.add_argument("--refs", type=int, help="chunks per checkpoint in the history sweep")
    p.add_argument("--ranks", help="simulated ranks, comma-separated (each must divide 1024)")
    p.add_argument("--state-mib", type=int, help="state of the ranks sweep, MiB")
    p.add_argument("--items", help="items per checkpoint, comma-separated")
    p.add_argument("--repeat", type=int, help="runs of each read-only operation (median)")
    p.add_argument("--no-cli", action="store_true", help="skip the operations run through the CLI")
    p.add_argument("--tmp", help="directory for the stores (default: a temp dir, removed after)")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--write-docs", nargs="?", const=str(HERE.parent / "docs" / "performance.md"),
                   help="write the tables into this markdown file (default docs/performance.md)")
    args = p.parse_args(argv)
    if args.quick and args.size not in (None, "quick"):
        p.error("--quick and --size full contradict each other")
    cfg = dict(SIZES[args.size or "quick"])
    for key in ("chunks", "million", "history", "ranks", "items"):
        cfg[key] = parse_sizes(getattr(args, key)) or cfg[key]
    for key in ("refs", "state_mib", "repeat"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    sweeps = [s for s in args.sweeps.split(",") if s]
    unknown = set(sweeps) - set(SWEEPS)
    if unknown:
        p.error(f"unknown sweeps {sorted(unknown)}; choose from {','.join(SWEEPS)}")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    root = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.tmp))
    results = {}
    t0 = time.perf_counter()
    try:
        for name in sweeps:
            if name == "chunks":
                results[name] = sweep_chunks(root, cfg["chunks"], cfg["repeat"], not args.no_cli, log)
            elif name == "million":
                results[name] = sweep_million(root, cfg["million"], cfg["repeat"], log)
            elif name == "history":
                results[name] = sweep_history(root, cfg["history"], cfg["refs"], cfg["repeat"], log)
            elif name == "items":
                results[name] = sweep_items(root, cfg["items"], cfg["repeat"], log)
            elif name == "ranks":
                try:
                    import torch  # noqa: F401
                except ImportError:
                    log("ranks: skipped (torch is not installed)")
                    continue
                results[name] = sweep_ranks(root, cfg["ranks"], cfg["state_mib"], log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarize(results)
    checks = check_targets(summary)
    print_text(summary, checks)
    print(f"\n{time.perf_counter() - t0:.1f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg, "summary": summary,
                                               "targets": [list(c) for c in checks]}, indent=1))
    if args.write_docs:
        line = "python benchmarks/bench_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_docs(Path(args.write_docs), render(summary, checks, line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

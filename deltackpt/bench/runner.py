"""Run the workload benchmark: train each workload once, hand every checkpoint to every system, measure.

Per workload and system: stored bytes after each checkpoint (cumulative), wall time of each save, wall time
of a load of the last and of the first checkpoint (into a freshly allocated state dict, checked bit-exact
against what was saved), and peak RSS.

Two ways to run the systems (``isolate``):

* ``True`` (the CLI's default): training happens once in this process, each checkpoint's state dict is
  written once to a source file (``torch.save``), then every system runs in its own worker process (forked
  from a multiprocessing forkserver that imported torch once, so no training state is inherited and no
  interpreter start is paid per system) that reads the sources back one at a time, saves them in order,
  then loads. Peak RSS is that worker's: the
  kernel's high-water mark is reset right before each save/load and read right after (a 1 ms polling thread
  where the reset is not allowed); restic's own peak (it is a child process) comes from ``wait4`` and is
  added on top of the Python process's RSS at the time.
* ``False`` (the unit test): systems run in this process on the live state dicts between training steps;
  the same per-phase RSS measurement, but allocator state left by one system can hide part of the next one's.

``peak_rss_bytes`` is the absolute peak of the measuring process (interpreter, torch and the state dict
being saved or loaded into included); ``peak_rss_overhead_bytes`` is the most any save or load added on top
of the RSS it started from. Each load is repeated ``LOAD_REPEATS`` times (median time, highest RSS
peak). Every save and load starts right after a full garbage collection (as in
bench_dcp), so no system pays for a collection that objects left by an earlier step made due. Page cache
before a load: every file of the system's storage is read once (``warm``, default) or the cache is dropped
(``drop``, needs root; affects the whole machine).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from .measure import PeakRSS, drop_page_cache, warm_tree
from .systems import SYSTEMS, _barrier, _rank, make_system, system_class
from .workloads import make_workload, workload_config

# DCP warns on every save/load without a process group that it assumes a single process: expected here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# Each load is timed this many times and the median kept: one 0.1-0.3 s load on a shared 2-core machine
# varies by +-30 % from run to run.
LOAD_REPEATS = 3


class SystemRun:
    """Drive one system through saves and loads, recording a measurement per call."""

    def __init__(self, system, page_cache: str = "warm", load_repeats: int = LOAD_REPEATS) -> None:
        self.system = system
        self.page_cache = page_cache
        self.load_repeats = max(1, int(load_repeats))
        self.saves: list[dict] = []
        self.loads: dict[str, dict] = {}
        self.rss_method = ""

    def save(self, state: dict, name: str, step: int | None = None) -> dict:
        gc.collect()
        if _rank() == 0:
            os.sync()  # no dirty pages of earlier saves (of this or another system) are flushed during this one
        _barrier()  # and the ranks start together: one rank's time does not include another's collection
        with PeakRSS() as m:
            t0 = time.perf_counter()
            self.system.save(state, name)
            seconds = time.perf_counter() - t0
        m.add_child(self.system.child_peak_bytes)
        self.rss_method = m.method
        rec = {"name": name, "step": step, "save_s": seconds, "peak_rss_bytes": m.peak,
               "rss_overhead_bytes": m.overhead}
        if _rank() == 0:
            rec["stored_bytes"] = self.system.stored_bytes()
        self.saves.append(rec)
        return rec

    def load(self, state: dict, name: str, kind: str) -> dict:
        """Load ``name`` into ``state`` ``load_repeats`` times (zeroed in between, so the last load alone
        fills it); the record keeps the median time and the highest RSS peak."""
        times, peaks, overheads = [], [], []
        for i in range(self.load_repeats):
            if i:
                zero_tree(state)
            cache = self._prepare_cache(name)
            gc.collect()
            with PeakRSS() as m:
                t0 = time.perf_counter()
                self.system.load(state, name)
                times.append(time.perf_counter() - t0)
            m.add_child(self.system.child_peak_bytes)
            self.system.after_load(name)
            peaks.append(m.peak)
            overheads.append(m.overhead)
        rec = {"name": name, "load_s": statistics.median(times), "load_s_all": [round(t, 4) for t in times],
               "peak_rss_bytes": max(peaks), "rss_overhead_bytes": max(overheads), "page_cache": cache}
        self.loads[kind] = rec
        return rec

    def _prepare_cache(self, name: str) -> str:
        how = "warm (files read once before the load)"
        if _rank() == 0:
            if self.page_cache == "drop" and drop_page_cache():  # (which writes dirty pages back first)
                how = "dropped"
            else:
                # Dirty pages of the saves before (gigabytes in a full run) are written back first: a load
                # timed while the kernel flushes them shares the cores with that writeback.
                os.sync()
                for p in self.system.data_paths(name):
                    warm_tree(p)
        _barrier()
        return how

    def result(self) -> dict:
        return summarize(self.saves, self.loads, self.rss_method, self.system.extra())


def summarize(saves: list[dict], loads: dict[str, dict], rss_method: str, extra: dict) -> dict:
    times = [r["save_s"] for r in saves]
    phases = saves + list(loads.values())
    last, first = loads.get("last", {}), loads.get("first", {})
    out = {
        "stored_bytes": int(saves[-1]["stored_bytes"]) if saves else 0,
        "cumulative_bytes": [int(r["stored_bytes"]) for r in saves],
        "save_s": sum(times) / len(times) if times else 0.0,
        "save_total_s": sum(times),
        "save_s_per_checkpoint": [round(t, 4) for t in times],
        "load_s": float(last.get("load_s", 0.0)),
        "load_last_s": float(last.get("load_s", 0.0)),
        "load_first_s": float(first.get("load_s", 0.0)),
        "load_last_s_all": list(last.get("load_s_all", [])),
        "load_first_s_all": list(first.get("load_s_all", [])),
        "peak_rss_bytes": int(max((r["peak_rss_bytes"] for r in phases), default=0)),
        "peak_rss_overhead_bytes": int(max((r["rss_overhead_bytes"] for r in phases), default=0)),
        "peak_rss_save_overhead_bytes": int(max((r["rss_overhead_bytes"] for r in saves), default=0)),
        "peak_rss_load_overhead_bytes": int(max((r["rss_overhead_bytes"] for r in loads.values()), default=0)),
        "peak_rss_method": rss_method,
        "page_cache": sorted({r.get("page_cache", "") for r in loads.values()} - {""}),
    }
    out.update(extra)
    return out


# -- state-dict trees ----------------------------------------------------------------------------------------
def zero_tree(obj) -> None:
    if isinstance(obj, torch.Tensor):
        obj.detach().zero_()
    elif isinstance(obj, dict):
        for v in obj.values():
            zero_tree(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            zero_tree(v)


def clone_tree(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def fresh_like(obj):
    """Same structure, every tensor newly allocated and zero-filled (pages touched): a load target."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: fresh_like(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(fresh_like(v) for v in obj)
    return obj


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.element_size() in ints and t.numel() else t


def tree_equal(a, b) -> bool:
    """Bit-exact comparison of two state-dict trees."""
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(tree_equal(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(tree_equal(x, y) for x, y in zip(a, b))
    return a == b


# -- one workload ----------------------------------------------------------------------------------------------
def system_options(name: str, dtype: str, opts: dict) -> dict:
    if name == "deltackpt":
        return {"store_config": dict(opts.get("store_config") or {})}
    if name.startswith("deltackpt-"):
        return {"store_config": dict(opts["variants"][name.removeprefix("deltackpt-")])}
    if name == "zipnn":
        return {"dtype": dtype}
    if name == "restic":
        return {"compression": opts.get("restic_compression", "auto")}
    return {}


def _load_and_check(run: SystemRun, refs: list[tuple[str, str, dict]]) -> bool:
    exact = True
    for kind, name, ref in refs:
        target = fresh_like(ref)
        run.load(target, name, kind)
        exact = exact and tree_equal(target, ref)
        del target
    return exact


def run_inprocess(wl, systems: list[str], work: Path, opts: dict, log) -> dict:
    runs = {}
    for n in systems:
        system = make_system(n, work / n, system_options(n, wl.dtype, opts))
        system.setup()
        runs[n] = SystemRun(system, opts.get("page_cache", "warm"))
    first = first_ref = last = None
    for ck in wl.checkpoints():
        log(f"  {ck.name}: saving with {', '.join(runs)}")
        for run in runs.values():
            run.save(ck.state, ck.name, ck.step)
        if first is None:
            first, first_ref = ck.name, clone_tree(ck.state)
        last = ck
    refs = [("last", last.name, clone_tree(last.state)), ("first", first, first_ref)]
    out = {}
    for n, run in runs.items():
        exact = _load_and_check(run, refs)
        out[n] = {**run.result(), "load_bit_exact": exact}
    return out


def worker_main(spec_path: str, result_path: str) -> int:
    """Worker entry: one system, every source checkpoint saved in order, then two loads."""
    spec = json.loads(Path(spec_path).read_text())
    system = make_system(spec["system"], spec["root"], spec["options"])
    system.setup()
    run = SystemRun(system, spec["page_cache"])
    sources = spec["sources"]
    for name, step, path in sources:
        state = torch.load(path, weights_only=True)
        run.save(state, name, step)
        del state
    exact = True
    for kind, (name, _step, path) in (("last", sources[-1]), ("first", sources[0])):
        ref = torch.load(path, weights_only=True)
        exact = _load_and_check(run, [(kind, name, ref)]) and exact
        del ref
    result = {**run.result(), "load_bit_exact": exact}
    Path(result_path).write_text(json.dumps(result))
    return 0


_WORKER_CTX = None


def _worker_context():
    """A forkserver that has imported torch and this module once: each worker is a cheap, clean fork of it
    (no interpreter start or torch import per system, and nothing of the training process inherited)."""
    global _WORKER_CTX
    if _WORKER_CTX is None:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        _WORKER_CTX = ctx
    return _WORKER_CTX


def _run_worker(spec_path: Path, result_path: Path) -> str | None:
    """Run one worker; None on success, else why it failed."""
    ctx = _worker_context()
    proc = ctx.Process(target=worker_main, args=(str(spec_path), str(result_path)), name="bench-worker")
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not result_path.exists():
        return f"worker exited with code {proc.exitcode} (traceback above)"
    return None


def run_isolated(wl, systems: list[str], work: Path, opts: dict, log) -> dict:
    src = work / "sources"
    src.mkdir(parents=True, exist_ok=True)
    sources = []
    for ck in wl.checkpoints():
        path = src / f"{ck.name}.pt"
        torch.save(ck.state, path)
        sources.append((ck.name, ck.step, str(path)))
    log(f"  trained: {len(sources)} checkpoints, losses {wl.info['losses'][0]} -> {wl.info['losses'][-1]}")
    out = {}
    for n in systems:
        spec = {"system": n, "root": str(work / n), "options": system_options(n, wl.dtype, opts),
                "page_cache": opts.get("page_cache", "warm"), "sources": sources}
        spec_path, result_path = work / f"{n}.spec.json", work / f"{n}.result.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        error = _run_worker(spec_path, result_path)
        if error:
            out[n] = {"error": error}
            log(f"  {n}: FAILED ({error})")
        else:
            out[n] = json.loads(result_path.read_text())
            log(f"  {n}: {out[n]['stored_bytes'] / 2**20:.1f} MiB stored, save {out[n]['save_s']:.2f} s/ckpt, "
                f"load {out[n]['load_s']:.2f} s ({time.perf_counter() - t0:.0f} s)")
        shutil.rmtree(work / n, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return out


def available_systems(systems) -> tuple[list[str], dict[str, str]]:
    ok, skipped = [], {}
    for n in systems:
        why = system_class(n).unavailable()
        if why:
            skipped[n] = why
        else:
            ok.append(n)
    return ok, skipped


def _with_ratios(entry: dict) -> dict:
    systems = entry["systems"]
    base = systems.get("dcp")
    entry["ratio_vs_dcp"] = {}
    entry["relative_to_dcp"] = {}
    if not base or "error" in base:
        return entry
    for n, r in systems.items():
        if "error" in r:
            continue
        entry["ratio_vs_dcp"][n] = base["stored_bytes"] / r["stored_bytes"] if r["stored_bytes"] else None
        rel = {}
        for k in ("save_s", "load_s", "load_first_s", "peak_rss_bytes", "peak_rss_overhead_bytes"):
            rel[k] = r[k] / base[k] if base.get(k) else None
        entry["relative_to_dcp"][n] = rel
    info = entry.get("info", {})
    if "adapter_only_bytes_per_checkpoint" in info:
        total = info["adapter_only_bytes_per_checkpoint"] * len(base["cumulative_bytes"])
        info["adapter_only_total_bytes"] = total
        info["adapter_only_ratio_vs_dcp"] = base["stored_bytes"] / total
    if "post_reshard_first_index" in info:
        i = info["post_reshard_first_index"]
        post = {}
        for n, r in systems.items():
            if "error" not in r:
                c = r["cumulative_bytes"]
                post[n] = c[-1] - c[i - 1]
                r["post_reshard_stored_bytes"] = post[n]
        info["post_reshard_ratio_vs_dcp"] = {n: post["dcp"] / b if b else None for n, b in post.items()}
    return entry


def run_workload(name: str, size: str, systems: list[str], work: Path, opts: dict, log) -> dict:
    t0 = time.perf_counter()
    if name == "reshard":
        from .reshard import run_reshard

        res, info = run_reshard(workload_config(name, size), systems, work, opts, log)
    else:
        wl = make_workload(name, size)
        runner = run_isolated if opts.get("isolate", True) else run_inprocess
        res = runner(wl, systems, work, opts, log)
        info = wl.info
    entry = {"systems": res, "info": info, "elapsed_s": round(time.perf_counter() - t0, 1)}
    return _with_ratios(entry)


def run_bench(out_dir: str | os.PathLike, workloads: list[str], size: str = "quick",
              systems: list[str] | tuple = SYSTEMS, isolate: bool = True, store_config: dict | None = None,
              restic_compression: str = "auto", page_cache: str = "warm", keep: bool = False,
              train_threads: int = 1, variants: dict[str, dict] | None = None,
              log: Callable[[str], None] | None = None) -> dict:
    """Run ``workloads`` at ``size`` on ``systems``; write results.json, results.md, cumulative_bytes.png.

    ``variants``: {label: StoreConfig overrides}; each adds a system ``deltackpt-LABEL`` that sees the same
    checkpoints (to tune deltackpt on one training run).

    Training runs with ``train_threads`` torch threads (1 by default: on a shared 2-core machine two
    threads were up to 4x slower and far noisier); the systems' workers use torch's default.
    """
    from ..store.config import new_config
    from .report import machine_info, write_outputs
    from .workloads import WORKLOADS

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    variants = dict(variants or {})
    systems = [*systems, *(f"deltackpt-{label}" for label in variants)]
    unknown = [w for w in workloads if w not in WORKLOADS] + [
        s for s in systems if s not in SYSTEMS and s.removeprefix("deltackpt-") not in variants]
    if unknown or not workloads:
        raise ValueError(f"unknown workload or system {unknown or workloads}; workloads: {', '.join(WORKLOADS)}; "
                         f"systems: {', '.join(SYSTEMS)}")
    if size not in ("tiny", "quick", "full"):
        raise ValueError(f"size must be tiny, quick or full, got {size!r}")
    for overrides in [store_config or {}, *variants.values()]:
        try:
            new_config(**overrides)
        except TypeError as e:
            raise ValueError(f"bad StoreConfig override {overrides}: {e}") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    systems = ["dcp", *[s for s in systems if s != "dcp"]]
    ok, skipped = available_systems(systems)
    for n, why in skipped.items():
        log(f"skipping {n}: {why}")
    opts = {"isolate": isolate, "store_config": store_config or {}, "restic_compression": restic_compression,
            "page_cache": page_cache, "variants": variants}
    tmp = Path(tempfile.mkdtemp(prefix="work-", dir=out))
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(train_threads)
    results = {"workloads": {}, "machine": machine_info(),
               "config": {"size": size, "systems": list(systems), "isolate": isolate,
                          "store_config": store_config or {}, "restic_compression": restic_compression,
                          "page_cache": page_cache, "train_threads": train_threads, "variants": variants},
               "skipped_systems": skipped}
    try:
        for name in workloads:
            log(f"[bench] {name} ({size})")
            entry = run_workload(name, size, ok, tmp / name, opts, log)
            entry["skipped"] = dict(skipped)
            results["workloads"][name] = entry
            if not keep:
                shutil.rmtree(tmp / name, ignore_errors=True)
    finally:
        torch.set_num_threads(threads)
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    write_outputs(results, out)
    return results

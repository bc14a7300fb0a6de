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

import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from .reshard import run_reshard
from .systemrun import SystemRun
from .systems import SYSTEMS, make_system, system_class, system_options
from .trees import clone_tree, fresh_like, tree_equal
from .workloads import make_workload, workload_config

# DCP warns on every save/load without a process group that it assumes a single process: expected here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# -- one workload ----------------------------------------------------------------------------------------------
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
    base = wl.base_state()
    if base is not None:
        for run in runs.values():
            run.save_base(base)
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
    if spec.get("base"):
        run.save_base(torch.load(spec["base"], weights_only=True))
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
    base, base_path = wl.base_state(), None
    if base is not None:
        base_path = str(src / "base.pt")
        torch.save(base, base_path)
        del base
    sources = []
    for ck in wl.checkpoints():
        path = src / f"{ck.name}.pt"
        torch.save(ck.state, path)
        sources.append((ck.name, ck.step, str(path)))
    log(f"  trained: {len(sources)} checkpoints, losses {wl.info['losses'][0]} -> {wl.info['losses'][-1]}")
    out = {}
    for n in systems:
        spec = {"system": n, "root": str(work / n), "options": system_options(n, wl.dtype, opts),
                "page_cache": opts.get("page_cache", "warm"), "sources": sources, "base": base_path}
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
        if not opts.get("keep"):  # --keep: every system's checkpoints stay for a look afterwards
            shutil.rmtree(work / n, ignore_errors=True)
    if not opts.get("keep"):
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


def with_ratios(entry: dict) -> dict:
    """Add to a workload's ``entry`` each system's ratio and relative times/RSS against ``dcp``; returns it."""
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
        first, first_dcp = r["save_s_per_checkpoint"][:1], base["save_s_per_checkpoint"][:1]
        rel["first_save_s"] = first[0] / first_dcp[0] if first and first_dcp and first_dcp[0] else None
        entry["relative_to_dcp"][n] = rel
    info = entry.get("info", {})
    if "adapter_only_bytes_per_checkpoint" in info:
        total = info["adapter_only_bytes_per_checkpoint"] * len(base["cumulative_bytes"])
        info["adapter_only_total_bytes"] = total
        info["adapter_only_ratio_vs_dcp"] = base["stored_bytes"] / total
        info["stored_vs_adapter_only"] = {n: r["stored_bytes"] / total for n, r in systems.items() if "error" not in r}
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
        res, info = run_reshard(workload_config(name, size, opts.get("num_checkpoints")), systems, work, opts, log)
    else:
        wl = make_workload(name, size, opts.get("num_checkpoints"))
        runner = run_isolated if opts.get("isolate", True) else run_inprocess
        res = runner(wl, systems, work, opts, log)
        info = wl.info
    entry = {"systems": res, "info": info, "elapsed_s": round(time.perf_counter() - t0, 1)}
    return with_ratios(entry)


def run_bench(out_dir: str | os.PathLike, workloads: list[str], size: str = "quick",
              systems: list[str] | tuple = SYSTEMS, isolate: bool = True, store_config: dict | None = None,
              restic_compression: str = "auto", page_cache: str = "warm", keep: bool = False,
              train_threads: int = 1, variants: dict[str, dict] | None = None,
              num_checkpoints: int | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Run ``workloads`` at ``size`` on ``systems``; write results.json, results.md, cumulative_bytes.png.

    ``variants``: {label: StoreConfig overrides}; each adds a system ``deltackpt-LABEL`` that sees the same
    checkpoints (to tune deltackpt on one training run). ``num_checkpoints`` replaces each workload's count.

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
    if num_checkpoints is not None and num_checkpoints < 1:
        raise ValueError(f"num_checkpoints must be >= 1, got {num_checkpoints}")
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
            "page_cache": page_cache, "variants": variants, "num_checkpoints": num_checkpoints, "keep": keep}
    tmp = Path(tempfile.mkdtemp(prefix="work-", dir=out))
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(train_threads)
    results = {"workloads": {}, "machine": machine_info(),
               "config": {"size": size, "systems": list(systems), "isolate": isolate,
                          "store_config": store_config or {}, "restic_compression": restic_compression,
                          "page_cache": page_cache, "train_threads": train_threads, "variants": variants,
                          "num_checkpoints": num_checkpoints},
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

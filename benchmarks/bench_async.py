"""Async save: how long training is blocked (stall) and how long the whole save takes, as ratios to a memcpy.

Systems (each ``dcp.async_save``, same state, same run):
  deltackpt     ``deltackpt.async_save(..., staging=StagingBuffers())``: one set of staging buffers reused by
                every save (what ``CheckpointManager(async_mode=...)`` does)
  dcp           ``FileSystemWriter`` with its defaults: a fresh CPU copy of the state every save
  dcp-cached    one ``FileSystemWriter(cache_staged_state_dict=True)`` reused for every save

Modes: THREAD, and PROCESS (a background checkpoint process; the worker starts a 1-rank gloo group for it).

The state: 32 fp32 tensors of ``size/32`` each, random normal. Before every save a quarter of the tensors
change slightly (``+= 1e-3``), as after a training step. ``memcpy`` is ``dst.copy_(src)`` over the whole state
into tensors allocated (and touched) beforehand, timed (best of 2) in the same process just before every save,
so both see the same machine load: the floor for a stall. Reported per (size, mode, system): the first save's
stall, and over saves 2..N the median memcpy, stall and total time and the median of each save's
stall / memcpy and total / memcpy (goal for deltackpt: stall <= 1.5x memcpy from the second save on).
``FileSystemWriter(cache_staged_state_dict=True)`` pins its cache, so dcp-cached needs an accelerator
(torch raises "Cannot access accelerator device" on a CPU-only build; the row shows that error).

Every (size, mode, system) runs in a fresh subprocess (``--worker``) so no run inherits another's memory;
checkpoints go under ``--tmp`` and are deleted after each run.

Usage:
  python benchmarks/bench_async.py [--quick | --size full] [--modes thread,process] [--saves 4]
                                   [--systems deltackpt,dcp,dcp-cached] [--threads 1] [--json PATH]
                                   [--tmp DIR]

Sizes: ``--quick`` 16 and 64 MiB; default 0.25 and 1 GiB; ``--size full`` adds 4 GiB (needs ~4x the state
in free memory: the state, the memcpy target, the staged copy and the save's own buffers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MiB = 1 << 20
SYSTEMS = ("deltackpt", "dcp", "dcp-cached")
MODES = ("thread", "process")
NUM_TENSORS = 32


def make_state(nbytes: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    n = max(1, nbytes // NUM_TENSORS // 4)
    return {f"layer{i:02d}.weight": torch.randn(n, generator=g) for i in range(NUM_TENSORS)}


def time_memcpy(state: dict, dst: dict, repeat: int = 2) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        times.append(time.perf_counter() - t0)
    return min(times)


def _saver(system: str, mode: str, root: Path):
    """A function save(i) -> future for the i-th save, and a cleanup function."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    if system == "deltackpt":
        import deltackpt
        from deltackpt.dcp import StagingBuffers

        staging = StagingBuffers(share_memory=mode == "process")
        store = str(root / "store")
        return (lambda sd, i: deltackpt.async_save(sd, store, f"s-{i}", async_checkpointer_type=kind,
                                                   staging=staging)), staging.close
    if system == "dcp":
        return (lambda sd, i: dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(str(root / f"s-{i}")),
                                             async_checkpointer_type=kind)), lambda: None
    writer = dcp.FileSystemWriter(str(root / "s-0"), cache_staged_state_dict=True)
    return (lambda sd, i: dcp.async_save(sd, storage_writer=writer, checkpoint_id=str(root / f"s-{i}"),
                                         async_checkpointer_type=kind)), writer.close


def run_worker(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(cfg["threads"])
    root = Path(cfg["root"])
    if cfg["mode"] == "process":  # DCP's background process joins the caller's process group
        dist.init_process_group("gloo", init_method=f"file://{root / 'rdzv'}", rank=0, world_size=1)
    state = make_state(cfg["nbytes"])
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        dst[k].copy_(v)  # fault the pages in: the baseline is a copy into existing memory
    save, cleanup = _saver(cfg["system"], cfg["mode"], root)
    memcpys, stalls, totals = [], [], []
    try:
        for i in range(cfg["saves"]):
            with torch.no_grad():
                for k in list(state)[i % 4::4]:
                    state[k].add_(1e-3)
            gc.collect()
            memcpys.append(time_memcpy(state, dst))  # just before the save: the same machine load
            t0 = time.perf_counter()
            fut = save(state, i)
            t1 = time.perf_counter()
            fut.result()
            t2 = time.perf_counter()
            stalls.append(t1 - t0)
            totals.append(t2 - t0)
    finally:
        cleanup()
        if cfg["mode"] == "process":
            import torch.distributed.checkpoint._async_process_executor as ape

            proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
            del proc  # asks the background process to exit and joins it
            dist.destroy_process_group()
    return {"memcpys_s": memcpys, "stalls_s": stalls, "totals_s": totals}


def run_one(system: str, mode: str, nbytes: int, saves: int, tmp: str, threads: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-async-", dir=tmp))
    cfg = {"system": system, "mode": mode, "nbytes": nbytes, "saves": saves, "root": str(root), "threads": threads}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True,
                              text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"}
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarize(res: dict) -> dict:
    if "error" in res:
        return res
    def later(values):  # saves 2..N
        return statistics.median(values[1:] or values)

    ratios = [s / m for s, m in zip(res["stalls_s"], res["memcpys_s"])]
    total_ratios = [t / m for t, m in zip(res["totals_s"], res["memcpys_s"])]
    return {**res, "memcpy_s": later(res["memcpys_s"]), "first_stall_s": res["stalls_s"][0],
            "stall_s": later(res["stalls_s"]), "total_s": later(res["totals_s"]),
            "first_stall_x_memcpy": ratios[0], "stall_x_memcpy": later(ratios), "total_x_memcpy": later(total_ratios)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 and 64 MiB states")
    ap.add_argument("--size", choices=("default", "full"), default="default",
                    help="default: 0.25 and 1 GiB; full: also 4 GiB")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of: thread, process")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of: " + ", ".join(SYSTEMS))
    ap.add_argument("--saves", type=int, default=4, help="saves per run (the first is reported apart)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for the copies (default 1: stable timings on a shared machine)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    ap.add_argument("--tmp", default="/tmp", help="where checkpoints are written (default /tmp)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    sizes = [16 * MiB, 64 * MiB] if args.quick else [256 * MiB, 1024 * MiB] + ([4096 * MiB] if args.size == "full"
                                                                                  else [])
    modes = [m for m in args.modes.split(",") if m]
    systems = [s for s in args.systems.split(",") if s]
    rows = []
    print(f"{'size':>8} {'mode':>8} {'system':>11} {'memcpy s':>9} {'1st stall':>9} {'1st/memcpy':>10} "
          f"{'stall s':>8} {'stall/memcpy':>12} {'total s':>8} {'total/memcpy':>12}", flush=True)
    for nbytes in sizes:
        for mode in modes:
            for system in systems:
                res = summarize(run_one(system, mode, nbytes, args.saves, args.tmp, args.threads))
                rows.append({"size_bytes": nbytes, "mode": mode, "system": system, **res})
                label = f"{nbytes / MiB:>6.0f}Mi {mode:>8} {system:>11}"
                if "error" in res:
                    print(f"{label} error: {res['error']}", flush=True)
                    continue
                print(f"{label} {res['memcpy_s']:9.3f} {res['first_stall_s']:9.3f} "
                      f"{res['first_stall_x_memcpy']:10.1f} {res['stall_s']:8.3f} "
                      f"{res['stall_x_memcpy']:12.2f} {res['total_s']:8.3f} {res['total_x_memcpy']:12.1f}",
                      flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"saves": args.saves, "cpu_count": os.cpu_count(), "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

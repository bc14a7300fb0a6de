"""A fine-tune's first checkpoint when its base is already in the store, against DCP (issue 21.3).

Trains the bench's ``frozen-base`` workload, then per run: DCP's ``FileSystemWriter`` saves the fine-tune's
first checkpoint into a fresh directory; a fresh store saves the pretrained base as ``base``, then
``DeltaStorageWriter`` saves the same first checkpoint. The two alternate, ``os.sync()`` before each timed
save. Prints one JSON object: the per-run wall times, their medians and ratio, the median per-run ratio,
the CPU time (this process, all threads) of each save, and the stored bytes of the first checkpoint.

Usage: python benchmarks/bench_finetune_first_save.py [--size full|quick] [--runs 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from deltackpt import DeltaSavePlanner, DeltaStorageWriter  # noqa: E402
from deltackpt.bench.workloads import WORKLOADS, workload_config  # noqa: E402
from deltackpt.store import Store  # noqa: E402


def _timed(save) -> tuple[float, float]:
    gc.collect()
    os.sync()
    t0, c0 = time.perf_counter(), time.process_time()
    save()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", choices=["full", "quick"])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    wl = WORKLOADS["frozen-base"](workload_config("frozen-base", args.size))
    base, first = wl.base_state(), next(iter(wl.checkpoints())).state
    root = Path(tempfile.mkdtemp(prefix="ftune-first-save-"))
    wall = {"dcp": [], "deltackpt": []}
    cpu = {"dcp": [], "deltackpt": []}
    stored = None
    try:
        for r in range(args.runs):
            out = root / f"dcp{r}"
            t, c = _timed(lambda: dcp.save(first, storage_writer=FileSystemWriter(str(out))))
            wall["dcp"].append(t)
            cpu["dcp"].append(c)
            shutil.rmtree(out)
            path = root / f"store{r}"
            Store.init(path)
            store = Store.open(path)
            dcp.save(base, storage_writer=DeltaStorageWriter(store, "base"), planner=DeltaSavePlanner())
            t, c = _timed(lambda: dcp.save(first, storage_writer=DeltaStorageWriter(store, "step-1"),
                                           planner=DeltaSavePlanner()))
            wall["deltackpt"].append(t)
            cpu["deltackpt"].append(c)
            stored = store.list_checkpoints()[-1].stored_bytes
            shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in wall.items()}
    result = {
        "size": args.size, "runs": args.runs,
        "wall_s": {k: [round(x, 4) for x in v] for k, v in wall.items()},
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "ratio": round(med["deltackpt"] / med["dcp"], 3),
        "per_run_ratio_median": round(statistics.median(a / b for a, b in zip(wall["deltackpt"], wall["dcp"])), 3),
        "cpu_median_s": {k: round(statistics.median(v), 4) for k, v in cpu.items()},
        "stored_bytes_first": stored,
    }
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

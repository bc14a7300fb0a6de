"""Simulated many-rank DCP saves in one process: rank r of N runs the real DeltaStorageWriter code path.

Each rank holds a dim-0 shard of every tensor of a fixed global state and its own Store object (as a rank
process would); the coordinator's steps (global plan, commit) run on rank 0's writer, as DCP calls them.
Used by the per-rank cost tests and by hand for measurements (``python tests/dcp/simranks.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from deltackpt.dcp import DeltaStorageWriter


class _ShardPlanner:
    """What DeltaStorageWriter.write_data asks of a planner: the data of a write item."""

    def __init__(self, shards: dict[str, torch.Tensor]) -> None:
        self.shards = shards

    def resolve_data(self, item: WriteItem):
        return self.shards[item.index.fqn]


def _local_plan(state: dict[str, torch.Tensor], rank: int, ranks: int):
    items, shards = [], {}
    for fqn, t in state.items():
        rows = t.shape[0] // ranks
        offsets = torch.Size([rank * rows] + [0] * (t.dim() - 1))
        sizes = torch.Size([rows] + list(t.shape[1:]))
        shards[fqn] = t[rank * rows:(rank + 1) * rows]
        items.append(WriteItem(
            index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                        properties=TensorProperties(dtype=t.dtype), size=t.shape)))
    return SavePlan(items), _ShardPlanner(shards)


@dataclass
class SaveTimes:
    per_rank_s: list[float] = field(default_factory=list)  # setup + local plan + write_data of each rank
    per_rank_cpu_s: list[float] = field(default_factory=list)  # the same in CPU time (all threads)
    coordinator_s: float = 0.0  # global plan + finish (commit)


def simulate_save(stores: list, name: str, state: dict[str, torch.Tensor], **writer_kwargs) -> SaveTimes:
    """Save ``state`` as checkpoint ``name`` over ``len(stores)`` simulated ranks (``stores[r]``: rank r's);
    ``writer_kwargs`` go to each rank's DeltaStorageWriter."""
    ranks = len(stores)
    times = SaveTimes()
    writers, plans, planners = [], [], []
    for r, store in enumerate(stores):
        t0, c0 = time.perf_counter(), time.process_time()
        w = DeltaStorageWriter(store, name, **writer_kwargs)
        w.set_up_storage_writer(r == 0, rank=r)
        plan, planner = _local_plan(state, r, ranks)
        plans.append(w.prepare_local_plan(plan))
        writers.append(w)
        planners.append(planner)
        times.per_rank_s.append(time.perf_counter() - t0)
        times.per_rank_cpu_s.append(time.process_time() - c0)
    t0 = time.perf_counter()
    plans, metadata = create_default_global_save_plan(plans)
    plans = writers[0].prepare_global_plan(plans)
    times.coordinator_s += time.perf_counter() - t0
    results = []
    for r in range(ranks):
        t0, c0 = time.perf_counter(), time.process_time()
        results.append(writers[r].write_data(plans[r], planners[r]).value())
        times.per_rank_s[r] += time.perf_counter() - t0
        times.per_rank_cpu_s[r] += time.process_time() - c0
    t0 = time.perf_counter()
    writers[0].finish(metadata, results)
    times.coordinator_s += time.perf_counter() - t0
    return times


def make_state(total_bytes: int, num_tensors: int = 16, rows: int = 1024, seed: int = 0) -> dict:
    """``num_tensors`` float32 tensors of ``rows`` rows, ``total_bytes`` in all."""
    g = torch.Generator().manual_seed(seed)
    cols = total_bytes // (num_tensors * rows * 4)
    return {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(num_tensors)}


def perturb(state: dict, fraction: float, seed: int = 1) -> dict:
    """A copy of ``state`` with about ``fraction`` of each tensor's rows changed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for fqn, t in state.items():
        t = t.clone()
        n = max(1, int(t.shape[0] * fraction))
        rows = torch.randperm(t.shape[0], generator=g)[:n]
        t[rows] += 1e-3
        out[fqn] = t
    return out


def main() -> None:
    import argparse
    import statistics
    import tempfile

    from deltackpt.store import Store

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 512])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--chunk-kib", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    state0 = make_state(args.mib << 20)
    state1 = perturb(state0, 0.01)
    base = None
    for ranks in args.ranks:
        per_rank, cpu, coord = [], [], []
        for rep in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                Store.init(d, chunk_size_bytes=args.chunk_kib << 10)
                stores = [Store.open(d) for _ in range(ranks)]
                simulate_save(stores, "s0", state0)
                t = simulate_save(stores, "s1", state1)
                per_rank.append(sum(t.per_rank_s) / ranks)
                cpu.append(sum(t.per_rank_cpu_s) / ranks)
                coord.append(t.coordinator_s)
        pr, pc, co = statistics.median(per_rank), statistics.median(cpu), statistics.median(coord)
        base = base or pr
        print(f"ranks={ranks:5d}  per-rank {pr * 1e3:8.2f} ms (cpu {pc * 1e3:8.2f} ms)  summed {pr * ranks:7.2f} s"
              f"  coordinator {co * 1e3:8.1f} ms  per-rank/first {pr / base:5.2f}", flush=True)


if __name__ == "__main__":
    main()

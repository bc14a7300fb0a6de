"""The ``reshard`` workload: an FSDP2 GPT trained on 2 gloo ranks and checkpointed, then resumed on 3 ranks
from its last checkpoint (loaded from every system; all must agree bit for bit) and checkpointed on.

Ranks are fresh ``spawn`` processes joined through a ``file://`` rendezvous (the idea of ``tests/dist.py``),
one torch thread each. Every rank drives every system (the saves are collective); each rank measures its own
save/load time and peak RSS (the same per-phase high-water mark as elsewhere), and the report takes the
maximum over ranks. Stored bytes are measured by rank 0 after each save. The saves after the reshard are
reported apart (``post_reshard_stored_bytes``): with 3 ranks the shard boundaries move, which is exactly
what content addressing on a global grid is meant to absorb.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch

from .systemrun import SystemRun, summarize
from .systems import make_system, system_options
from .trees import zero_tree


def _child(fn, rank, world, init_file, args, results) -> None:
    status, payload = "err", ""
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        payload, status = fn(rank, world, *args), "ok"
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - DCP raises CheckpointException(BaseException)
        payload = f"rank {rank}:\n{traceback.format_exc()}"
    results.put((rank, status, payload))
    results.close()
    results.join_thread()


def spawn_ranks(fn, world: int, *args, timeout: float = 1800.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; results by rank; raise on failure/timeout."""
    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="deltackpt-bench-dist-")
    results = ctx.Queue()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_child, args=(fn, r, world, os.path.join(tmpdir, "rdzv"), args, results))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        done: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
                done[rank] = (status, payload)
                if status != "ok":
                    break
            except queue_mod.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
                    time.sleep(2)
                    if results.empty():
                        break
        bad = [f"{payload}" for status, payload in done.values() if status != "ok"]
        if bad or len(done) < world:
            raise RuntimeError("reshard workload failed: " + ("\n".join(bad) or
                               f"ranks {sorted(set(range(world)) - set(done))} did not finish"))
        return [done[r][1] for r in range(world)]
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _local_digest(obj) -> str:
    import xxhash
    from torch.distributed.tensor import DTensor

    h = xxhash.xxh3_128()

    def walk(o):
        if isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif isinstance(o, torch.Tensor):
            t = (o.to_local() if isinstance(o, DTensor) else o).detach().contiguous()
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()


def _digest(obj) -> tuple:
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, _local_digest(obj))
    return tuple(parts)


def _phase(rank, world, cfg, systems, work, opts, phase):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .models import MarkovTokens, gpt_from, lm_loss

    mc, every = cfg["model"], cfg["interval"]
    torch.manual_seed(cfg["seed"])
    model = gpt_from(mc)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    runs = {n: SystemRun(make_system(n, Path(work) / n, system_options(n, "float32", opts)),
                         opts.get("page_cache", "warm")) for n in systems}
    before_steps = cfg["checkpoints_before"] * every
    info: dict = {}
    if phase == "before":
        for run in runs.values():
            run.system.setup()
        start, count = 0, cfg["checkpoints_before"]
    else:
        digests = {}
        for n, run in runs.items():
            sd = _state(model, opt)
            run.load(sd, f"step-{before_steps:06d}", "reshard")
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            digests[n] = _digest(_state(model, opt))
        info["resumed_identical"] = len(set(digests.values())) == 1
        start, count = before_steps, cfg["checkpoints_after"]
    data = MarkovTokens(mc["vocab"], cfg["seed"] + 100 + 10 * rank + (1000 if phase == "after" else 0), zipf=1.0)
    warmup = cfg.get("warmup_steps", 10)
    losses = []
    step = start
    for step in range(start + 1, start + count * every + 1):
        for group in opt.param_groups:  # linear warmup by global step, so it does not restart on resume
            group["lr"] = cfg["lr"] * min(1.0, step / warmup)
        x, y = data.batch(mc["batch"], mc["seq"])
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0:
            opt.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 5))
            sd = _state(model, opt)
            for run in runs.values():
                run.save(sd, f"step-{step:06d}", step)
    info["losses"] = losses
    if phase == "after":
        ref_last = _digest(_state(model, opt))
        firsts, exact = {}, {}
        for n, run in runs.items():
            sd = _state(model, opt)
            zero_tree(sd)
            run.load(sd, f"step-{step:06d}", "last")
            exact[n] = _digest(sd) == ref_last
            zero_tree(sd)
            run.load(sd, f"step-{every:06d}", "first")
            firsts[n] = _digest(sd)
        info["first_identical"] = len(set(firsts.values())) == 1
        info["last_exact"] = exact
    dist.barrier()
    out = {n: {"saves": run.saves, "loads": run.loads, "method": run.rss_method} for n, run in runs.items()}
    if rank == 0:
        for n, run in runs.items():
            out[n]["extra"] = run.system.extra()
    return {"runs": out, "info": info}


def _merge(per_rank: list[dict], name: str) -> tuple[list[dict], dict[str, dict]]:
    """Max of time and RSS over ranks; stored bytes from rank 0."""
    runs = [r["runs"][name] for r in per_rank]
    saves = []
    for i, rec0 in enumerate(runs[0]["saves"]):
        recs = [r["saves"][i] for r in runs]
        saves.append({**rec0, "save_s": max(x["save_s"] for x in recs),
                      "peak_rss_bytes": max(x["peak_rss_bytes"] for x in recs),
                      "rss_overhead_bytes": max(x["rss_overhead_bytes"] for x in recs)})
    loads = {}
    for kind, rec0 in runs[0]["loads"].items():
        recs = [r["loads"][kind] for r in runs]
        loads[kind] = {**rec0, "load_s": max(x["load_s"] for x in recs),
                       "peak_rss_bytes": max(x["peak_rss_bytes"] for x in recs),
                       "rss_overhead_bytes": max(x["rss_overhead_bytes"] for x in recs)}
    return saves, loads


def run_reshard(cfg: dict, systems: list[str], work: Path, opts: dict, log) -> tuple[dict, dict]:
    work.mkdir(parents=True, exist_ok=True)
    timeout = opts.get("dist_timeout_s", 3600.0)
    a, b = cfg["ranks_before"], cfg["ranks_after"]
    log(f"  {a} ranks: training and saving {cfg['checkpoints_before']} checkpoints")
    before = spawn_ranks(_phase, a, cfg, systems, str(work), opts, "before", timeout=timeout)
    log(f"  {b} ranks: resuming, saving {cfg['checkpoints_after']} more")
    after = spawn_ranks(_phase, b, cfg, systems, str(work), opts, "after", timeout=timeout)
    res = {}
    info_b = after[0]["info"]
    for n in systems:
        saves_a, _ = _merge(before, n)
        saves_b, loads_b = _merge(after, n)
        reshard_load = loads_b.pop("reshard")
        r = summarize(saves_a + saves_b, loads_b, after[0]["runs"][n]["method"], after[0]["runs"][n]["extra"])
        r["load_reshard_s"] = reshard_load["load_s"]
        r["load_bit_exact"] = bool(info_b["last_exact"][n] and info_b["first_identical"]
                                   and info_b["resumed_identical"])
        res[n] = r
        log(f"  {n}: {r['stored_bytes'] / 2**20:.1f} MiB stored, save {r['save_s']:.2f} s/ckpt")
    from .models import gpt_from

    info = {"config": cfg, "num_params": sum(p.numel() for p in gpt_from(cfg["model"]).parameters()),
            "losses": before[0]["info"]["losses"] + info_b["losses"],
            "post_reshard_first_index": len(before[0]["runs"][systems[0]]["saves"]),
            "resumed_identical": info_b["resumed_identical"], "first_identical": info_b["first_identical"],
            "peak_rss_note": "max over ranks"}
    return res, info

"""deltackpt vs torch.distributed.checkpoint.FileSystemWriter/Reader on the same state dicts, in one run.

Workloads (``--workloads``):
  synthetic    16 fp32 tensors of ``--size-mib``/16 MiB each, random normal (default 1 GiB in all)
  transformer  a small language model (embedding, nn.TransformerEncoder, LM head) plus its AdamW state
               after a few steps, as ``get_state_dict(model, optim)`` returns it

Phases, for each system and workload:
  first      save the state (a new FileSystemWriter directory / a new deltackpt checkpoint)
  unchanged  save the very same state again under a new checkpoint id / directory
  changed    save a changed state (synthetic: ``t += 1e-3 * randn`` on every other tensor;
             transformer: one more optimizer step)
  load       ``dcp.load`` the changed checkpoint into a freshly allocated state dict of the same structure

Every (system, workload, phase) runs in a fresh subprocess (``--worker``) that first builds its state dict
(deterministically: both systems and all phases see bit-identical tensors, checked with a digest), then
syncs and drops the page cache (if allowed; otherwise every checkpoint file is read once before a load, for
both systems alike), resets the kernel's RSS high-water mark and times the save or load. Peak RSS is
reported as the high-water mark during the phase minus the RSS just before it, i.e. what the save/load
itself costs on top of the state dict. Stored bytes: the checkpoint directory's size for FileSystemWriter;
the growth of the store's physical bytes (packs + manifests + config) for deltackpt. A loaded state is
checked bit-exact against the saved one.

FileSystemWriter runs with its defaults (sync_files=True, thread_count=1); deltackpt with its defaults
(fsync on every put, a thread pool of min(8, cpus)). Timings on a shared machine are noisy: compare the
ratio column (both systems measured in the same run), and use ``--repeat`` for medians.

Usage:
  python benchmarks/bench_dcp.py [--workloads synthetic,transformer] [--size-mib 1024] [--repeat 1]
                                 [--json PATH] [--quick] [--tmp DIR] [--keep]

``--quick`` (CI smoke, < 60 s): 64 MiB synthetic and a tiny transformer; to save interpreter start-ups it
runs the four phases of one (system, workload) in one subprocess (the RSS mark is still reset per phase).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import (MiB, PeakRSS, dir_size, drop_page_cache, median, read_tree, ru_maxrss_bytes,  # noqa: E402
                     trim_heap)

SYSTEMS = ("fs", "deltackpt")
SYSTEM_LABELS = {"fs": "FileSystemWriter", "deltackpt": "deltackpt"}
WORKLOADS = ("synthetic", "transformer")
PHASES = ("first", "unchanged", "changed", "load")

# (metric, label, unit) in table order; "s" = seconds, "MiB" = bytes shown in MiB.
METRICS = [
    ("save_first_s", "save, first", "s"),
    ("save_unchanged_s", "save, unchanged re-save", "s"),
    ("save_changed_s", "save, changed", "s"),
    ("load_s", "load (latest, fresh state dict)", "s"),
    ("stored_first_bytes", "stored bytes, first", "MiB"),
    ("stored_unchanged_bytes", "stored bytes, unchanged", "MiB"),
    ("stored_changed_bytes", "stored bytes, changed", "MiB"),
    ("stored_total_bytes", "stored bytes, all three saves", "MiB"),
    ("peak_rss_first_bytes", "peak RSS over state, first save", "MiB"),
    ("peak_rss_unchanged_bytes", "peak RSS over state, unchanged", "MiB"),
    ("peak_rss_changed_bytes", "peak RSS over state, changed", "MiB"),
    ("peak_rss_load_bytes", "peak RSS over state, load", "MiB"),
    ("peak_rss_bytes", "peak RSS over state, max of phases", "MiB"),
    ("peak_rss_abs_bytes", "peak RSS total (state incl.), max of phases", "MiB"),
]

# deltackpt / FileSystemWriter must be <= these.
TARGETS = {
    "save_first_s": 1.0,
    "save_unchanged_s": 0.3,
    "load_s": 1.2,
    "peak_rss_bytes": 1.2,
}


def workload_config(quick: bool, size_mib: float) -> dict:
    if quick:
        return {
            "synthetic": {"num_tensors": 16, "size_mib": 64.0, "seed": 0},
            "transformer": {"vocab": 1000, "d_model": 64, "nhead": 4, "layers": 2, "ff": 256,
                            "batch": 4, "seq": 32, "steps": 2, "seed": 0},
        }
    return {
        "synthetic": {"num_tensors": 16, "size_mib": float(size_mib), "seed": 0},
        "transformer": {"vocab": 16000, "d_model": 384, "nhead": 6, "layers": 4, "ff": 1536,
                        "batch": 4, "seq": 64, "steps": 3, "seed": 0},
    }


# ---------------------------------------------------------------------------------------------------------
# Worker side: build a state dict, run one phase, report.
# ---------------------------------------------------------------------------------------------------------

def _synthetic_shapes(cfg: dict) -> list[tuple[int, int]]:
    per_tensor = int(cfg["size_mib"] * MiB) // cfg["num_tensors"]
    cols = 1024
    rows = max(1, per_tensor // (4 * cols))
    return [(rows, cols)] * cfg["num_tensors"]


def build_synthetic(cfg: dict, phase: str):
    import torch

    shapes = _synthetic_shapes(cfg)
    if phase == "load":  # freshly allocated, every page touched
        return {f"layer{i:02d}.weight": torch.full(s, -1.0) for i, s in enumerate(shapes)}, None
    g = torch.Generator().manual_seed(cfg["seed"])
    sd = {f"layer{i:02d}.weight": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    if phase == "changed":
        g2 = torch.Generator().manual_seed(cfg["seed"] + 1)
        for i, key in enumerate(sorted(sd)):
            if i % 2 == 0:
                t = sd[key]
                t.add_(torch.randn(t.shape, generator=g2), alpha=1e-3)
    return sd, None


def _tiny_lm(cfg: dict):
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["d_model"]
            self.embed = nn.Embedding(cfg["vocab"], d)
            self.pos = nn.Parameter(torch.zeros(cfg["seq"], d))
            layer = nn.TransformerEncoderLayer(d, cfg["nhead"], cfg["ff"], dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, cfg["layers"], enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, cfg["vocab"], bias=False)

        def forward(self, x):
            h = self.embed(x) + self.pos[: x.shape[1]]
            return self.head(self.norm(self.encoder(h)))

    return TinyLM()


def build_transformer(cfg: dict, phase: str):
    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    steps = {"first": cfg["steps"], "unchanged": cfg["steps"], "changed": cfg["steps"] + 1, "load": 0}[phase]
    torch.manual_seed(cfg["seed"] if phase != "load" else cfg["seed"] + 12345)
    model = _tiny_lm(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(cfg["seed"] + 7)
    for _ in range(steps):
        x = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    # With steps == 0 (a fresh state to load into) get_state_dict initializes AdamW's state tensors.
    msd, osd = get_state_dict(model, opt)
    opt.zero_grad(set_to_none=True)
    return {"model": msd, "optim": osd}, (model, opt)


def state_digest(obj) -> str:
    """xxh3 over every tensor's bytes and every other leaf's repr, in key order."""
    import torch
    import xxhash

    h = xxhash.xxh3_128()

    def walk(prefix: str, o) -> None:
        if isinstance(o, dict):
            for k in sorted(o, key=str):
                walk(f"{prefix}/{k}", o[k])
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(f"{prefix}[{i}]", v)
        elif isinstance(o, torch.Tensor):
            t = o.detach().contiguous()
            h.update(f"{prefix}:{t.dtype}:{list(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(f"{prefix}={o!r}".encode())

    walk("", obj)
    return h.hexdigest()


def state_bytes(obj) -> int:
    import torch

    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return 0


def run_phase(system: str, workload: str, phase: str, root: Path, cfg: dict, drop_caches: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from deltackpt import DeltaStorageReader, DeltaStorageWriter

    t_build = time.perf_counter()
    build = build_synthetic if workload == "synthetic" else build_transformer
    sd, keepalive = build(cfg, phase)
    t_build = time.perf_counter() - t_build
    gc.collect()
    trim_heap()

    fs_dir = root / "fs"
    dk_dir = root / "deltackpt"
    latest = "changed"
    if phase == "load":
        src = fs_dir / latest if system == "fs" else dk_dir
    cache = "dropped" if drop_caches and drop_page_cache() else "none"
    if phase == "load" and cache != "dropped":
        # Cannot drop the page cache: make it equally warm for both systems instead.
        read_tree(src)
        cache = "warmed (files read once)"

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    with PeakRSS() as m:
        t0 = time.perf_counter()
        if phase == "load":
            if system == "fs":
                dcp.load(sd, storage_reader=FileSystemReader(str(src)))
            else:
                dcp.load(sd, storage_reader=DeltaStorageReader(str(src), latest))
        elif system == "fs":
            dcp.save(sd, storage_writer=FileSystemWriter(str(fs_dir / phase)))
        else:
            dcp.save(sd, storage_writer=DeltaStorageWriter(str(dk_dir), checkpoint_id=phase))
        seconds = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)

    res = {
        "system": system, "workload": workload, "phase": phase, "seconds": seconds, "cpu_seconds": cpu,
        "rss_before_bytes": m.baseline, "rss_peak_bytes": m.peak, "rss_overhead_bytes": m.overhead,
        "rss_method": m.method, "ru_maxrss_bytes": ru_maxrss_bytes(), "page_cache": cache,
        "build_seconds": t_build, "state_bytes": state_bytes(sd), "digest": state_digest(sd),
    }
    if phase != "load":
        if system == "fs":
            res["dir_bytes"], res["dir_alloc_bytes"] = dir_size(fs_dir / phase)
        else:
            from deltackpt.store import Store

            store = Store.open(str(dk_dir))
            res["physical_bytes"] = store.usage().physical_bytes
            res["manifest_stored_bytes"] = store.read_manifest(phase).stats.stored_bytes
            res["store_alloc_bytes"] = dir_size(dk_dir, exclude_top=("cache",))[1]
            res["cache_dir_bytes"] = dir_size(dk_dir / "cache")[0]
    del sd, keepalive
    gc.collect()
    return res


def worker_main(args) -> int:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = json.loads(args.worker_config)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for phase in args.phases.split(","):
        out.append(run_phase(args.system, args.workload, phase, root, cfg, not args.no_drop_caches))
    Path(args.out).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------------------------------
# Driver side.
# ---------------------------------------------------------------------------------------------------------

def spawn_worker(system: str, workload: str, phases: list[str], root: Path, cfg: dict, no_drop: bool) -> list[dict]:
    fd, out = tempfile.mkstemp(prefix="bench-dcp-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--system", system, "--workload", workload,
           "--phases", ",".join(phases), "--root", str(root), "--worker-config", json.dumps(cfg), "--out", out]
    if no_drop:
        cmd.append("--no-drop-caches")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise RuntimeError(f"worker {system}/{workload}/{','.join(phases)} failed (exit {proc.returncode})")
        return json.loads(Path(out).read_text())
    finally:
        Path(out).unlink(missing_ok=True)


def summarize_run(results: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per-system metrics of one repeat from the per-phase worker results."""
    out = {}
    for system, by_phase in results.items():
        m = {f"save_{p}_s": by_phase[p]["seconds"] for p in PHASES if p != "load"}
        m["load_s"] = by_phase["load"]["seconds"]
        for p in PHASES:  # user + system CPU seconds of the phase (all threads); less noisy than wall time
            m[f"cpu_{p}_s"] = by_phase[p]["cpu_seconds"]
        if system == "fs":
            for p in ("first", "unchanged", "changed"):
                m[f"stored_{p}_bytes"] = by_phase[p]["dir_bytes"]
        else:
            prev = 0
            for p in ("first", "unchanged", "changed"):
                m[f"stored_{p}_bytes"] = by_phase[p]["physical_bytes"] - prev
                m[f"manifest_stored_{p}_bytes"] = by_phase[p]["manifest_stored_bytes"]
                prev = by_phase[p]["physical_bytes"]
            m["cache_dir_bytes"] = by_phase["changed"]["cache_dir_bytes"]
        m["stored_total_bytes"] = sum(m[f"stored_{p}_bytes"] for p in ("first", "unchanged", "changed"))
        for p in PHASES:
            m[f"peak_rss_{p}_bytes"] = by_phase[p]["rss_overhead_bytes"]
            m[f"peak_rss_abs_{p}_bytes"] = by_phase[p]["rss_peak_bytes"]
        m["peak_rss_bytes"] = max(m[f"peak_rss_{p}_bytes"] for p in PHASES)
        m["peak_rss_abs_bytes"] = max(m[f"peak_rss_abs_{p}_bytes"] for p in PHASES)
        m["state_bytes"] = by_phase["first"]["state_bytes"]
        digests = {p: by_phase[p]["digest"] for p in PHASES}
        m["unchanged_state_identical"] = digests["first"] == digests["unchanged"]
        m["load_bit_exact"] = digests["load"] == digests["changed"]
        out[system] = m
    out["_digests_agree_across_systems"] = all(
        results["fs"][p]["digest"] == results["deltackpt"][p]["digest"] for p in PHASES)
    out["_meta"] = {
        "rss_method": sorted({r["rss_method"] for s in results.values() for r in s.values()}),
        "page_cache": sorted({r["page_cache"] for s in results.values() for r in s.values()}),
        "build_seconds": {s: {p: round(r["build_seconds"], 3) for p, r in v.items()} for s, v in results.items()},
    }
    return out


def run_workload(workload: str, cfg: dict, base: Path, rep: int, quick: bool, no_drop: bool) -> dict:
    root = base / f"{workload}-r{rep}"
    root.mkdir(parents=True)
    results: dict[str, dict[str, dict]] = {s: {} for s in SYSTEMS}
    try:
        if quick:
            order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                for r in spawn_worker(system, workload, list(PHASES), root, cfg, no_drop):
                    results[system][r["phase"]] = r
        else:
            for i, phase in enumerate(PHASES):
                # Alternate which system goes first, so neither always follows the other.
                order = SYSTEMS if (rep + i) % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    (r,) = spawn_worker(system, workload, [phase], root, cfg, no_drop)
                    results[system][phase] = r
                    print(f"  {workload:11s} {phase:9s} {SYSTEM_LABELS[system]:16s} {r['seconds']:8.3f} s  "
                          f"rss +{r['rss_overhead_bytes'] / MiB:7.1f} MiB", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return summarize_run(results)


def aggregate(runs: list[dict]) -> dict:
    """Median over repeats of every numeric metric; booleans must hold in every repeat."""
    out = {}
    for system in SYSTEMS:
        keys = runs[0][system].keys()
        agg = {}
        for k in keys:
            vals = [r[system][k] for r in runs]
            agg[k] = all(vals) if isinstance(vals[0], bool) else median(vals)
        out[system] = agg
    ratio, targets = {}, {}
    for key, _label, _unit in METRICS:
        a, b = out["fs"].get(key), out["deltackpt"].get(key)
        ratio[key] = (b / a) if a else (None if b else 1.0)
    for key, limit in TARGETS.items():
        r = ratio[key]
        targets[key] = {"max_ratio": limit, "ratio": r, "pass": r is not None and r <= limit}
    return {"fs": out["fs"], "deltackpt": out["deltackpt"], "ratio": ratio, "targets": targets,
            "checks": {"digests_agree_across_systems": all(r["_digests_agree_across_systems"] for r in runs)},
            "meta": runs[0]["_meta"], "repeats": len(runs),
            "per_repeat": [{s: r[s] for s in SYSTEMS} for r in runs]}


def fmt_value(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v:.3f} s"
    return f"{v / MiB:.1f} MiB"


def markdown_table(report: dict) -> str:
    lines = ["| workload | metric | FileSystemWriter | deltackpt | ratio | target | pass |",
             "|---|---|---:|---:|---:|---:|---|"]
    for wl, res in report["workloads"].items():
        for key, label, unit in METRICS:
            r = res["ratio"][key]
            t = res["targets"].get(key)
            lines.append("| {} | {} | {} | {} | {} | {} | {} |".format(
                wl, label, fmt_value(res["fs"][key], unit), fmt_value(res["deltackpt"][key], unit),
                "-" if r is None else f"{r:.2f}x", f"<= {t['max_ratio']:.1f}x" if t else "",
                ("PASS" if t["pass"] else "FAIL") if t else ""))
    return "\n".join(lines)


def machine_info(tmp: Path) -> dict:
    import torch

    import deltackpt
    from deltackpt import kernels

    info = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "deltackpt": deltackpt.__version__,
        "kernels_backend": getattr(kernels, "BACKEND", None),
        "tmp_dir": str(tmp),
    }
    try:  # which deltackpt was measured
        repo = HERE.parent
        info["git_commit"] = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
        info["git_dirty_deltackpt"] = bool(subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "deltackpt"], capture_output=True, text=True,
            timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
        fs = max((p for p in psutil.disk_partitions(all=True) if str(tmp).startswith(p.mountpoint)),
                 key=lambda p: len(p.mountpoint), default=None)
        if fs is not None:
            info["tmp_filesystem"] = f"{fs.fstype} on {fs.device} ({fs.mountpoint})"
    except Exception:  # noqa: BLE001 -- best effort
        pass
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of: synthetic, transformer")
    ap.add_argument("--size-mib", type=float, default=1024, help="synthetic state size in MiB (default 1024)")
    ap.add_argument("--repeat", type=int, default=1, help="repeat everything N times, report medians")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a CI smoke run (< 60 s)")
    ap.add_argument("--tmp", default="/tmp", help="where checkpoints are written (default /tmp, local disk)")
    ap.add_argument("--keep", action="store_true", help="keep the benchmark directory")
    ap.add_argument("--no-drop-caches", action="store_true",
                    help="do not drop the page cache (warm both systems' files before loads instead)")
    # internal: one worker subprocess
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    ap.add_argument("--phases", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--worker-config", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        return worker_main(args)

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        ap.error(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)}")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    configs = workload_config(args.quick, args.size_mib)
    tmp = Path(args.tmp)
    base = Path(tempfile.mkdtemp(prefix="deltackpt-bench-dcp-", dir=tmp))
    t_start = time.perf_counter()
    report = {"machine": machine_info(tmp), "config": {"quick": args.quick, "repeat": args.repeat,
                                                       "workloads": {w: configs[w] for w in workloads}},
              "workloads": {}}
    try:
        for wl in workloads:
            runs = []
            for rep in range(args.repeat):
                print(f"[bench_dcp] {wl}: repeat {rep + 1}/{args.repeat}", file=sys.stderr, flush=True)
                runs.append(run_workload(wl, configs[wl], base, rep, args.quick, args.no_drop_caches))
            report["workloads"][wl] = aggregate(runs)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    report["machine"]["page_cache"] = sorted({c for w in report["workloads"].values()
                                              for c in w["meta"]["page_cache"]})
    report["machine"]["rss_method"] = sorted({c for w in report["workloads"].values()
                                              for c in w["meta"]["rss_method"]})

    print(markdown_table(report))
    notes = []
    for wl, res in report["workloads"].items():
        st = res["fs"]["state_bytes"]
        notes.append(f"{wl}: state {st / MiB:.1f} MiB; unchanged state bit-identical: "
                     f"{res['fs']['unchanged_state_identical'] and res['deltackpt']['unchanged_state_identical']}; "
                     f"loads bit-exact: fs {res['fs']['load_bit_exact']}, deltackpt {res['deltackpt']['load_bit_exact']}; "
                     f"deltackpt index cache {res['deltackpt']['cache_dir_bytes'] / MiB:.1f} MiB (not counted)")
    notes.append(f"page cache: {', '.join(report['machine']['page_cache'])}; RSS: "
                 f"{', '.join(report['machine']['rss_method'])}; {report['machine']['cpu_count']} CPUs, "
                 f"torch {report['machine']['torch']}; {args.repeat} repeat(s), medians; {report['elapsed_s']} s")
    print()
    for n in notes:
        print(f"- {n}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = all(r["fs"]["load_bit_exact"] and r["deltackpt"]["load_bit_exact"] for r in report["workloads"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

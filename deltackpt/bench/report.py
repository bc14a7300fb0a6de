"""Benchmark outputs: ``results.json`` (the full record), ``results.md`` (a table per workload x system plus
notes) and ``cumulative_bytes.png`` (one subplot per workload: cumulative stored bytes after each
checkpoint, one line per system)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

MiB = 1 << 20
LABELS = {"dcp": "DCP FileSystemWriter", "deltackpt": "deltackpt", "zipnn": "ZipNN + DCP",
          "restic": "restic + DCP"}


def machine_info() -> dict:
    import torch

    from .. import __version__, kernels

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "deltackpt": __version__, "kernels": kernels.BACKEND, "loadavg_start": list(os.getloadavg())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        with open("/proc/meminfo") as f:
            info["mem_total_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    try:
        info["restic"] = subprocess.run(["restic", "version"], capture_output=True, text=True,
                                        timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["restic"] = None
    try:
        from importlib.metadata import version

        info["zipnn"] = version("zipnn")
    except Exception:  # noqa: BLE001 - not installed
        info["zipnn"] = None
    return info


def _mib(n) -> str:
    return f"{n / MiB:,.1f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(results: dict) -> str:
    lines = ["# deltackpt workload benchmark", ""]
    m = results["machine"]
    cfg = results["config"]
    lines.append(f"Size `{cfg['size']}`; {m.get('cpu_count')} CPUs ({m.get('cpu', '?')}), torch {m['torch']}, "
                 f"kernels {m['kernels']}; load average {m['loadavg_start'][0]:.1f} at start. Stored-bytes ratio = "
                 "DCP bytes / system bytes (higher is better); time and RSS columns show the value and, in "
                 "parentheses, system / DCP (lower is better). Save = mean wall time per checkpoint.")
    lines.append("")
    header = ("| workload | system | stored MiB | ratio vs DCP | save s/ckpt | load last s | load first s | "
              "peak RSS MiB | RSS overhead MiB | bit-exact |")
    lines += [header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    notes = []
    for wname, w in results["workloads"].items():
        rel = w.get("relative_to_dcp", {})
        for sname, r in w["systems"].items():
            if "error" in r:
                lines.append(f"| {wname} | {sname} | error | | | | | | | |")
                notes.append(f"{wname}/{sname}: {r['error']}")
                continue
            rr = rel.get(sname, {})
            lines.append(
                f"| {wname} | {LABELS.get(sname, sname)} | {_mib(r['stored_bytes'])} | "
                f"{_x(w['ratio_vs_dcp'].get(sname))} | {r['save_s']:.3f} ({_x(rr.get('save_s'))}) | "
                f"{r['load_s']:.3f} ({_x(rr.get('load_s'))}) | {r['load_first_s']:.3f} "
                f"({_x(rr.get('load_first_s'))}) | {_mib(r['peak_rss_bytes'])} ({_x(rr.get('peak_rss_bytes'))}) | "
                f"{_mib(r['peak_rss_overhead_bytes'])} ({_x(rr.get('peak_rss_overhead_bytes'))}) | "
                f"{'yes' if r.get('load_bit_exact') else 'NO'} |")
        for sname, why in w.get("skipped", {}).items():
            lines.append(f"| {wname} | {LABELS.get(sname, sname)} | skipped | | | | | | | |")
        notes += _workload_notes(wname, w)
    for sname, why in results.get("skipped_systems", {}).items():
        notes.append(f"{sname} skipped: {why}")
    methods = sorted({r.get("peak_rss_method", "") for w in results["workloads"].values()
                      for r in w["systems"].values() if "error" not in r} - {""})
    caches = sorted({c for w in results["workloads"].values() for r in w["systems"].values()
                     for c in r.get("page_cache", [])})
    where = "each in its own subprocess" if cfg["isolate"] else "in the training process"
    notes.append(f"peak RSS: {', '.join(methods)}; systems run {where}; restic child's peak added to the Python "
                 f"process's baseline; page cache before loads: {', '.join(caches)}")
    notes.append(f"total {results.get('elapsed_s', 0)} s")
    lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _workload_notes(wname: str, w: dict) -> list[str]:
    info, notes = w.get("info", {}), []
    cfg = info.get("config", {})
    n_ckpt = len(next(iter(w["systems"].values())).get("cumulative_bytes", [])) if w["systems"] else 0
    head = f"{wname}: {n_ckpt} checkpoints every {cfg.get('interval')} steps"
    if "num_params" in info:
        head += f", {info['num_params'] / 1e6:.2f}M params"
    if "state_bytes" in info:
        head += f", {_mib(info['state_bytes'])} MiB per checkpoint"
    if info.get("losses"):
        head += f", loss {info['losses'][0]} -> {info['losses'][-1]}"
    notes.append(head + f" ({w.get('elapsed_s')} s)")
    if "adapter_only_total_bytes" in info:
        notes.append(f"{wname}: {info.get('frozen_fraction', 0):.1%} of params frozen; ideal adapter-only saves "
                     f"(trainable params + their optimizer state): {_mib(info['adapter_only_bytes_per_checkpoint'])} "
                     f"MiB per checkpoint, {_mib(info['adapter_only_total_bytes'])} MiB total = "
                     f"{_x(info['adapter_only_ratio_vs_dcp'])} vs DCP")
    based = {s: r for s, r in w["systems"].items() if "base_stored_bytes" in r}
    if based:
        rel, vs_ideal = w.get("relative_to_dcp", {}), info.get("stored_vs_adapter_only", {})
        notes.append(f"{wname}: the base model was saved first as checkpoint `base` (not counted above): "
                     + "; ".join(f"{s} {_mib(r['base_stored_bytes'])} MiB in {r['base_save_s']:.2f} s, then the "
                                 f"checkpoints added {_x(vs_ideal.get(s))} the adapter-only bytes, first save "
                                 f"{r['save_s_per_checkpoint'][0]:.3f} s ({_x(rel.get(s, {}).get('first_save_s'))} DCP)"
                                 for s, r in based.items()))
    if "touched_ids_fraction" in info:
        fr = info["touched_ids_fraction"]
        notes.append(f"{wname}: embedding rows touched per interval {min(fr):.2%}..{max(fr):.2%} (ids looked up); "
                     f"rows whose weights changed {max(info['changed_rows_fraction']):.2%} max; "
                     f"<= {cfg.get('max_touched_fraction', 0.03):.0%}: {info.get('touched_fraction_ok')}")
    if "changed_weights_fraction" in info:
        fr = info["changed_weights_fraction"]
        notes.append(f"{wname}: bf16 weights changed per interval {min(fr):.2%}..{max(fr):.2%}")
    if "post_reshard_ratio_vs_dcp" in info:
        post = ", ".join(f"{s} {_mib(r['post_reshard_stored_bytes'])} MiB ({_x(info['post_reshard_ratio_vs_dcp'][s])})"
                         for s, r in w["systems"].items() if "post_reshard_stored_bytes" in r)
        notes.append(f"{wname}: saves after resuming on {cfg.get('ranks_after')} ranks: {post}; "
                     f"all systems resumed identical state: {info.get('resumed_identical')}; "
                     f"reshard load s: " + ", ".join(f"{s} {r['load_reshard_s']:.2f}"
                                                     for s, r in w["systems"].items() if "load_reshard_s" in r))
    return notes


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    cols = min(3, max(1, len(names)))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    styles = {"dcp": ("black", "o"), "deltackpt": ("tab:red", "s"), "zipnn": ("tab:blue", "^"),
              "restic": ("tab:green", "D")}
    extra_colors = ["tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
    for ax, wname in zip(axes.flat, names):
        w = results["workloads"][wname]
        variant = 0
        for sname, r in w["systems"].items():
            if "error" in r or not r.get("cumulative_bytes"):
                continue
            ys = [b / MiB for b in r["cumulative_bytes"]]
            if sname in styles:
                (color, marker), ls = styles[sname], "-"
            else:  # deltackpt variants
                color, marker, ls = extra_colors[variant % len(extra_colors)], "x", "--"
                variant += 1
            ax.plot(range(1, len(ys) + 1), ys, marker=marker, ms=4, color=color, ls=ls,
                    label=f"{LABELS.get(sname, sname)} ({_x(w['ratio_vs_dcp'].get(sname))})")
        info = w.get("info", {})
        if "adapter_only_bytes_per_checkpoint" in info:
            n = len(w["systems"]["dcp"]["cumulative_bytes"])
            per = info["adapter_only_bytes_per_checkpoint"] / MiB
            ax.plot(range(1, n + 1), [per * (i + 1) for i in range(n)], ls="--", color="gray",
                    label="ideal adapter-only")
        if "post_reshard_first_index" in info:
            ax.axvline(info["post_reshard_first_index"] + 0.5, color="gray", ls=":", lw=1)
            ax.text(info["post_reshard_first_index"] + 0.6, ax.get_ylim()[1] * 0.02, "2 -> 3 ranks",
                    fontsize=8, color="gray")
        ax.set_title(wname)
        ax.set_xlabel("checkpoint")
        ax.set_ylabel("cumulative stored MiB")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("Cumulative stored bytes per checkpoint (ratio vs DCP in the legend)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    (out / "results.md").write_text(markdown(results))
    plot(results, out / "cumulative_bytes.png")

"""How small can 10 checkpoints get? Entropy and zstd bounds on keyframe and delta coding (issue 5).

Usage:
  python benchmarks/delta_bounds.py [--workloads sparse,bf16,dense] [--size full|quick|tiny]
                                    [--l19-every 8] [--chunk-kib 4096] [--no-store] [--json PATH] [-v]

Method. Each workload of ``deltackpt bench`` is trained once (same seeds, one torch thread) and its 10
checkpoints are saved into DCP FileSystemWriter and a default deltackpt store through the bench's own
``run_inprocess`` (so "measured" is what ``deltackpt bench`` reports), while a copy of every tensor's bytes is
kept. Tensors are grouped as ``weights`` (model), ``exp_avg``, ``exp_avg_sq``, ``other`` (``:emb`` / ``:mlp``
for the sparse workload) and cut, like the store, into 4 MiB chunks (``--chunk-kib``). For every chunk and
every pair of checkpoints j <= k it measures the byte planes of the keyframe (j == k: the chunk itself) or
of the delta (chunk_k XOR chunk_j): order-0 Shannon entropy per plane (``H0``: bits/byte x bytes, summed
over planes); a sparsity-aware variant (``HS``: a mask of the non-zero elements at its binary entropy plus
H0 over the non-zero elements only, what a row-sparse coder needs); zstd level 1 (the store's codec) and
level 19. Level 19 is slow (~4 MB/s), so it runs on every ``--l19-every``-th chunk of a group, only for
the keyframe and the deltas vs the previous and the first checkpoint; elsewhere it is estimated as zstd-1
x the group's measured level-19/level-1 ratio (keyframes and deltas apart). A chunk's cost for a coding
is the least of H0, HS, zstd-1 and zstd-19 (an optimistic choice; a chunk identical to an earlier one
costs 0, as the store dedups it). From these costs, per chunk, summed over the state:

  (i)   keyframe = first: checkpoint 1 stored whole, each later chunk min(keyframe, delta vs checkpoint 1)
        (the issue's rule with keyframe_interval 10 and no re-keyframing);
  (i*)  best keyframe placement under the rule: every set of keyframe checkpoints (first included) tried,
        each other chunk a delta vs the cheapest earlier keyframe (a new keyframe helps drifting tensors);
  (ii)  chained: each chunk min(keyframe, delta vs the previous checkpoint) - unbounded restore chains,
        which the issue forbids; for contrast;
  (iii) any base: each chunk min(keyframe, delta vs any earlier checkpoint) - a floor under (i), (i*), (ii).

Reading the result: ratio = DCP stored bytes (10 checkpoints, measured) / bound bytes. If even (i*) is
below the target, no store obeying the rule with a per-chunk byte-plane coder of this strength reaches it;
the per-group table shows which tensors eat the budget (e.g. Adam moments that change in every element,
with high-entropy low planes, cost a keyframe-sized delta each time). H0 is the order-0 entropy: a coder
with context (across planes, rows or checkpoints) can do better, so these are bounds for this coder family,
not for every conceivable one. Checkpoint manifests and DCP metadata are not in the bounds. The bounds
depend on the chunk size (``--chunk-kib``, also given to the measured store; default 4 MiB): a smaller chunk
lets a scattered update (sparse rows) leave more chunks untouched, so (i*) moves towards (ii), at the
price of more chunk references per checkpoint (which the measured store does pay).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deltackpt import kernels  # noqa: E402
from deltackpt.bench.runner import run_inprocess, with_ratios  # noqa: E402
from deltackpt.bench.workloads import make_workload  # noqa: E402
from deltackpt.dcp.placement import tensor_bytes  # noqa: E402
from deltackpt.store.config import StoreConfig  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1 << 20
CHUNK = StoreConfig().chunk_size_bytes
TARGETS = {"sparse": 20.0, "bf16": 4.0}
BOUNDS = {"i": "(i) keyframe = first", "i*": "(i*) best keyframe placement", "ii": "(ii) chained (not allowed)",
          "iii": "(iii) any earlier base (floor)"}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def group_of(path: list[str], split_emb: bool) -> str:
    kind = "weights" if path[0] == "model" else path[-1] if path[-1] in ("exp_avg", "exp_avg_sq") else "other"
    if split_emb and kind != "other":
        kind += ":emb" if any(p.startswith("emb.") for p in path) else ":mlp"
    return kind


def flatten(state, split_emb: bool, path=()) -> dict[str, tuple[str, int, np.ndarray]]:
    """{key: (group, elem_size, a private copy of the tensor's bytes)} for every non-empty tensor."""
    if isinstance(state, torch.Tensor):
        if not state.numel():
            return {}
        _, raw, es = tensor_bytes(state)
        return {".".join(path): (group_of(list(path), split_emb), es, raw.copy())}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {k: v for key, sub in items for k, v in flatten(sub, split_emb, (*path, str(key))).items()}


def _h(counts: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of a histogram."""
    p = counts[counts > 0] / counts.sum()
    return max(0.0, float(-(p * np.log2(p)).sum())) if len(p) else 0.0


def plane_entropy(planes: np.ndarray, es: int) -> tuple[np.ndarray, float, float]:
    """(bits/byte of each byte plane, H0 bytes of all planes, HS bytes), each plus the odd tail's raw bytes.

    HS: a sparsity-aware order-0 bound: a bit mask of the non-zero elements at its binary entropy, plus the
    order-0 entropy of each plane over the non-zero elements only (the bytes a row/element-sparse coder needs).
    """
    m, tail = len(planes) // es, len(planes) % es
    p2 = planes[:m * es].reshape(es, m)
    bits = np.array([_h(np.bincount(p2[j], minlength=256)) for j in range(es)])
    nz = (p2 != 0).any(0)
    cnt = int(nz.sum())
    hs = m * _h(np.array([cnt, m - cnt]))
    if cnt:
        hs += cnt * sum(_h(np.bincount(row, minlength=256)) for row in p2[:, nz])
    return bits, float(bits.sum() * m / 8 + tail), float(hs / 8 + tail)


def measure_chunk(views: list[np.ndarray], es: int, l19: bool, z1, z19) -> dict[str, np.ndarray]:
    """Sizes for every pair j <= k of one chunk's versions: [k, k] keyframe, [k, j] delta vs j (NaN: not run)."""
    n = len(views)
    out = {"h0": np.zeros((n, n)), "hs": np.zeros((n, n)), "z1": np.zeros((n, n)), "z19": np.full((n, n), np.nan),
           "changed": np.zeros((n, n)), "bits": np.zeros((n, n, es))}
    for k in range(n):
        for j in range(k + 1):
            planes = kernels.shuffle(views[k], es) if j == k else kernels.xor_shuffle(views[k], views[j], es)
            out["bits"][k, j], out["h0"][k, j], out["hs"][k, j] = plane_entropy(planes, es)
            out["z1"][k, j] = len(z1.compress(planes))
            if l19 and j in (k, k - 1, 0):
                out["z19"][k, j] = len(z19.compress(planes))
            if j < k:
                out["changed"][k, j] = np.count_nonzero(views[k].view(UINT[es]) != views[j].view(UINT[es]))
    return out


@functools.cache
def _keyframe_sets(n: int) -> np.ndarray:
    """Every set of keyframe checkpoints that includes the first, as rows of a boolean matrix."""
    return np.array([[True] + [bool(m >> i & 1) for i in range(n - 1)] for m in range(2 ** (n - 1))])


def chunk_bounds(best: np.ndarray, same: np.ndarray) -> dict[str, float]:
    """The four totals of one chunk from its cost matrix (diagonal: keyframe, below: delta); ``same[k, j]``:
    version k repeats version j exactly, so the store deduplicates it (costs nothing)."""
    n = len(best)
    low = np.tri(n, k=-1, dtype=bool)
    d = np.where(low & same, 0.0, np.where(low, best, np.inf))
    key = np.where((low & same).any(1), 0.0, np.diag(best))
    masks = _keyframe_sets(n)
    cost = np.where(masks, key, 0.0).sum(1)
    for k in range(1, n):
        cost += np.where(masks[:, k], 0.0, np.where(masks[:, :k], d[k, :k], np.inf).min(1))
    rest = range(1, n)
    return {"i": key[0] + sum(min(key[k], d[k, 0]) for k in rest), "i*": float(cost.min()),
            "ii": key[0] + sum(min(key[k], d[k, k - 1]) for k in rest),
            "iii": key[0] + sum(min(key[k], d[k, :k].min()) for k in rest)}


def summarize_group(mine: list[tuple], n: int) -> dict:
    """Sums over a group's chunks ``(group, elem_size, nbytes, measure_chunk result)``, and its bounds."""
    tot = {f: sum(c[3][f] for c in mine) for f in ("h0", "hs", "z1", "changed")}
    diag, low = np.eye(n, dtype=bool), np.tri(n, k=-1, dtype=bool)
    rho = {}  # measured zstd-19 / zstd-1 over the chunks it ran on, keyframes and deltas apart
    for kind, sel in (("key", diag), ("delta", low)):
        ran = [(~np.isnan(c[3]["z19"])) & sel for c in mine]
        den = sum(c[3]["z1"][r].sum() for c, r in zip(mine, ran))
        rho[kind] = sum(c[3]["z19"][r].sum() for c, r in zip(mine, ran)) / den if den else 1.0
    bounds, tot["z19"] = dict.fromkeys(BOUNDS, 0.0), np.zeros((n, n))
    for *_, m in mine:
        z19 = np.where(np.isnan(m["z19"]), m["z1"] * np.where(diag, rho["key"], rho["delta"]), m["z19"])
        tot["z19"] += z19
        for b, v in chunk_bounds(np.minimum.reduce([m["h0"], m["hs"], m["z1"], z19]), m["changed"] == 0).items():
            bounds[b] += v
    es = max({c[1] for c in mine}, key=lambda e: sum(c[2] for c in mine if c[1] == e))  # the dominant one
    same = [c for c in mine if c[1] == es]
    plane = sum(c[3]["bits"] * (c[2] // es) for c in same) / sum(c[2] // es for c in same)
    elems, ks = sum(c[2] // c[1] for c in mine), np.arange(1, n)
    out = {"raw_bytes": sum(c[2] for c in mine), "num_chunks": len(mine), "elem_size": es,
           "zstd19_over_zstd1": rho, "bounds_bytes": bounds,
           "changed_vs_prev": (tot["changed"][ks, ks - 1] / elems).tolist(),
           "changed_vs_first": (tot["changed"][ks, 0] / elems).tolist(),
           "plane_bits_per_byte": {"key": plane[range(n), range(n)].mean(0).tolist(),
                                   "first": plane[ks, 0].mean(0).tolist(), "prev": plane[ks, ks - 1].mean(0).tolist()}}
    for f in ("h0", "hs", "z1", "z19"):
        out.update({f"key_{f}": np.diag(tot[f]).tolist(), f"first_{f}": tot[f][ks, 0].tolist(),
                    f"prev_{f}": tot[f][ks, ks - 1].tolist()})
    return out


def _git_state() -> str:
    """The code the measured store ran: ``git describe --always --dirty`` of this checkout, if any."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


class _Tap:
    """The workload as ``run_inprocess`` sees it, keeping a flat copy of each checkpoint on the way."""

    def __init__(self, wl, split_emb: bool) -> None:
        self.wl, self.dtype, self.split, self.ckpts = wl, wl.dtype, split_emb, []

    def checkpoints(self):
        for ck in self.wl.checkpoints():
            self.ckpts.append(flatten(ck.state, self.split))
            yield ck

    def base_state(self):
        return self.wl.base_state()


def analyze(name: str, size: str, l19_every: int = 8, store: bool = True, chunk: int = CHUNK,
            log=lambda msg: None) -> dict:
    t0 = time.perf_counter()
    wl = make_workload(name, size)
    tap = _Tap(wl, split_emb=name == "sparse")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as deltackpt bench trains
    try:
        if store:
            with tempfile.TemporaryDirectory(prefix="delta-bounds-") as tmp:
                opts = {"store_config": {"chunk_size_bytes": chunk} if chunk != CHUNK else {}}
                res = run_inprocess(tap, ["dcp", "deltackpt"], Path(tmp), opts, log)
            entry = with_ratios({"systems": res, "info": {}})
        else:
            for _ in tap.checkpoints():
                pass
    finally:
        torch.set_num_threads(threads)
    ckpts, n = tap.ckpts, len(tap.ckpts)
    log(f"  {name}: trained and saved {n} checkpoints ({time.perf_counter() - t0:.0f} s)")
    z1, z19 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=19)
    chunks, seen = [], {}
    for key, (group, es, raw) in ckpts[0].items():
        for s in range(0, len(raw), chunk):
            i = seen[group] = seen.get(group, -1) + 1
            m = measure_chunk([c[key][2][s:s + chunk] for c in ckpts], es, i % l19_every == 0, z1, z19)
            chunks.append((group, es, min(chunk, len(raw) - s), m))
    log(f"  {name}: {len(chunks)} chunks measured ({time.perf_counter() - t0:.0f} s)")
    order = ("weights", "exp_avg", "exp_avg_sq", "other")
    names = sorted({c[0] for c in chunks}, key=lambda g: (order.index(g.split(":")[0]), g))
    groups = {g: summarize_group([c for c in chunks if c[0] == g], n) for g in names}
    raw = sum(g["raw_bytes"] for g in groups.values())
    out = {"workload": name, "size": size, "num_checkpoints": n, "l19_every": l19_every, "chunk_bytes": chunk,
           "raw_state_bytes": raw, "dcp_bytes": n * raw, "dcp_measured": False,
           "groups": groups, "bounds_bytes": {b: sum(g["bounds_bytes"][b] for g in groups.values()) for b in BOUNDS}}
    if store:
        out.update(dcp_bytes=res["dcp"]["stored_bytes"], dcp_measured=True, deltackpt=res["deltackpt"],
                   measured_ratio=entry["ratio_vs_dcp"]["deltackpt"])
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    out["git"] = _git_state()
    out["bound_ratios"] = {b: out["dcp_bytes"] / v for b, v in out["bounds_bytes"].items()}
    return out


def report(r: dict) -> str:
    mb = lambda v: f"{v / MiB:.2f}"  # noqa: E731
    trip = lambda g, p, i=None: " / ".join(  # noqa: E731
        mb(np.mean(g[f"{p}_{f}"]) if i is None else g[f"{p}_{f}"][i]) for f in ("h0", "hs", "z1", "z19"))
    n, dcp, target = r["num_checkpoints"], r["dcp_bytes"], TARGETS.get(r["workload"])
    lines = [f"## {r['workload']} ({r['size']}): {n} checkpoints of {mb(r['raw_state_bytes'])} MiB; "
             f"DCP {'measured' if r['dcp_measured'] else f'{n} x raw'} {mb(dcp)} MiB; {r['chunk_bytes'] // 1024} KiB "
             f"chunks, zstd-19 run on 1 in {r['l19_every']} (else estimated)", "",
             "MiB per checkpoint, each cell H0 / HS / zstd-1 / zstd-19; means over checkpoints (deltas: 2..n)",
             "", "| group | raw | keyframe #1 | keyframe (mean) | delta vs first | delta vs prev | changed vs prev | "
             "changed vs first (mean, last) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, g in r["groups"].items():
        cf = g["changed_vs_first"]
        cells = [mb(g["raw_bytes"]), trip(g, "key", 0), trip(g, "key"), trip(g, "first"), trip(g, "prev"),
                 f"{np.mean(g['changed_vs_prev']):.2%}", f"{np.mean(cf):.2%}, {cf[-1]:.2%}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Order-0 entropy, bits per byte, of each byte plane (low byte first; means over checkpoints)", "",
              "| group | keyframe | delta vs first | delta vs prev |", "|---|---|---|---|"]
    for name, g in r["groups"].items():
        pb = g["plane_bits_per_byte"]
        lines.append(f"| {name} | " + " | ".join(" ".join(f"{b:.2f}" for b in pb[k]) for k in ("key", "first", "prev"))
                     + " |")
    lines += ["", f"MiB stored for all {n} checkpoints, per group and bound", "",
              "| group | " + " | ".join(BOUNDS.values()) + " |", "|---|" + "---:|" * len(BOUNDS)]
    for name, g in [*r["groups"].items(), ("**total**", r)]:
        lines.append(f"| {name} | " + " | ".join(mb(g["bounds_bytes"][b]) for b in BOUNDS) + " |")
    lines.append("")
    if target:
        lines.append(f"target {target:g}x => at most {mb(dcp / target)} MiB stored in all")
    for b, label in BOUNDS.items():
        ratio = r["bound_ratios"][b]
        verdict = "" if not target else ("  reaches the target" if ratio >= target else "  below the target")
        lines.append(f"bound {label}: {mb(r['bounds_bytes'][b])} MiB -> {ratio:.2f}x vs DCP{verdict}")
    if "measured_ratio" in r:
        lines.append(f"deltackpt measured ({r['deltackpt']['store_config']['chunk_size_bytes'] // 1024} KiB chunks, "
                     f"bench formula): {mb(r['deltackpt']['stored_bytes'])} MiB "
                     f"-> {r['measured_ratio']:.2f}x vs DCP (code: {r['git'] or 'unknown'})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="sparse,bf16,dense")
    ap.add_argument("--size", default="full", choices=("tiny", "quick", "full"))
    ap.add_argument("--l19-every", type=int, default=8, help="zstd-19 on every Nth chunk of a group (1: all)")
    ap.add_argument("--chunk-kib", type=int, default=CHUNK // 1024,
                    help="chunk size of the bounds and of the measured store (default: the store's default)")
    ap.add_argument("--no-store", action="store_true", help="skip the measured DCP / deltackpt saves")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.verbose else (lambda msg: None)
    results = {}
    for name in args.workloads.split(","):
        results[name] = analyze(name, args.size, args.l19_every, not args.no_store, args.chunk_kib * 1024, log)
        print(report(results[name]) + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())

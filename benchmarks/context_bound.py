"""A bound for any lossless coder that sees the previous checkpoint: the bf16 run's 10 checkpoints at the
empirical conditional entropy of each element given its own previous value (issue 21.4).

``delta_bounds.py`` bounds coders of byte planes (order-0 entropy per plane of a keyframe or an XOR delta).
This one is looser for a coder: the workload's state is trained once (``deltackpt bench``'s ``bf16`` run,
weights and AdamW moments in bf16), and per tensor group (weights, exp_avg, exp_avg_sq) it measures over
every element, with the element's 16-bit pattern as the symbol:

  H(new)        order-0 entropy of the checkpoint's values (what a keyframe costs at best, no context)
  H(new - old)  order-0 entropy of the integer difference from the previous checkpoint (the zdelta idea)
  H(new | old)  entropy of each value given the element's exact previous value (65,536 contexts)

H(new | old) is estimated from the joint histogram of ~20M pairs, which underestimates it (a context seen a
few times looks more predictable than it is), so the bound is optimistic: no coder that predicts an element
from its own history does better on average. Bound of the run = first checkpoint at H(new) + each later one
at H(new | old), summed over groups; ratio = the raw bytes of 10 checkpoints / that. The DCP bytes of
``deltackpt bench`` add ~0.6 % of metadata, which this leaves out.

Usage: python benchmarks/context_bound.py [--size full|quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltackpt.bench.workloads import make_workload  # noqa: E402

GROUPS = ("weights", "exp_avg", "exp_avg_sq")


def _entropy_bits(symbols: np.ndarray) -> float:
    """Order-0 entropy of ``symbols`` in bits per symbol."""
    _, counts = np.unique(symbols, return_counts=True)
    p = counts / symbols.size
    return float(-(p * np.log2(p)).sum())


def _group(path: tuple[str, ...]) -> str | None:
    if path[0] == "model":
        return "weights"
    return path[-1] if path[-1] in ("exp_avg", "exp_avg_sq") else None


def _bf16_words(state, path=()) -> dict[str, list[np.ndarray]]:
    """Each group's bf16 tensors as uint16 arrays, in a fixed order."""
    out: dict[str, list[np.ndarray]] = {g: [] for g in GROUPS}
    if isinstance(state, dict):
        for key in sorted(state, key=str):
            for g, arrays in _bf16_words(state[key], (*path, str(key))).items():
                out[g] += arrays
    elif isinstance(state, torch.Tensor) and state.dtype == torch.bfloat16 and path and _group(path):
        out[_group(path)].append(state.detach().contiguous().view(torch.int16).numpy().view(np.uint16).ravel().copy())
    return out


def measure(size: str) -> dict:
    words = [{g: np.concatenate(a) for g, a in _bf16_words(ck.state).items()}
             for ck in make_workload("bf16", size).checkpoints()]
    per_group, total_raw, total_bound = {}, 0, 0.0
    for g in GROUPS:
        n = words[0][g].size
        first = _entropy_bits(words[0][g])
        delta, cond = [], []
        for old, new in zip(words, words[1:]):
            o, x = old[g].astype(np.uint32), new[g].astype(np.uint32)
            delta.append(_entropy_bits((x - o) & 0xFFFF))
            cond.append(_entropy_bits((o << 16) | x) - _entropy_bits(o))
        bound_bytes = n * (first + sum(cond)) / 8
        raw = 2 * n * len(words)
        per_group[g] = {"elements": n, "h_new_bits": round(first, 3), "h_diff_bits": [round(h, 3) for h in delta],
                        "h_new_given_old_bits": [round(h, 3) for h in cond], "bound_mib": round(bound_bytes / 2**20, 1),
                        "ratio": round(raw / bound_bytes, 3)}
        total_raw += raw
        total_bound += bound_bytes
    return {"size": size, "checkpoints": len(words), "groups": per_group, "raw_mib": round(total_raw / 2**20, 1),
            "bound_mib": round(total_bound / 2**20, 1), "ratio": round(total_raw / total_bound, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", choices=["full", "quick"])
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.size)
    for g, r in result["groups"].items():
        print(f"{g:>11}: H(new) {r['h_new_bits']:.2f} bits, H(new-old) {min(r['h_diff_bits']):.2f}-"
              f"{max(r['h_diff_bits']):.2f}, H(new|old) {min(r['h_new_given_old_bits']):.2f}-"
              f"{max(r['h_new_given_old_bits']):.2f} -> {r['bound_mib']} MiB ({r['ratio']:.2f}x)")
    print(f"10 checkpoints: {result['raw_mib']} MiB raw, bound {result['bound_mib']} MiB = {result['ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

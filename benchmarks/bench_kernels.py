"""Throughput of deltackpt.kernels on both backends (single thread).

Prints one JSON object to stdout:
    {"backend_native_available": bool, "live_backend": str, "results": [...],
     "targets": {...}, "targets_met": bool}

Each result: {"kernel", "backend", "elem_size", "bytes", "seconds", "gb_per_s"}, where
bytes is the logical buffer size (one input), gb_per_s = bytes / best time / 1e9.
Shuffle-family kernels write into a preallocated ``out`` (the hot-path usage), so
page-faulting a fresh output is not measured. The numpy backend is measured on a
smaller buffer for FastCDC (it is slow); targets apply to the native backend.

Usage: python benchmarks/bench_kernels.py [--size-mib 64] [--repeat 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltackpt import kernels  # noqa: E402

SHUFFLE_KERNELS = ("shuffle", "unshuffle", "xor_shuffle", "unshuffle_xor", "zigzag_shuffle", "unshuffle_zigzag")
SPARSE_KERNELS = ("sparse_split", "sparse_merge")
SPARSE_DENSITY = 0.1  # nonzero bytes in the plane: an XOR delta's sign+exponent plane is about this
SHUFFLE_TARGET_GBPS = 4.0
FASTCDC_TARGET_GBPS = 1.0
FASTCDC_PARAMS = (16 << 10, 64 << 10, 256 << 10)
TARGET_ELEM_SIZES = (2, 4)


def best_time(fn, repeat: int) -> float:
    fn()  # warm-up (page faults, caches)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


PIPELINE_TARGETS = {"encode_keyframe": 1.0, "encode_delta": 1.0, "decode_keyframe": 1.5, "decode_delta": 1.5,
                    "encode_zdelta": 1.0, "decode_zdelta": 2.0}
# zdelta (zigzag difference) against delta (XOR): the same fused kernel shape, so the same speed is the bar.


def adam_states(n: int, steps: int = 30, interval: int = 10, seed: int = 0):
    """exp_avg_sq of a simulated Adam run: (state at step `steps`, state `interval` steps later), fp32."""
    rng = np.random.default_rng(seed)
    v = np.zeros(n, np.float32)
    snaps = []
    for t in range(1, steps + interval + 1):
        g = (rng.standard_normal(n, dtype=np.float32) * 1e-2).astype(np.float32)
        v = (0.999 * v + 0.001 * g * g).astype(np.float32)
        if t in (steps, steps + interval):
            snaps.append(v.copy())
    return snaps


def bf16_finetune_states(n: int, seed: int = 0):
    """bf16 weights (as uint16) before and after a fine-tuning interval: an update of ~0.1 % of each weight,
    which moves about a quarter of the bf16 values by a unit or so of their last place."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
    moved = (w + rng.standard_normal(n, dtype=np.float32) * 2e-5).astype(np.float32)

    def to_bf16(x):  # round to nearest even, as torch does
        u = x.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    return to_bf16(w), to_bf16(moved)


def bench_sparse_planes(size_mib: float, repeat: int) -> list[dict]:
    """Delta coding of bf16 fine-tuning weights with zero-sparse planes on (the default) and off."""
    from deltackpt.store import codec, planes

    chunk = 1 << 20
    old, new = bf16_finetune_states(int(size_mib * (1 << 20)) // 2)
    old_b, new_b = old.view(np.uint8), new.view(np.uint8)
    spans = [(i, min(i + chunk, new_b.size)) for i in range(0, new_b.size, chunk)]
    default = planes.SPARSE_MAX_DENSITY
    out = []
    try:
        for label, density in (("on", default), ("off", -1.0)):
            planes.SPARSE_MAX_DENSITY = density
            enc = lambda: [codec.encode_delta(new_b[s:e], old_b[s:e], 2, 1) for s, e in spans]  # noqa: E731
            blobs = [bytes(b) for b in enc()]
            dec = lambda blobs=blobs: [codec.decode(codec.DELTA, b, e - s, 2, old_b[s:e])  # noqa: E731
                                       for (s, e), b in zip(spans, blobs)]
            assert all(bytes(d) == new_b[s:e].tobytes() for (s, e), d in zip(spans, dec()))
            for name, fn in (("encode_delta_bf16", enc), ("decode_delta_bf16", dec)):
                t = best_time(fn, max(1, min(repeat, 3)))
                out.append({"kernel": f"{name}[sparse planes {label}]", "backend": kernels.BACKEND, "elem_size": 2,
                            "bytes": new_b.size, "seconds": round(t, 6), "gb_per_s": round(new_b.size / t / 1e9, 3),
                            "ratio": round(new_b.size / sum(len(b) for b in blobs), 3),
                            "changed_fraction": round(float(np.mean(old != new)), 3),
                            "workload": "bf16 weights, 1 MiB chunks, zstd level 1, one thread, no hashing"})
    finally:
        planes.SPARSE_MAX_DENSITY = default
    return out


def bench_pipeline(size_mib: float, repeat: int) -> list[dict]:
    """The whole per-chunk codec path on one core: hash + code (keyframe or delta), and decode + re-hash."""
    from deltackpt.store import codec
    from deltackpt.store.chunking import chunk_id_of

    chunk = 1 << 20
    n = int(size_mib * (1 << 20)) // 4
    old, new = adam_states(n)
    old_b, new_b = old.view(np.uint8), new.view(np.uint8)
    spans = [(i, min(i + chunk, new_b.size)) for i in range(0, new_b.size, chunk)]

    def enc_key():
        return [codec.encode_best(new_b[s:e], 4, 1, 0.03) for s, e in spans if chunk_id_of(new_b[s:e])]

    def enc_delta(kind=codec.DELTA):
        return [codec.encode_delta(new_b[s:e], old_b[s:e], 4, 1, kind) for s, e in spans
                if chunk_id_of(new_b[s:e])]

    # Stored as bytes, as a read returns them from a pack.
    keyframes = [(cod, bytes(blob)) for cod, blob in enc_key()]
    deltas = {kind: [bytes(blob) for blob in enc_delta(kind)] for kind in (codec.DELTA, codec.ZDELTA)}

    def dec_key():
        for (s, e), (cod, blob) in zip(spans, keyframes):
            chunk_id_of(codec.decode(cod, blob, e - s, 4))

    def dec_delta(kind=codec.DELTA):
        for (s, e), blob in zip(spans, deltas[kind]):
            chunk_id_of(codec.decode(kind, blob, e - s, 4, old_b[s:e]))

    out = []
    stored = {"encode_keyframe": sum(len(b) for _, b in keyframes),
              "encode_delta": sum(len(b) for b in deltas[codec.DELTA]),
              "encode_zdelta": sum(len(b) for b in deltas[codec.ZDELTA])}
    for name, fn in (("encode_keyframe", enc_key), ("encode_delta", enc_delta),
                     ("encode_zdelta", lambda: enc_delta(codec.ZDELTA)),
                     ("decode_keyframe", dec_key), ("decode_delta", dec_delta),
                     ("decode_zdelta", lambda: dec_delta(codec.ZDELTA))):
        t = best_time(fn, max(1, min(repeat, 3)))
        row = {"kernel": name, "backend": kernels.BACKEND, "elem_size": 4, "bytes": new_b.size,
               "seconds": round(t, 6), "gb_per_s": round(new_b.size / t / 1e9, 3),
               "workload": "fp32 Adam exp_avg_sq, 10 steps apart, 1 MiB chunks, zstd level 1, one thread"}
        key = name.replace("decode", "encode")
        row["ratio"] = round(new_b.size / stored[key], 3)
        out.append(row)
    _add_vs_xor(out)
    return out


def _add_vs_xor(rows: list[dict]) -> None:
    """Give each zdelta row its speed and ratio relative to the XOR delta row of the same run."""
    by_name = {r["kernel"]: r for r in rows}
    for r in rows:
        xor = by_name.get(r["kernel"].replace("zdelta", "delta"))
        if "zdelta" in r["kernel"] and xor is not None:
            r["speed_vs_xor"] = round(r["gb_per_s"] / xor["gb_per_s"], 3)
            r["ratio_vs_xor"] = round(r["ratio"] / xor["ratio"], 3)


def bench_delta_codecs_bf16(size_mib: float, repeat: int) -> list[dict]:
    """XOR and zigzag-difference deltas of bf16 fine-tuning weights (ulp-sized moves): speed and ratio."""
    from deltackpt.store import codec

    chunk = 4 << 20  # the store's default chunk size
    old, new = bf16_finetune_states(int(size_mib * (1 << 20)) // 2)
    old_b, new_b = old.view(np.uint8), new.view(np.uint8)
    spans = [(i, min(i + chunk, new_b.size)) for i in range(0, new_b.size, chunk)]
    out = []
    for kind, label in ((codec.DELTA, "delta"), (codec.ZDELTA, "zdelta")):
        enc = lambda kind=kind: [codec.encode_delta(new_b[s:e], old_b[s:e], 2, 1, kind) for s, e in spans]  # noqa: E731
        blobs = [bytes(b) for b in enc()]
        dec = lambda kind=kind, blobs=blobs: [codec.decode(kind, b, e - s, 2, old_b[s:e])  # noqa: E731
                                              for (s, e), b in zip(spans, blobs)]
        assert all(bytes(d) == new_b[s:e].tobytes() for (s, e), d in zip(spans, dec()))
        for name, fn in ((f"encode_{label}_bf16", enc), (f"decode_{label}_bf16", dec)):
            t = best_time(fn, max(1, min(repeat, 3)))
            out.append({"kernel": name, "backend": kernels.BACKEND, "elem_size": 2, "bytes": new_b.size,
                        "seconds": round(t, 6), "gb_per_s": round(new_b.size / t / 1e9, 3),
                        "ratio": round(new_b.size / sum(len(b) for b in blobs), 3),
                        "workload": "bf16 weights, ulp-sized moves, 4 MiB chunks, zstd level 1, one thread, no hashing"})
    _add_vs_xor(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=float, default=64, help="buffer size in MiB (default 64)")
    ap.add_argument("--repeat", type=int, default=5, help="repetitions, best is kept (default 5)")
    ap.add_argument("--numpy-fastcdc-mib", type=float, default=8, help="buffer size for numpy FastCDC (default 8)")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON result to PATH")
    ap.add_argument("--pipeline-mib", type=float, default=64, help="fp32 state size for the codec pipeline (default 64)")
    args = ap.parse_args(argv)

    nbytes = int(args.size_mib * (1 << 20))
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    # b: a "previous checkpoint" differing in low mantissa bytes, as in real deltas
    b = a.copy()
    b[::4] ^= rng.integers(0, 256, b[::4].size, dtype=np.uint8)
    out = np.empty(nbytes, dtype=np.uint8)
    out[...] = 0

    impls = [("numpy", kernels.numpy_impl)]
    if kernels.native_impl is not None:
        impls.insert(0, ("native", kernels.native_impl))

    results = []
    for backend, im in impls:
        for kernel in SHUFFLE_KERNELS:
            fn = getattr(im, kernel)
            for k in (1, 2, 4, 8):
                if kernel in ("shuffle", "unshuffle"):
                    call = lambda fn=fn, k=k: fn(a, k, out=out)  # noqa: E731
                else:
                    call = lambda fn=fn, k=k: fn(a, b, k, out=out)  # noqa: E731
                rep = args.repeat if backend == "native" else max(1, min(args.repeat, 3))
                t = best_time(call, rep)
                results.append(
                    {
                        "kernel": kernel,
                        "backend": backend,
                        "elem_size": k,
                        "bytes": nbytes,
                        "seconds": round(t, 6),
                        "gb_per_s": round(nbytes / t / 1e9, 3),
                    }
                )
        # A mostly-zero byte plane, as the high planes of an XOR delta are.
        plane = np.where(rng.random(nbytes) < SPARSE_DENSITY, a | 1, 0).astype(np.uint8)
        bitmap, vals = im.sparse_split(plane)
        for kernel, call in (("sparse_split", lambda im=im: im.sparse_split(plane)),
                             ("sparse_merge", lambda im=im, bitmap=bitmap, vals=vals: im.sparse_merge(
                                 bitmap, vals, nbytes, out=out))):
            t = best_time(call, args.repeat if backend == "native" else max(1, min(args.repeat, 3)))
            results.append({"kernel": kernel, "backend": backend, "elem_size": None, "bytes": nbytes,
                            "density": SPARSE_DENSITY, "seconds": round(t, 6), "gb_per_s": round(nbytes / t / 1e9, 3)})
        size = nbytes if backend == "native" else min(nbytes, int(args.numpy_fastcdc_mib * (1 << 20)))
        data = a[:size]
        rep = args.repeat if backend == "native" else max(1, min(args.repeat, 2))
        t = best_time(lambda im=im, data=data: im.fastcdc_cuts(data, *FASTCDC_PARAMS), rep)
        n_chunks = len(im.fastcdc_cuts(data, *FASTCDC_PARAMS))
        results.append(
            {
                "kernel": "fastcdc_cuts",
                "backend": backend,
                "elem_size": None,
                "bytes": size,
                "params": {"min_size": FASTCDC_PARAMS[0], "avg_size": FASTCDC_PARAMS[1], "max_size": FASTCDC_PARAMS[2]},
                "chunks": n_chunks,
                "seconds": round(t, 6),
                "gb_per_s": round(size / t / 1e9, 3),
            }
        )

    pipeline = bench_pipeline(args.pipeline_mib, args.repeat)
    results.extend(pipeline)
    results.extend(bench_sparse_planes(args.pipeline_mib, args.repeat))
    results.extend(bench_delta_codecs_bf16(args.pipeline_mib, args.repeat))

    checks = {}
    for r in pipeline:
        checks[r["kernel"]] = r["gb_per_s"] >= PIPELINE_TARGETS[r["kernel"]]
    if kernels.native_impl is not None:
        for r in results:
            if r["backend"] != "native":
                continue
            if r["kernel"] in SHUFFLE_KERNELS and r["elem_size"] in TARGET_ELEM_SIZES:
                checks[f"{r['kernel']}[{r['elem_size']}]"] = r["gb_per_s"] >= SHUFFLE_TARGET_GBPS
            elif r["kernel"] in SPARSE_KERNELS:
                checks[r["kernel"]] = r["gb_per_s"] >= SHUFFLE_TARGET_GBPS
            elif r["kernel"] == "fastcdc_cuts":
                checks["fastcdc_cuts"] = r["gb_per_s"] >= FASTCDC_TARGET_GBPS
    report = {
        "backend_native_available": kernels.native_impl is not None,
        "live_backend": kernels.BACKEND,
        "machine": {"python": platform.python_version(), "arch": platform.machine(), "numpy": np.__version__},
        "size_mib": args.size_mib,
        "repeat": args.repeat,
        "out_preallocated": True,
        "results": results,
        "targets": {
            "backend": "native",
            "shuffle_family_gb_per_s": SHUFFLE_TARGET_GBPS,
            "shuffle_family_elem_sizes": list(TARGET_ELEM_SIZES),
            "sparse_split_merge_gb_per_s": SHUFFLE_TARGET_GBPS,
            "fastcdc_cuts_gb_per_s": FASTCDC_TARGET_GBPS,
            "pipeline_gb_per_s": PIPELINE_TARGETS,
            "checks": checks,
        },
        "targets_met": bool(checks) and all(checks.values()),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

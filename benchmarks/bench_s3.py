"""deltackpt on S3 vs DCP's FsspecWriter/FsspecReader, against one moto server, in one run.

For each workload of ``deltackpt bench`` (dense, frozen, sparse, bf16; ``--size quick`` by default, the
``deltackpt bench --quick`` states) the same 10 checkpoints are saved by:

  deltackpt   dcp.save with DeltaStorageWriter into ``s3://bucket/<workload>/store`` (one store)
  dcp         dcp.save with FsspecWriter into ``s3://bucket/<workload>/dcp/<checkpoint>`` (defaults)
  tier        CheckpointManager(local dir, remote=s3://bucket/<workload>/tier): a local save, then a
              background upload of the new packs and the manifest
  local       CheckpointManager(local dir) with no remote: the plain local save the tier is held against

and measured:

  (a) bytes uploaded per checkpoint and in all: the growth of the objects under the system's prefix, listed
      after each save (deltackpt: packs, manifests, config; DCP: the checkpoint's files and .metadata)
  (b) save time of a changed checkpoint (median over checkpoints 2..10) and load time of the last one
      (median of 3, each into a fresh zero state, checked bit-exact) from S3, deltackpt / DCP
  (c) the time a save blocks the training loop with the tier vs a plain local save (medians); the upload
      is waited for (untimed) before the other systems save, so it never slows their measurements
  (d) ``deltackpt copy --all --json`` of the tier's 10-checkpoint local store to a new S3 prefix: bytes sent
      vs the source store's physical bytes (packs + manifests); the packs arrive byte for byte, each manifest
      is written anew for the destination (its encoding may differ by a few bytes)

Targets (issue 17): dense >= 1.4x and frozen >= 8x fewer bytes than DCP; save <= 0.8x, load <= 1.0x DCP's
time; tier-blocked <= local save. The moto server runs in a child process (its Python would otherwise share
the client's GIL); it keeps objects in memory and serves them far slower than S3, and the machine's other
load adds noise: read the ratios, not the seconds.

Usage:
  python benchmarks/bench_s3.py [--workloads dense,frozen,sparse,bf16] [--size quick|tiny]
                                [--json PATH] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

from deltackpt import DeltaSavePlanner, DeltaStorageReader, DeltaStorageWriter  # noqa: E402
from deltackpt.bench.runner import clone_tree, fresh_like, tree_equal  # noqa: E402
from deltackpt.bench.workloads import make_workload  # noqa: E402
from deltackpt.store import Store  # noqa: E402
from deltackpt.train import CheckpointManager  # noqa: E402

WORKLOADS = ("dense", "frozen", "sparse", "bf16")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
TARGETS = {"bytes_ratio": {"dense": 1.4, "frozen": 8.0}, "save_ratio": 0.8, "load_ratio": 1.0}
LOAD_REPEATS = 3


class MotoServer:
    """moto's ThreadedMotoServer on 127.0.0.1 and a free port, in a child process."""

    def __init__(self) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        code = ("import logging, time; logging.getLogger('werkzeug').setLevel(logging.ERROR); "
                "from moto.server import ThreadedMotoServer; "
                f"ThreadedMotoServer(ip_address='127.0.0.1', port={self.port}, verbose=False).start(); "
                "time.sleep(1e9)")
        self._proc = subprocess.Popen([sys.executable, "-c", code])
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **self.storage_options)
        for _ in range(300):
            try:
                self.fs.call_s3("list_buckets")
                return
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.1)
        raise RuntimeError("moto server did not start")

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"region_name": CREDENTIALS["AWS_DEFAULT_REGION"]}}

    def new_bucket(self) -> str:
        name = f"bench-{uuid.uuid4().hex[:10]}"
        self.fs.call_s3("create_bucket", Bucket=name)
        return name

    def prefix_bytes(self, prefix: str, *, under: tuple[str, ...] = ()) -> int:
        """Total size of the objects under ``prefix`` (``bucket/path``); ``under``: only these sub-folders."""
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return 0
        base = prefix.rstrip("/") + "/"
        return sum(int(info["size"]) for name, info in found.items()
                   if not under or any(name.startswith(base + u + "/") for u in under))

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait()


class Snapshot(Stateful):
    """The smallest Stateful a CheckpointManager saves: the workload's current state dict."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.step = 0
        self.optimizers: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state_dict) -> None:
        self.state = state_dict


def _timed(fn) -> float:
    # No step pays for flushing another one's dirty pages (as in `deltackpt bench`): write back first, untimed.
    os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _median(values) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def run_workload(name: str, size: str, server: MotoServer, bucket: str, tmp: Path) -> dict:
    opts = server.storage_options
    url = f"s3://{bucket}/{name}/store"
    dcp_prefix = f"{bucket}/{name}/dcp"
    Store.init(url, storage_options=opts)
    snap_tier, snap_local = Snapshot(), Snapshot()
    tier = CheckpointManager(str(tmp / name / "tier-local"), snap_tier, remote=f"s3://{bucket}/{name}/tier",
                             remote_storage_options=opts)
    local = CheckpointManager(str(tmp / name / "local"), snap_local)
    rows, last = [], None
    for ck in make_workload(name, size).checkpoints():
        row = {"checkpoint": ck.name}
        snap_local.state = snap_tier.state = ck.state
        # Alternate which of the two local saves goes first, so neither always follows the other's writes.
        first_local = len(rows) % 2 == 0
        if first_local:
            row["local_save_s"] = _timed(lambda: local.save(ck.step))
        row["tier_blocked_s"] = _timed(lambda: tier.save(ck.step))
        row["tier_upload_wait_s"] = _timed(tier.wait)
        if not first_local:
            row["local_save_s"] = _timed(lambda: local.save(ck.step))
        before = server.prefix_bytes(f"{bucket}/{name}/store")
        row["deltackpt_save_s"] = _timed(lambda: dcp.save(ck.state, planner=DeltaSavePlanner(), storage_writer=(
            DeltaStorageWriter(url, checkpoint_id=ck.name, storage_options=opts))))
        row["deltackpt_bytes"] = server.prefix_bytes(f"{bucket}/{name}/store") - before
        path = f"s3://{dcp_prefix}/{ck.name}"
        row["dcp_save_s"] = _timed(lambda: dcp.save(ck.state, storage_writer=FsspecWriter(path, **opts)))
        row["dcp_bytes"] = server.prefix_bytes(f"{dcp_prefix}/{ck.name}")
        rows.append(row)
        last = (ck.name, clone_tree(ck.state))
    tier.close()
    local.close()
    local_bytes = _physical(tmp / name / "local", ("packs", "manifests", "config"))

    name_last, ref = last
    loads = {"deltackpt": [], "dcp": []}
    exact = True
    for _ in range(LOAD_REPEATS):
        for system in loads:
            target = fresh_like(ref)
            reader = (DeltaStorageReader(url, name_last, storage_options=opts) if system == "deltackpt"
                      else FsspecReader(f"s3://{dcp_prefix}/{name_last}", **opts))
            loads[system].append(_timed(lambda: dcp.load(target, storage_reader=reader)))
            exact = exact and tree_equal(target, ref)

    copy = _copy_store(server, tmp / name / "tier-local", f"{bucket}/{name}/copy")
    changed = rows[1:]
    total = {k: sum(r[k] for r in rows) for k in ("deltackpt_bytes", "dcp_bytes")}
    out = {
        "workload": name, "checkpoints": rows, "bit_exact": exact,
        "deltackpt_bytes": total["deltackpt_bytes"], "dcp_bytes": total["dcp_bytes"], "local_store_bytes": local_bytes,
        "bytes_ratio": _ratio(total["dcp_bytes"], total["deltackpt_bytes"]),
        "changed_save_s": {s: _median([r[f"{s}_save_s"] for r in changed]) for s in ("deltackpt", "dcp")},
        "load_s": {s: _median(v) for s, v in loads.items()},
        "tier_blocked_s": _median([r["tier_blocked_s"] for r in changed]),
        "local_save_s": _median([r["local_save_s"] for r in changed]),
        "tier_upload_s": _median([r["tier_upload_wait_s"] for r in changed]),
        "copy": copy,
    }
    out["save_ratio"] = _ratio(out["changed_save_s"]["deltackpt"], out["changed_save_s"]["dcp"])
    out["load_ratio"] = _ratio(out["load_s"]["deltackpt"], out["load_s"]["dcp"])
    out["tier_ratio"] = _ratio(out["tier_blocked_s"], out["local_save_s"])
    return out


def _physical(root: Path, folders=("packs", "manifests")) -> int:
    return sum(f.stat().st_size for d in folders for f in (root / d).rglob("*") if f.is_file())


def _copy_store(server: MotoServer, src: Path, dst_prefix: str) -> dict:
    """`deltackpt copy --all --json` (the CLI, reaching moto through the standard AWS environment). The packs
    arrive byte for byte; each manifest is written anew for the destination (a few bytes may differ)."""
    dst = f"s3://{dst_prefix}"
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": server.endpoint,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "deltackpt", "copy", str(src), dst, "--all", "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"deltackpt copy failed ({proc.returncode}): {proc.stderr.strip()}")
    report = json.loads(proc.stdout)
    src_packs = _physical(src, ("packs",))
    dst_packs = server.prefix_bytes(dst_prefix, under=("packs",))
    dst_all = server.prefix_bytes(dst_prefix, under=("packs", "manifests"))
    return {"checkpoints": report["checkpoints"], "bytes_sent": report["bytes_sent"],
            "store_physical_bytes": _physical(src), "store_pack_bytes": src_packs, "dst_pack_bytes": dst_packs,
            "equal": report["bytes_sent"] == dst_all and dst_packs == src_packs, "seconds": report["seconds"]}


def _fmt_ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(results: list[dict]) -> str:
    mib = 1 << 20
    head = (f"{'workload':<8} {'dk MiB':>8} {'local':>8} {'dcp MiB':>8} {'bytes':>7} | {'dk save':>8} {'dcp save':>8} "
            f"{'save':>6} | {'dk load':>8} {'dcp load':>8} {'load':>6} | {'tier blk':>8} {'local':>7} {'tier':>6} "
            f"| {'copy: sent, store physical':>26}")
    lines = [head, "-" * len(head)]
    for r in results:
        c = r["copy"]
        lines.append(
            f"{r['workload']:<8} {r['deltackpt_bytes'] / mib:>8.2f} {r['local_store_bytes'] / mib:>8.2f} "
            f"{r['dcp_bytes'] / mib:>8.2f} "
            f"{_fmt_ratio(r['bytes_ratio']):>7} | {r['changed_save_s']['deltackpt']:>8.3f} "
            f"{r['changed_save_s']['dcp']:>8.3f} {_fmt_ratio(r['save_ratio']):>6} | {r['load_s']['deltackpt']:>8.3f} "
            f"{r['load_s']['dcp']:>8.3f} {_fmt_ratio(r['load_ratio']):>6} | {r['tier_blocked_s']:>8.3f} "
            f"{r['local_save_s']:>7.3f} {_fmt_ratio(r['tier_ratio']):>6} | "
            f"{c['bytes_sent']:>12} {c['store_physical_bytes']:>12} {'packs identical' if c['equal'] else 'DIFFER'}")
    lines.append("dk MiB: uploaded to S3; local: the same checkpoints' local store (packs, manifests, config); "
                 "bytes: DCP/deltackpt uploaded (10 checkpoints); save: deltackpt/DCP, median changed checkpoint; "
                 "load: deltackpt/DCP, last checkpoint; tier: blocked/local save (medians, seconds)")
    per = "; ".join(f"{r['workload']} " + " ".join(f"{x['deltackpt_bytes'] / mib:.2f}/{x['dcp_bytes'] / mib:.2f}"
                                                   for x in r["checkpoints"]) for r in results)
    lines.append(f"per checkpoint MiB (deltackpt/DCP): {per}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--size", default="quick", choices=("tiny", "quick", "full"))
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--tmp", metavar="DIR", help="where the local stores go (default: a temp directory)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    server = MotoServer()
    start = time.perf_counter()
    results = []
    try:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            bucket = server.new_bucket()
            for name in args.workloads.split(","):
                results.append(run_workload(name, args.size, server, bucket, Path(tmp)))
                print(f"{name}: done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    finally:
        server.stop()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "targets": TARGETS, "cpu_count": os.cpu_count(),
                                               "seconds": time.perf_counter() - start, "results": results}, indent=1))
    return 0 if all(r["bit_exact"] and r["copy"]["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

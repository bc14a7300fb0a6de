"""How a host's index cache catches up with a commit it missed, on S3 (a moto server in a child process):
through the commit's record (one GET) vs a listing of every pack (a LIST request per 1,000 packs).

On a job of many hosts, every host but the coordinator's missed the last commit at every save. For stores
of ``--packs`` packs (each save of a long many-rank run adds one per rank): a store is built locally and
uploaded, a cache on "host A" indexes it (commit c0), a second host commits c1 (64 new packs, as a save
of 64 ranks adds), and copies of host A's cache catch up to c1 both ways, interleaved, ``--repeats`` times:
through the record (which holds the new packs' tables) or through a listing and a read of each new pack's
table. Reported: median seconds and requests (LIST pages, GETs) per catch-up, and their ratio. Then a host with an empty cache (a spare that took
over a dead node's work) builds its index from every pack's table, reading them one at a time,
``REMOTE_TABLE_THREADS`` at once, and from the commit log's copies (one run each), through a proxy that delays
every request by
``--latency-ms`` (object storage's per-request latency; the moto server on this machine has next to none, and
its CPU is the bound).

``--log-memory 50,200`` measures instead (in process, no server) the peak Python memory (tracemalloc) of an
empty cache built from the commit log of that many commits of 2,000 new 4 KiB chunks each: it stays flat
when the log is indexed record by record, and grew by the log's 64 bytes a chunk when it was read whole.

Usage:
  python benchmarks/bench_catch_up.py [--packs 1000,4000] [--repeats 3] [--latency-ms 20] [--json PATH]
  python benchmarks/bench_catch_up.py --log-memory 50,200
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the fault proxy of the object-storage tests

from bench_s3 import MotoServer  # noqa: E402
from s3_faults import FaultProxy  # noqa: E402
from deltackpt.store import MemoryBackend, Store, commitlog  # noqa: E402
from deltackpt.store import reindex as reindex_mod  # noqa: E402
from deltackpt.store import threads as threads_mod  # noqa: E402
from deltackpt.store.fsspec_backend import FsspecBackend  # noqa: E402

CHUNK = 4096
NEW_PACKS = 64  # packs commit c1 adds, as a save of 64 ranks does


class CountingBackend(FsspecBackend):
    """Counts the requests that matter here: LIST pages (1,000 keys each) and whole or ranged GETs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: Counter = Counter()

    def list(self, prefix=""):
        infos = list(super().list(prefix))
        self.requests["list pages"] += max(1, -(-len(infos) // 1000))
        return iter(infos)

    def get(self, key):
        self.requests["gets"] += 1
        return super().get(key)

    def get_range(self, key, offset, length):
        self.requests["gets"] += 1
        return super().get_range(key, offset, length)


def _build(server: MotoServer, num_packs: int, tmp: Path) -> tuple[str, Path]:
    """An S3 store of ``num_packs`` one-chunk packs (checkpoint c0), and a cache that indexed it."""
    local = tmp / f"local-{num_packs}"
    store = Store.init(local, chunk_size_bytes=CHUNK, pack_target_bytes=CHUNK)
    data = np.random.default_rng(num_packs).integers(0, 256, num_packs * CHUNK, dtype=np.uint8)
    store.save("c0", {"x": data})
    url = f"s3://{server.new_bucket()}/run"
    for path in sorted(local.rglob("*")):
        rel = path.relative_to(local)
        if path.is_file() and rel.parts[0] != "cache":
            server.fs.pipe_file(f"{url[len('s3://'):]}/{rel.as_posix()}", path.read_bytes())
    cache = tmp / f"cache-{num_packs}"
    Store.open(FsspecBackend(url, server.storage_options), cache_dir=cache).index_as_of("c0")
    other = tmp / f"other-{num_packs}"
    shutil.copytree(cache, other)
    changed = data.copy()
    fresh = np.random.default_rng(num_packs + 1).integers(0, 256, NEW_PACKS * CHUNK, dtype=np.uint8)
    for i in range(NEW_PACKS):  # a save of many ranks: a new pack per rank (here: a new keyframe chunk each)
        at = (i * num_packs // NEW_PACKS) * CHUNK
        changed[at:at + CHUNK] = fresh[i * CHUNK:(i + 1) * CHUNK]
    Store.open(FsspecBackend(url, server.storage_options), cache_dir=other).save("c1", {"x": changed})
    return url, cache


def _catch_up(server: MotoServer, url: str, cache: Path, tmp: Path, through_records: bool) -> tuple[float, dict]:
    host = tmp / "host"
    shutil.rmtree(host, ignore_errors=True)
    shutil.copytree(cache, host)
    backend = CountingBackend(url, server.storage_options)
    store = Store.open(backend, cache_dir=host)
    store._cache_index().has_seen("c0")  # open the cache before the clock starts
    backend.requests.clear()
    walk = commitlog.MAX_WALK
    commitlog.MAX_WALK = walk if through_records else 0  # 0: the records vouch for nothing, so a listing
    try:
        t0 = time.perf_counter()
        index = store.index_as_of("c1")
        elapsed = time.perf_counter() - t0
    finally:
        commitlog.MAX_WALK = walk
    assert index.has_seen("c1")
    return elapsed, dict(backend.requests)


def _fresh_index(endpoint: str, server: MotoServer, url: str, tmp: Path, threads: int, log: bool) -> float:
    """Seconds for a host with an empty cache to index every pack, reading ``threads`` tables at once, and
    with ``log`` the tables the commit log holds first."""
    cache = tmp / "fresh"
    shutil.rmtree(cache, ignore_errors=True)
    store = Store.open(FsspecBackend(url, {**server.storage_options, "endpoint_url": endpoint}), cache_dir=cache)
    saved = threads_mod.REMOTE_TABLE_THREADS, reindex_mod.LOGGED_TABLES_ABOVE
    threads_mod.REMOTE_TABLE_THREADS = threads
    reindex_mod.LOGGED_TABLES_ABOVE = saved[1] if log else 1 << 62
    try:
        t0 = time.perf_counter()
        store.index_as_of("c1")
        return time.perf_counter() - t0
    finally:
        threads_mod.REMOTE_TABLE_THREADS, reindex_mod.LOGGED_TABLES_ABOVE = saved


def _log_memory(commits: int, tmp: Path, per_commit: int = 2000) -> dict:
    """Peak traced memory of an empty cache indexing a store of ``commits`` commits from the commit log."""
    store = Store.init(MemoryBackend(), cache_dir=tmp / f"mem-{commits}", chunk_size_bytes=CHUNK,
                       pack_target_bytes=64 * CHUNK)
    rng = np.random.default_rng(commits)
    for k in range(commits):
        store.save(f"c{k}", {f"x{k}": rng.integers(0, 256, per_commit * CHUNK, dtype=np.uint8)})
    spare = Store.open(store.backend, cache_dir=tmp / f"spare-{commits}")
    tracemalloc.start()
    try:
        chunks = spare.index.num_chunks()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"commits": commits, "chunks": chunks, "peak_mib": peak / 2**20, "bytes_per_chunk": peak / chunks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packs", default="1000,4000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--log-memory", help="commits per store, comma-separated: measure memory instead (no server)")
    args = ap.parse_args(argv)
    if args.log_memory:
        with tempfile.TemporaryDirectory() as d:
            rows = [_log_memory(int(c), Path(d)) for c in args.log_memory.split(",")]
        for r in rows:
            print(f"{r['commits']:>5} commits, {r['chunks']} chunks: peak {r['peak_mib']:.1f} MiB "
                  f"({r['bytes_per_chunk']:.0f} B a chunk)", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    server = MotoServer()
    proxy = FaultProxy(server.port)
    proxy.set_faults(1.0, ("delay",), delay_s=args.latency_ms / 1000)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            for num_packs in (int(p) for p in args.packs.split(",")):
                url, cache = _build(server, num_packs, tmp)
                times = {True: [], False: []}
                requests = {}
                for _ in range(args.repeats):
                    for through_records in (True, False):
                        t, req = _catch_up(server, url, cache, tmp, through_records)
                        times[through_records].append(t)
                        requests[through_records] = req
                row = {"packs": num_packs, "record_s": statistics.median(times[True]),
                       "listing_s": statistics.median(times[False]),
                       "record_requests": requests[True], "listing_requests": requests[False]}
                row["ratio"] = row["record_s"] / row["listing_s"]
                threads = threads_mod.REMOTE_TABLE_THREADS
                row["fresh_serial_s"] = _fresh_index(proxy.endpoint, server, url, tmp, 1, log=False)
                row["fresh_parallel_s"] = _fresh_index(proxy.endpoint, server, url, tmp, threads, log=False)
                row["fresh_log_s"] = _fresh_index(proxy.endpoint, server, url, tmp, threads, log=True)
                rows.append(row)
                print(f"{num_packs:>6} packs: record {row['record_s']:.3f} s {requests[True]}, listing "
                      f"{row['listing_s']:.3f} s {requests[False]} -> {row['ratio']:.2f}x; empty cache: "
                      f"{row['fresh_serial_s']:.2f} s one table at a time, {row['fresh_parallel_s']:.2f} s "
                      f"{threads} at once, {row['fresh_log_s']:.2f} s from the commit log ({args.latency_ms:g} ms a request)",
                      flush=True)
    finally:
        proxy.stop()
        server.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Crash-safety stress: kill -9 a save / forget / gc loop hundreds of times and check the store after each.

A child process runs ``save`` in a loop over a LocalBackend store; after random saves it forgets old
checkpoints (``plan_forget(keep_last=3)``) or runs ``gc`` (grace 0). The parent kills it with SIGKILL after a
random delay (a share of the runs instead set ``DELTACKPT_CRASH_POINT`` to a random protocol step, so the
child kills itself exactly there). After every kill the parent checks:

* the store opens, ``verify_store(level=2)`` reports no problem;
* every checkpoint present loads bit-exact (contents are a pure function of the name);
* every checkpoint the child reported as committed, and did not start to forget, is present;
* every few kills: ``gc`` (grace 0) runs, after which no orphan pack is left and verify is still clean.

Prints one JSON line ``{"kills": N, "survived": M, "failures": [...], ...}``; exit status 1 if any failure.

The workload and the checks are ``deltackpt.testing``'s (``crash_loop``, ``check_store``, ``gc_and_check``).

    python benchmarks/stress_crash.py --kills 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LABELS = ["save:after-packs", "commit:before-index", "commit:after-index", "commit:before-manifest",
          "commit:after-manifest", "forget:before-delete", "gc:after-repack", "gc:before-delete"]
CHILD = ("import sys; from deltackpt.testing import crash_loop; "
         "crash_loop(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))")


def check(root: Path, expected, must_exist: set[str], run_gc: bool) -> list[str]:
    """Problems found (empty when the store is fine)."""
    from deltackpt.store import Store
    from deltackpt.store import index as index_mod
    from deltackpt.testing import check_store, gc_and_check

    store = Store.open(root)
    try:
        _, errors = check_store(store, expected, present=must_exist)
        if run_gc and not errors:
            errors = gc_and_check(store, expected, present=must_exist)
        return errors
    finally:
        index_mod._close_env(Path(store.cache_dir) / "index.lmdb")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-delay", type=float, default=1.2, help="kill within this many seconds of start")
    ap.add_argument("--label-share", type=float, default=0.2,
                    help="share of runs that crash at a random DELTACKPT_CRASH_POINT label instead")
    ap.add_argument("--gc-every", type=int, default=5, help="parent runs gc + recheck every N kills")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the store directory")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO_ROOT))
    from deltackpt.store import Store
    from deltackpt.store import index as index_mod
    from deltackpt.store.retention import set_tags
    from deltackpt.testing import SMALL_CONFIG, crash_items, expected_items, floats, read_loop_output

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rnd = random.Random(seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="deltackpt-stress-crash-"))
    root = work / "store"
    if root.exists():
        shutil.rmtree(root)
    store = Store.init(root, **SMALL_CONFIG)
    base = {"c0": crash_items(0), "c1": {"x": floats(77, 6000), "b": b"base checkpoint " * 100}}
    for name, items in base.items():
        store.save(name, items)
        set_tags(store, name, ["base"])  # never forgotten by the child's plan_forget
    index_mod._close_env(root / "cache" / "index.lmdb")
    expected = expected_items(base)

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("DELTACKPT_CRASH_POINT", None)

    committed: set[str] = set()
    maybe_forgotten: set[str] = set()
    failures, survived, commits, by_label = [], 0, 0, {}
    t0 = time.monotonic()
    for k in range(args.kills):
        label = rnd.choice(LABELS) if rnd.random() < args.label_share else None
        delay = rnd.uniform(0, args.max_delay)
        cenv = dict(env, DELTACKPT_CRASH_POINT=label) if label else env
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(1000 * (k + 1)),
                                 str(rnd.randrange(2**32))], cwd=REPO_ROOT, env=cenv, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            try:
                proc.wait(timeout=delay + (3.0 if label else 0.8))  # + interpreter start-up
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lines = out.splitlines(keepends=True)
        record = {"kill": k, "delay_s": round(delay, 3), "label": label,
                  "last": lines[-1].rstrip("\n") if lines else None}
        if proc.returncode != -signal.SIGKILL:
            record["error"] = f"child exited {proc.returncode}: {err[-1500:]}"
            failures.append(record)
            continue
        new, forgetting = read_loop_output(lines)
        committed |= new
        maybe_forgotten |= forgetting
        commits += len(new)
        if label:
            by_label[label] = by_label.get(label, 0) + 1
        try:
            errors = check(root, expected, set(base) | (committed - maybe_forgotten),
                           run_gc=(k + 1) % args.gc_every == 0)
        except Exception:  # noqa: BLE001
            errors = ["check raised: " + traceback.format_exc()[-2000:]]
        if errors:
            record["errors"] = errors
            failures.append(record)
        else:
            survived += 1
    result = {"kills": args.kills, "survived": survived, "failures": failures, "seed": seed,
              "commits_seen": commits, "label_kills": by_label,
              "elapsed_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(result))
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

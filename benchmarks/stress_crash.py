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

``--known-bugs expose`` (default) runs the full workload (tiny deltas, any chunk id, default ``max_unused``).
``--known-bugs avoid`` keeps it clear of two gc bugs found by this script and since fixed (chunk ids ending
in a NUL byte; all-live packs of small chunks "repacked" into themselves; see tests/store/test_gc.py), to
reproduce runs made before the fix.

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
import textwrap
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(chunk_size_bytes=4096, pack_target_bytes=65536, cdc_min_bytes=256, cdc_avg_bytes=1024,
             cdc_max_bytes=4096)
LABELS = ["save:after-packs", "commit:before-index", "commit:after-index", "commit:before-manifest",
          "commit:after-manifest", "forget:before-delete", "gc:after-repack", "gc:before-delete"]

DATA_SRC = textwrap.dedent(
    """
    import numpy as np
    import xxhash
    from deltackpt.store.chunking import cdc_spans

    CHUNK = 4096

    def _nul_free(b, spans):
        return not AVOID or all(xxhash.xxh3_128_digest(b[s:e])[-1] != 0 for s, e in spans)

    def _grid(b):
        return [(i, min(i + CHUNK, len(b))) for i in range(0, len(b), CHUNK)]

    def floats(seed, n):
        k = 0
        while True:
            x = np.random.default_rng([seed, k]).standard_normal(n).astype(np.float32)
            if _nul_free(x.tobytes(), _grid(x.tobytes())):
                return x
            k += 1

    W0 = floats(0, 8192)

    def _meta(i):
        k = 0
        while True:
            b = f"step={i} ".encode() * 40 + np.random.default_rng([i, k, 7]).bytes(1500)
            if _nul_free(b, cdc_spans(memoryview(b), 256, 1024, 4096)):
                return b
            k += 1

    def data(i):
        # w drifts (delta-coded against the previous keyframe), u is new each time, meta is a byte item;
        # every 7th checkpoint reuses an older u (dedup across checkpoints and across forgets)
        step = 50 if AVOID else 1000  # small deltas make all-live packs of tiny chunks (a known gc bug)
        k = 0
        while True:
            w = W0.copy()
            w[::step] = np.random.default_rng([i, k, 1]).standard_normal(w[::step].size).astype(np.float32)
            if _nul_free(w.tobytes(), _grid(w.tobytes())):
                break
            k += 1
        u = floats(10_000 + (i - i % 7 if i % 7 == 3 else i), 4096)
        return {"w": w, "u": u, "meta": _meta(i)}
    """
)

CHILD = textwrap.dedent(
    """
    import random, sys
    from deltackpt.store import Store
    from deltackpt.store.gc import plan_gc
    from deltackpt.store.retention import plan_forget
    store = Store.open(sys.argv[1])
    i, rnd = int(sys.argv[2]), random.Random(int(sys.argv[3]))
    print("ready", flush=True)
    while True:
        name = f"r{i}"
        print("saving", name, flush=True)
        store.save(name, data(i), metadata={"step": i})
        print("committed", name, flush=True)
        x = rnd.random()
        if x < 0.3:
            plan = plan_forget(store, keep_last=3)
            print("forgetting", *plan.forget, flush=True)
            plan.execute()
            print("forgot", flush=True)
        elif x < 0.5:
            print("gc", flush=True)
            plan_gc(store, grace_s=0, max_unused=MAX_UNUSED).execute()
            print("gc-done", flush=True)
        i += 1
    """
)


def _namespace(avoid: bool) -> dict:
    ns = {"AVOID": avoid}
    exec(DATA_SRC, ns)
    return ns


class Checker:
    def __init__(self, root: Path, ns: dict, base: dict, max_unused: float):
        self.root = root
        self.ns = ns
        self.base = base
        self.max_unused = max_unused
        self._cache: dict[str, dict] = {}

    def expected(self, name: str) -> dict:
        if name in self.base:
            return self.base[name]
        if name not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[name] = self.ns["data"](int(name[1:]))
        return self._cache[name]

    def check(self, must_exist: set[str], run_gc: bool) -> list[str]:
        """Problems found (empty when the store is fine)."""
        import numpy as np

        from deltackpt.store import Store
        from deltackpt.store.gc import plan_gc
        from deltackpt.store.lock import list_locks
        from deltackpt.store.verify import verify_store

        errors = []
        store = Store.open(self.root)
        names = set(store.checkpoint_names())
        if not must_exist <= names:
            errors.append(f"committed checkpoints missing: {sorted(must_exist - names)}")
        unknown = {n for n in names if n not in self.base and not (n[:1] == "r" and n[1:].isdigit())}
        if unknown:
            errors.append(f"unexpected checkpoints: {sorted(unknown)}")
        rep = verify_store(store, level=2)
        if not rep.ok:
            errors.append("verify: " + json.dumps([p.as_dict() for p in rep.problems])[:2000])
        for name in sorted(names - unknown):
            try:
                got = store.load(name)
            except Exception as e:  # noqa: BLE001
                errors.append(f"load {name}: {type(e).__name__}: {e}")
                continue
            exp = self.expected(name)
            if set(got) != set(exp):
                errors.append(f"load {name}: keys {sorted(got)} != {sorted(exp)}")
                continue
            for k, v in exp.items():
                g = got[k]
                same = (isinstance(v, np.ndarray) and isinstance(g, np.ndarray) and g.dtype == v.dtype
                        and g.shape == v.shape and g.tobytes() == v.tobytes()) or (
                        isinstance(v, bytes) and g == v)
                if not same:
                    errors.append(f"load {name}: item {k} differs")
        if run_gc and not errors:
            plan_gc(store, grace_s=0, max_unused=self.max_unused).execute()
            rep = verify_store(store, level=2)
            if not rep.ok:
                errors.append("verify after gc: " + json.dumps([p.as_dict() for p in rep.problems])[:2000])
            if rep.orphan_packs:
                errors.append(f"orphans left after gc: {rep.orphan_packs}")
            if list_locks(store.backend):
                errors.append(f"locks left after gc: {list_locks(store.backend)}")
            for name in names:
                try:
                    store.load(name)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"load {name} after gc: {type(e).__name__}: {e}")
        from deltackpt.store import index as index_mod

        index_mod._close_env(Path(store.cache_dir) / "index.lmdb")
        return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-delay", type=float, default=1.2, help="kill within this many seconds of start")
    ap.add_argument("--label-share", type=float, default=0.2,
                    help="share of runs that crash at a random DELTACKPT_CRASH_POINT label instead")
    ap.add_argument("--gc-every", type=int, default=5, help="parent runs gc + recheck every N kills")
    ap.add_argument("--known-bugs", choices=["avoid", "expose"], default="expose")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the store directory")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO_ROOT))
    from deltackpt.store import Store
    from deltackpt.store import index as index_mod
    from deltackpt.store.retention import set_tags

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rnd = random.Random(seed)
    avoid = args.known_bugs == "avoid"
    max_unused = 0.5 if avoid else 0.1
    ns = _namespace(avoid)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="deltackpt-stress-crash-"))
    root = work / "store"
    if root.exists():
        shutil.rmtree(root)
    store = Store.init(root, **SMALL)
    base = {"c0": ns["data"](0), "c1": {"x": ns["floats"](77, 6000), "b": b"base checkpoint " * 100}}
    for name, items in base.items():
        store.save(name, items)
        set_tags(store, name, ["base"])  # never forgotten by the child's plan_forget
    index_mod._close_env(root / "cache" / "index.lmdb")
    checker = Checker(root, ns, base, max_unused)

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("DELTACKPT_CRASH_POINT", None)
    child_src = f"AVOID = {avoid}\nMAX_UNUSED = {max_unused}\n" + DATA_SRC + CHILD

    committed: set[str] = set()
    maybe_forgotten: set[str] = set()
    failures, survived, commits, by_label = [], 0, 0, {}
    t0 = time.monotonic()
    for k in range(args.kills):
        label = rnd.choice(LABELS) if rnd.random() < args.label_share else None
        delay = rnd.uniform(0, args.max_delay)
        cenv = dict(env, DELTACKPT_CRASH_POINT=label) if label else env
        proc = subprocess.Popen([sys.executable, "-c", child_src, str(root), str(1000 * (k + 1)),
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
        lines = out.splitlines()
        record = {"kill": k, "delay_s": round(delay, 3), "label": label, "last": lines[-1] if lines else None}
        if proc.returncode != -signal.SIGKILL:
            record["error"] = f"child exited {proc.returncode}: {err[-1500:]}"
            failures.append(record)
            continue
        for line in lines:
            parts = line.split()
            if parts[:1] == ["committed"]:
                committed.add(parts[1])
                commits += 1
            elif parts[:1] == ["forgetting"]:
                maybe_forgotten.update(parts[1:])
        if label:
            by_label[label] = by_label.get(label, 0) + 1
        try:
            errors = checker.check(set(base) | (committed - maybe_forgotten), run_gc=(k + 1) % args.gc_every == 0)
        except Exception:  # noqa: BLE001
            errors = ["check raised: " + traceback.format_exc()[-2000:]]
        if errors:
            record["errors"] = errors
            failures.append(record)
        else:
            survived += 1
    result = {"kills": args.kills, "survived": survived, "failures": failures, "seed": seed,
              "known_bugs": args.known_bugs, "commits_seen": commits, "label_kills": by_label,
              "elapsed_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(result))
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

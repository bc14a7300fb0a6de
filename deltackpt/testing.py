"""Deterministic data and store checks shared by the tests and the stress scripts (restic's ``testing.go``).

Torch-free, like ``deltackpt.store``. Checkpoint contents are pure functions of their arguments, so a child
process that is killed in the middle of a save and the parent that checks the store afterwards agree on
what each checkpoint holds without passing any data between them:

* ``crash_items(i)`` is checkpoint ``r<i>`` of the crash workload; ``crash_loop`` is the child that saves
  ``r<first>``, ``r<first+1>``, ... forever, forgetting and collecting garbage at random in between;
* ``check_store`` and ``gc_and_check`` are what must hold after any crash: the store opens, verifies clean
  at level 2, every checkpoint loads bit-exact, and gc leaves no orphan and no lock behind.

The checks return problems as strings (empty: all is well) so a test can assert on them and a stress
script can count them.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Callable, Iterable, Mapping

import numpy as np

from .store import Store
from .store.gc import plan_gc
from .store.lock import list_locks
from .store.retention import plan_forget
from .store.verify import verify_store

# Small sizes so that modest data spans many chunks and many packs.
SMALL_CONFIG = dict(
    chunk_size_bytes=4096,
    pack_target_bytes=65536,
    cdc_min_bytes=256,
    cdc_avg_bytes=1024,
    cdc_max_bytes=4096,
)

_LOOP_NAME = re.compile(r"r(\d+)")


def floats(seed: int, n: int) -> np.ndarray:
    """``n`` standard-normal float32 values, a pure function of ``seed``."""
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


_W0 = floats(0, 8192)


def crash_items(i: int) -> dict:
    """The items of checkpoint ``r<i>`` of the crash workload (a new dict of new arrays on every call).

    ``w`` drifts from one fixed array (every 1000th value changes: tiny deltas against a keyframe), ``u`` is
    new each time except that every 7th checkpoint reuses the one of ``r<i-3>`` (dedup across checkpoints
    and across forgets), ``meta`` is a byte item that content-defined chunking cuts.
    """
    w = _W0.copy()
    w[::1000] = np.random.default_rng([i, 1]).standard_normal(w[::1000].size).astype(np.float32)
    u = floats(10_000 + (i - 3 if i % 7 == 3 else i), 4096)
    meta = f"step={i} ".encode() * 40 + np.random.default_rng([i, 7]).bytes(1500)
    return {"w": w, "u": u, "meta": meta}


def crash_loop(root: str, first: int, seed: int) -> None:
    """Save ``r<first>``, ``r<first+1>``, ... into the store at ``root`` until killed.

    After a save, at random (``seed``): forget all but the newest three (``plan_forget(keep_last=3)``; tag
    what must survive) or gc with no grace. Progress lines on stdout tell the parent what was committed and
    what may have been forgotten: ``ready``, ``saving r<i>``, ``committed r<i>``, ``forgetting <names>``,
    ``forgot``, ``gc``, ``gc-done``.
    """
    store = Store.open(root)
    rnd = random.Random(seed)
    print("ready", flush=True)
    i = first
    while True:
        name = f"r{i}"
        print("saving", name, flush=True)
        store.save(name, crash_items(i), metadata={"step": i})
        print("committed", name, flush=True)
        x = rnd.random()
        if x < 0.3:
            plan = plan_forget(store, keep_last=3)
            print("forgetting", *plan.forget, flush=True)
            plan.execute()
            print("forgot", flush=True)
        elif x < 0.5:
            print("gc", flush=True)
            plan_gc(store, grace_s=0).execute()
            print("gc-done", flush=True)
        i += 1


def read_loop_output(lines: Iterable[str]) -> tuple[set[str], set[str]]:
    """(checkpoints reported committed, checkpoints a forget was started on) from ``crash_loop``'s stdout,
    its lines with their ends (``splitlines(keepends=True)``): a line the kill cut short is left out (its name
    may be cut too; the checkpoint may still have committed, which the checks allow)."""
    committed, forgetting = set(), set()
    for line in lines:
        if not line.endswith("\n"):
            continue
        parts = line.split()
        if parts[:1] == ["committed"] and len(parts) == 2:
            committed.add(parts[1])
        elif parts[:1] == ["forgetting"]:
            forgetting.update(parts[1:])
    return committed, forgetting


def expected_items(base: Mapping[str, dict]) -> Callable[[str], dict | None]:
    """What checkpoint ``name`` holds: ``base[name]``, else ``crash_items(i)`` for ``r<i>``, else None."""

    @functools.lru_cache(maxsize=64)
    def loop_items(i: int) -> dict:
        return crash_items(i)

    def expected(name: str) -> dict | None:
        if name in base:
            return base[name]
        m = _LOOP_NAME.fullmatch(name)
        return loop_items(int(m.group(1))) if m else None

    return expected


def item_differences(expected: Mapping, got: Mapping) -> list[str]:
    """How a loaded checkpoint differs from ``expected``, bit-exact (keys, types, dtype, shape, bytes)."""
    if set(got) != set(expected):
        return [f"keys {sorted(got)} != {sorted(expected)}"]
    out = []
    for key, exp in expected.items():
        val = got[key]
        if isinstance(exp, np.ndarray):
            if not isinstance(val, np.ndarray):
                out.append(f"{key}: {type(val).__name__}, expected an array")
            elif val.dtype != exp.dtype or val.shape != exp.shape:
                out.append(f"{key}: {val.dtype}{list(val.shape)}, expected {exp.dtype}{list(exp.shape)}")
            elif val.tobytes() != np.ascontiguousarray(exp).tobytes():
                out.append(f"{key}: contents differ")
        elif not isinstance(val, bytes):
            out.append(f"{key}: {type(val).__name__}, expected bytes")
        elif val != bytes(exp):
            out.append(f"{key}: contents differ")
    return out


def check_store(store, expected: Callable[[str], dict | None], *, present: Iterable[str] = (),
                absent: Iterable[str] = ()):
    """(verify report, problems) of a store that may just have crashed.

    Problems: a checkpoint of ``present`` missing, one of ``absent`` there, one ``expected`` knows nothing of
    (None), verify at level 2 not clean and complete, a checkpoint that does not load bit-exact.
    """
    problems = []
    names = set(store.checkpoint_names())
    if set(present) - names:
        problems.append(f"committed checkpoints missing: {sorted(set(present) - names)}")
    if set(absent) & names:
        problems.append(f"checkpoints that must not exist: {sorted(set(absent) & names)}")
    unknown = {n for n in names if expected(n) is None}
    if unknown:
        problems.append(f"unexpected checkpoints: {sorted(unknown)}")
    report = verify_store(store, level=2)
    if not report.ok or not report.complete:
        problems.append(f"verify: {[p.as_dict() for p in report.problems]}"[:2000])
    if report.num_checkpoints != len(names):
        problems.append(f"verify saw {report.num_checkpoints} checkpoints, the store lists {len(names)}")
    for name in sorted(names - unknown):
        try:
            got = store.load(name)
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"load {name}: {type(e).__name__}: {e}")
            continue
        problems += [f"load {name}: {d}" for d in item_differences(expected(name), got)]
    return report, problems


def gc_and_check(store, expected: Callable[[str], dict | None], *, present: Iterable[str] = ()) -> list[str]:
    """Problems after ``gc`` (no grace) of a store that may just have crashed: besides ``check_store``'s,
    a lock left behind, an orphan pack left, or a second gc that still finds something to delete."""
    plan_gc(store, grace_s=0).execute()
    problems = []
    if list_locks(store.backend):  # the killed process's lock was stale and is gone
        problems.append(f"locks left after gc: {list_locks(store.backend)}")
    report, found = check_store(store, expected, present=present)
    problems += found
    if report.orphan_packs:
        problems.append(f"orphans left after gc: {report.orphan_packs}")
    again = plan_gc(store, grace_s=0)
    if again.delete_packs:
        problems.append(f"a second gc would delete {sorted(again.delete_packs)}")
    return problems

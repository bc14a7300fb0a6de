"""kill -9 at every labelled step of save / commit / forget / gc (DELTACKPT_CRASH_POINT), and at random
moments of a save/forget/gc loop: the store always opens, verifies clean at level 2, every committed
checkpoint loads bit-exact, and the leftovers are orphans that the next gc removes."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from deltackpt.store import Store
from deltackpt.store.gc import plan_gc
from deltackpt.store.lock import list_locks
from deltackpt.store.retention import plan_forget
from deltackpt.store.verify import verify_store

from store_helpers import REPO_ROOT, SMALL, assert_items_equal, pack_names, packs_of_checkpoint, subprocess_env

pytestmark = pytest.mark.timeout(180)

# Checkpoint contents, shared verbatim by this process and the children (exec'd in both), so the children
# need no data from us. (Chunk ids are kept clear of a trailing NUL byte, which once tripped gc; that is
# tested on its own in test_gc.py.)
DATA_SRC = textwrap.dedent(
    """
    import numpy as np
    import xxhash
    from deltackpt.store.chunking import cdc_spans

    CHUNK = 4096

    def _nul_free(b, spans):
        return all(xxhash.xxh3_128_digest(b[s:e])[-1] != 0 for s, e in spans)

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
        # w drifts from checkpoint to checkpoint (stored as deltas), u is new each time, meta is a byte item
        k = 0
        while True:
            w = W0.copy()
            w[::50] = np.random.default_rng([i, k, 1]).standard_normal(w[::50].size).astype(np.float32)
            if _nul_free(w.tobytes(), _grid(w.tobytes())):
                break
            k += 1
        return {"w": w, "u": floats(10_000 + i, 4096), "meta": _meta(i)}
    """
)
_ns: dict = {}
exec(DATA_SRC, _ns)
data, floats = _ns["data"], _ns["floats"]

GC = "plan_gc(store, grace_s=0, max_unused=0.5).execute()"
CHILD_PRELUDE = DATA_SRC + textwrap.dedent(
    """
    import sys
    from deltackpt.store import Store
    from deltackpt.store.gc import plan_gc
    from deltackpt.store.retention import plan_forget
    store = Store.open(sys.argv[1])
    """
)
ACTIONS = {
    "save": "store.save('new', data(9))",
    "forget": "plan_forget(store, keep_last=2).execute()",
    "gc": GC,
}
LABELS = {
    "save:after-packs": "save",
    "commit:before-index": "save",
    "commit:after-index": "save",
    "commit:before-manifest": "save",
    "commit:after-manifest": "save",
    "forget:before-delete": "forget",
    "gc:after-repack": "gc",
    "gc:before-delete": "gc",
}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A committed store: c0 (keyframes), c1 (deltas), mix (a pack half of which c2 reuses), dead, c2."""
    root = tmp_path_factory.mktemp("crash") / "template"
    store = Store.init(root, **SMALL)
    keep, junk = floats(501, 4096), floats(502, 8192)
    expected = {
        "c0": data(0),
        "c1": data(1),
        "mix": {"keep": keep, "junk": junk},
        "dead": {"d": floats(503, 6000)},
        "c2": {**data(2), "keep": keep},
    }
    for name, items in expected.items():
        store.save(name, items)
    assert len(packs_of_checkpoint(store, "mix")) == 1
    yield root, expected
    from deltackpt.store import index as index_mod

    index_mod._close_env(root / "cache" / "index.lmdb")


def _copy(template, tmp_path):
    src, expected = template
    root = tmp_path / "store"
    shutil.copytree(src, root, ignore=shutil.ignore_patterns("cache"))  # a new machine: no index cache
    return root, {k: dict(v) for k, v in expected.items()}


def _run_child(root, action: str, label: str | None) -> subprocess.CompletedProcess:
    env = subprocess_env()
    env.pop("DELTACKPT_CRASH_POINT", None)
    if label:
        env["DELTACKPT_CRASH_POINT"] = label
    return subprocess.run([sys.executable, "-c", CHILD_PRELUDE + ACTIONS[action], str(root)], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def check_store(root, expected: dict, *, present=(), absent=()):
    """Open, verify level 2, load every checkpoint bit-exact. Returns (store, report)."""
    store = Store.open(root)
    names = set(store.checkpoint_names())
    assert set(present) <= names, (present, names)
    assert not set(absent) & names, (absent, names)
    assert names <= set(expected), names
    r = verify_store(store, level=2)
    assert r.ok and r.complete, [p.as_dict() for p in r.problems]
    assert r.num_checkpoints == len(names)
    for name in names:
        assert_items_equal(expected[name], store.load(name))
    return store, r


def _gc_and_recheck(root, expected, names_before):
    store = Store.open(root)
    plan_gc(store, grace_s=0, max_unused=0.5).execute()
    assert list_locks(store.backend) == []  # the killed process's lock was stale and is gone
    store, r = check_store(root, expected, present=names_before)
    assert r.orphan_packs == []
    assert plan_gc(store, grace_s=0, max_unused=0.5).delete_packs == {}
    return store


@pytest.mark.parametrize("label", list(LABELS))
def test_kill_at_crash_point(template, tmp_path, label):
    root, expected = _copy(template, tmp_path)
    action = LABELS[label]
    if action == "gc":
        pre = Store.open(root)
        mix_pack = packs_of_checkpoint(pre, "mix").pop()
        dead_pack = packs_of_checkpoint(pre, "dead").pop()
        pre.forget(["mix", "dead"])
        del expected["mix"], expected["dead"]
    before = Store.open(root)
    names_before = set(before.checkpoint_names())
    packs_before = pack_names(before)

    proc = _run_child(root, action, label)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])

    expected["new"] = data(9)
    committed = label == "commit:after-manifest"
    store, r = check_store(root, expected, present=names_before | ({"new"} if committed else set()),
                           absent=() if committed else ("new",))
    new_packs = pack_names(store) - packs_before
    if action == "save":
        assert new_packs, "the save wrote packs before it was killed"
        if committed:
            assert r.orphan_packs == []
        else:  # everything the killed save wrote is an orphan
            assert set(r.orphan_packs) == new_packs
            assert any(i["stale"] for i in list_locks(store.backend))  # its shared lock, abandoned
    elif action == "forget":
        assert set(store.checkpoint_names()) == names_before  # killed before the first delete
        assert r.orphan_packs == []
    else:
        assert mix_pack in packs_before and dead_pack in packs_before
        if label == "gc:after-repack":  # dead packs went first (their space lets the repacks be written)
            assert mix_pack in r.orphan_packs and dead_pack not in pack_names(store)
            assert len(new_packs) == 1  # the repacked copy of mix's live half
        else:  # killed before the first delete, so before any repack
            assert dead_pack in r.orphan_packs and mix_pack in pack_names(store) and not new_packs
        assert set(r.orphan_packs) <= packs_before | new_packs

    if committed:
        names_before = names_before | {"new"}
    store = _gc_and_recheck(root, expected, names_before)
    if action == "forget":  # the interrupted forget can simply be run again
        plan_forget(store, keep_last=2).execute()
        left = set(store.checkpoint_names())
        assert left == {"dead", "c2"}
        _gc_and_recheck(root, expected, left)
    # and the store takes new checkpoints afterwards
    store = Store.open(root)
    store.save("after", data(10))
    assert_items_equal(data(10), store.load("after"))


def test_without_crash_point_the_child_completes(template, tmp_path):
    """Control: the same child exits 0 when no crash point is set (so -9 above really is the crash point)."""
    root, expected = _copy(template, tmp_path)
    proc = _run_child(root, "save", None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected["new"] = data(9)
    check_store(root, expected, present=set(expected))


# -- kill -9 at random moments ------------------------------------------------------------------------------------

LOOP = CHILD_PRELUDE + textwrap.dedent(
    f"""
    i = int(sys.argv[2])
    print("ready", flush=True)
    while True:
        name = f"r{{i}}"
        print("saving", name, flush=True)
        store.save(name, data(i))
        print("committed", name, flush=True)
        if i % 3 == 2:
            rs = [c.name for c in store.list_checkpoints() if c.name.startswith("r")]
            victims = rs[:-2]
            print("forgetting", *victims, flush=True)
            store.forget(victims)
            print("forgot", flush=True)
            {GC}
            print("gc-done", flush=True)
        i += 1
    """
)


def kill_loop_at(root, start: int, delay: float) -> tuple[int, list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(root), str(start)], cwd=REPO_ROOT,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", (line, proc.stderr.read()[-3000:] if proc.poll() is not None else "")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    return proc.returncode, out.splitlines()


def test_kill_at_random_moments(template, tmp_path):
    root, expected = _copy(template, tmp_path)
    seed = random.randrange(2**32)
    rnd = random.Random(seed)
    print("seed", seed)
    committed: set[str] = set()
    maybe_forgotten: set[str] = set()
    base = set(expected)
    kills = 10
    for k in range(kills):
        start = 100 * (k + 1)
        for i in range(start, start + 100):
            expected[f"r{i}"] = None  # placeholder: filled lazily below
        delay = rnd.uniform(0.0, 1.0)
        _, lines = kill_loop_at(root, start, delay)
        for line in lines:
            parts = line.split()
            if parts and parts[0] == "committed":
                committed.add(parts[1])
            elif parts and parts[0] == "forgetting":
                maybe_forgotten.update(parts[1:])
        store = Store.open(root)
        names = set(store.checkpoint_names())
        for n in names - base:
            expected[n] = data(int(n[1:]))
        must = base | (committed - maybe_forgotten)
        store, r = check_store(root, expected, present=must)
        if k % 2:
            _gc_and_recheck(root, expected, names)
    assert committed, "the loop never committed anything in ten runs"
    # finally: all leftovers are reclaimable and the store stays clean
    store = _gc_and_recheck(root, expected, set(Store.open(root).checkpoint_names()))
    assert verify_store(store, level=2).ok

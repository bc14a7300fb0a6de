"""kill -9 at every labelled step of save / commit / forget / gc (DELTACKPT_CRASH_POINT), at random moments
of a save/forget/gc loop, and in the middle of a large save: the store always opens, verifies clean at level
2, every committed checkpoint loads bit-exact, every pack file is whole, and the leftovers are orphans that
the next gc removes. The workload and the checks are deltackpt.testing's, shared with
benchmarks/stress_crash.py."""

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
from deltackpt.store.lock import list_locks
from deltackpt.store.pack import pack_bytes_ok, read_pack_entries
from deltackpt.store.retention import plan_forget, set_tags
from deltackpt.testing import check_store, crash_items, expected_items, floats, gc_and_check, read_loop_output

from store_helpers import REPO_ROOT, SMALL, assert_items_equal, pack_names, packs_of_checkpoint, subprocess_env

pytestmark = pytest.mark.timeout(180)

CHILD_PRELUDE = textwrap.dedent(
    """
    import sys
    from deltackpt.store import Store
    from deltackpt.store.gc import plan_gc
    from deltackpt.store.retention import plan_forget
    from deltackpt.testing import crash_items
    store = Store.open(sys.argv[1])
    """
)
ACTIONS = {
    "save": "store.save('new', crash_items(9))",
    "forget": "plan_forget(store, keep_last=2).execute()",
    "gc": "plan_gc(store, grace_s=0).execute()",
    # gc as released before it deferred deleting the bases of deltas in packs it repacks
    "gc-old": "import deltackpt.store.gc as g; g._bases_of_repacked = lambda plan: set(); "
              "plan_gc(store, grace_s=0).execute()",
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
    "gc:after-delete": "gc",
}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A committed store: c0 (keyframes), c1 (deltas), mix (a pack half of which c2 reuses), dead, c2."""
    root = tmp_path_factory.mktemp("crash") / "template"
    store = Store.init(root, **SMALL)
    keep, junk = floats(501, 4096), floats(502, 8192)
    expected = {
        "c0": crash_items(0),
        "c1": crash_items(1),
        "mix": {"keep": keep, "junk": junk},
        "dead": {"d": floats(503, 6000)},
        "c2": {**crash_items(2), "keep": keep},
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


def assert_store_ok(root, expected, *, present=(), absent=()):
    """Open, verify level 2, load every checkpoint bit-exact, every pack file whole. Returns (store, report).

    ``expected``: a dict name -> items, or a function name -> items (None for a name that must not exist).
    """
    store = Store.open(root)
    r, problems = check_store(store, expected.get if isinstance(expected, dict) else expected,
                              present=present, absent=absent)
    assert not problems, problems
    assert_packs_whole(store)
    return store, r


def assert_packs_whole(store):
    """Every pack file in the store hashes to its name (puts are atomic: a torn pack is at most a temp file)."""
    for info in store.backend.list("packs/"):
        name = info.key.rsplit("/", 1)[1]
        assert pack_bytes_ok(name, store.backend.get(info.key)), info.key
        assert read_pack_entries(store.backend, name, info.size_bytes)
    assert all(".tmp-" in t for t, _mtime in store.backend.list_temp())


def _gc_and_recheck(root, expected, names_before):
    store = Store.open(root)
    problems = gc_and_check(store, expected.get if isinstance(expected, dict) else expected,
                            present=names_before)
    assert not problems, problems
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

    expected["new"] = crash_items(9)
    committed = label == "commit:after-manifest"
    store, r = assert_store_ok(root, expected, present=names_before | ({"new"} if committed else set()),
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
        elif label == "gc:after-delete":  # killed after the first (the only) dead pack went, before the repack
            assert dead_pack not in pack_names(store) and mix_pack in pack_names(store) and not new_packs
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
    store.save("after", crash_items(10))
    assert_items_equal(crash_items(10), store.load("after"))


def test_without_crash_point_the_child_completes(template, tmp_path):
    """Control: the same child exits 0 when no crash point is set (so -9 above really is the crash point)."""
    root, expected = _copy(template, tmp_path)
    proc = _run_child(root, "save", None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected["new"] = crash_items(9)
    assert_store_ok(root, expected, present=set(expected))


# -- kill -9 at random moments ------------------------------------------------------------------------------------

LOOP = ("import sys; from deltackpt.testing import crash_loop; "
        "crash_loop(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))")


def kill_loop_at(root, start: int, seed: int, delay: float) -> list[str]:
    """Run ``crash_loop`` from ``r<start>``, SIGKILL it ``delay`` s after it is ready; its stdout lines."""
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(root), str(start), str(seed)], cwd=REPO_ROOT,
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
    return out.splitlines(keepends=True)


def test_kill_at_random_moments(template, tmp_path):
    root, base = _copy(template, tmp_path)
    for name in base:  # the loop's forgets (keep_last=3) never touch the template's checkpoints
        set_tags(Store.open(root), name, ["base"])
    expected = expected_items(base)
    seed = random.randrange(2**32)
    rnd = random.Random(seed)
    print("seed", seed)
    committed: set[str] = set()
    maybe_forgotten: set[str] = set()
    for k in range(10):
        # Each run starts past every name an earlier one may have committed (a run can commit before it
        # reports it, and fast saves can pass 100 in a run).
        taken = [int(n[1:]) for n in Store.open(root).checkpoint_names() if n[:1] == "r" and n[1:].isdigit()]
        first = max([100 * (k + 1), *(t + 1 for t in taken)])
        lines = kill_loop_at(root, first, rnd.randrange(2**32), rnd.uniform(0.0, 1.0))
        new, forgetting = read_loop_output(lines)
        committed |= new
        maybe_forgotten |= forgetting
        names = set(Store.open(root).checkpoint_names())
        assert_store_ok(root, expected, present=set(base) | (committed - maybe_forgotten))
        if k % 2:
            _gc_and_recheck(root, expected, names)
    assert committed, "the loop never committed anything in ten runs"
    # finally: all leftovers are reclaimable and the store stays clean
    _gc_and_recheck(root, expected, set(Store.open(root).checkpoint_names()))


# -- kill -9 in the middle of a large save ---------------------------------------------------------------------

BIG_ELEMS = 16 * 1024 * 1024  # 64 MiB of float32 per checkpoint
BIG_LOOP = textwrap.dedent(
    f"""
    import sys
    from deltackpt.store import Store
    from deltackpt.testing import floats
    store = Store.open(sys.argv[1])
    i = 0
    while True:
        print("start", i, flush=True)
        store.save(f"big-{{i}}", {{"w": floats(1000 + i, {BIG_ELEMS})}})
        print("committed", i, flush=True)
        i += 1
    """
)


def _big(name: str) -> dict | None:
    prefix, _, i = name.partition("-")
    return {"w": floats(1000 + int(i), BIG_ELEMS)} if prefix == "big" and i.isdigit() else None


@pytest.mark.parametrize("delay", [0.0, 0.15, 0.6])
def test_kill_during_a_large_save(tmp_path, delay):
    """Killed at a moment after its first pack (several packs in flight): no torn pack, and the next save
    finds the killed save's orphan chunks and reuses them."""
    root = tmp_path / "store"
    store = Store.init(root, chunk_size_bytes=64 * 1024, pack_target_bytes=256 * 1024)
    base = {"w": floats(7, 100_000), "meta": b"base checkpoint"}
    store.save("base", base)
    base_packs = pack_names(store)

    proc = subprocess.Popen([sys.executable, "-c", BIG_LOOP, str(root)], cwd=REPO_ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while pack_names(store) == base_packs:  # wait for the first pack of the new save
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"child exited early ({proc.returncode}): {err.decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("child wrote no pack within 60 s")
            time.sleep(0.002)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    print("killed after", delay, "s; child said:", out.decode().split())
    committed = {f"big-{line.split()[1]}" for line in out.decode().splitlines() if line.startswith("committed")}

    def expected(name):
        return base if name == "base" else _big(name)

    reopened, _ = assert_store_ok(root, expected, present={"base"} | committed)  # a save that returned is durable
    names = [i.name for i in reopened.list_checkpoints()]
    assert names[0] == "base"
    # the store is fully usable afterwards, and the killed save's orphan chunks are reused
    nxt = len(names) - 1
    m = reopened.save("after", _big(f"big-{nxt}"))
    if nxt == 0:  # killed inside big-0, after its first pack: those orphan chunks are found and reused
        assert m.stats.new_chunks < m.stats.num_chunks
    assert [i.name for i in reopened.list_checkpoints()][-1] == "after"
    assert_items_equal(_big(f"big-{nxt}"), reopened.load("after"))


def test_a_progress_line_cut_by_the_kill_is_not_read():
    lines = "ready\ncommitted r1\nforgetting r0 r1\ncommitted r2".splitlines(keepends=True)
    assert read_loop_output(lines) == ({"r1"}, {"r0", "r1"})  # "r2" may be cut ("r" of "r25"): not a name


def _delta_on_dead_base_store(tmp_path, first_delete: str):
    """c1's pack holds deltas on c0's chunks and a chunk c2 keeps; c0 and c1 forgotten: gc deletes c0's pack
    and repacks c1's. Returns (root, c1's weights)."""
    root = tmp_path / "store"
    store = Store.init(root, **{**SMALL, "pack_target_bytes": 1 << 20})
    w0, k = floats(601, 16 * 1024), floats(602, 16 * 1024)
    w1 = w0.copy()
    w1[::97] += 1e-3
    store.save("c0", {"w": w0})
    store.save("c1", {"w": w1, "k": k})
    store.save("c2", {"k": k, "z": floats(603, 4096)})
    if first_delete == "any":
        store.save("d", {"d": floats(604, 4096)})  # a dead pack that is no delta's base: deleted first
        store.forget(["d"])
    store.forget(["c0", "c1"])
    return root, w1


@pytest.mark.parametrize("first_delete", ["any", "none"])
def test_a_gc_killed_at_its_first_delete_leaves_no_delta_without_its_base(tmp_path, first_delete):
    # c1's pack holds deltas on c0's chunks and a chunk c2 keeps: gc deletes c0's (dead) pack and repacks
    # c1's. Killed between the two, c1's dead deltas lost their base; the same weights saved again then
    # made verify report the new checkpoint as damaged. The dead base pack now goes after the repack.
    from deltackpt.store.verify import verify_store

    root, w1 = _delta_on_dead_base_store(tmp_path, first_delete)
    proc = _run_child(root, "gc", "gc:after-delete")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    again = Store.open(root)
    again.save("c3", {"w": w1})
    report = verify_store(Store.open(root, cache_dir=tmp_path / "fresh"), level=2)
    assert report.ok, [p.as_dict() for p in report.problems]
    assert_items_equal({"w": w1}, Store.open(root, cache_dir=tmp_path / "fresh2").load("c3"))


def test_verify_names_a_stray_copy_left_by_an_older_gc_as_no_checkpoints_damage(tmp_path):
    # An older gc killed between its deletes and its repacks left c1's dead deltas without their base; the
    # same weights saved again are written anew and located there. verify reports the stray copies, which
    # no checkpoint reads, without naming c3 as damaged.
    from deltackpt.store.verify import verify_store

    root, w1 = _delta_on_dead_base_store(tmp_path, "none")
    proc = _run_child(root, "gc-old", "gc:after-delete")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    Store.open(root).save("c3", {"w": w1})
    report = verify_store(Store.open(root, cache_dir=tmp_path / "fresh"), level=2)
    assert report.problems and all(p.checkpoints == [] and "stray copy" in p.detail for p in report.problems)
    assert_items_equal({"w": w1}, Store.open(root, cache_dir=tmp_path / "fresh2").load("c3"))

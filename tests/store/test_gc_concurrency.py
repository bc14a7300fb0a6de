"""Saves and maintenance at once: two writer processes save in a loop while a third runs forget + gc in a loop.

Every save must commit (a save waits for gc's short delete phase, never fails because of it), the store must
verify clean at level 2 afterwards, and every remaining checkpoint must load bit-exact, compared with data
regenerated from the seed its metadata records.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from deltackpt.store import Store
from deltackpt.store.verify import verify_store

from store_helpers import REPO_ROOT, assert_items_equal, subprocess_env

N_FLOATS = 16 * 1024  # 64 KiB of float32: 16 chunks of 4 KiB
CONFIG = dict(chunk_size_bytes=4096, pack_target_bytes=32768, cdc_min_bytes=256, cdc_avg_bytes=1024,
              cdc_max_bytes=4096)

# The items a writer saves at a step, from (writer, step) alone, so the test can regenerate them. A few of
# "w"'s chunks change each step, each to one of a few variants: a later step often brings back a chunk
# whose only checkpoint was forgotten, so saves deduplicate against chunks gc is about to sweep.
ITEMS = textwrap.dedent(
    """
    import numpy as np

    N_FLOATS = %d

    def make_items(writer, step):
        rng = np.random.default_rng([writer, step])
        w = np.random.default_rng(1000 + writer).standard_normal(N_FLOATS).astype(np.float32)
        for c in rng.choice(N_FLOATS // 1024, size=4, replace=False):
            variant = int(rng.integers(0, 3))
            w[c * 1024:(c + 1) * 1024] += np.float32(variant + 1) * 1e-3
        shared = np.random.default_rng(7).integers(0, 256, 8192, dtype=np.uint8)  # both writers: dedup
        return {"w": w, "shared": shared, "step": f"writer {writer} step {step}".encode()}
    """
) % N_FLOATS

WRITER = ITEMS + textwrap.dedent(
    """
    import sys, time, traceback
    from deltackpt.store import Store

    root, writer, duration = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    store = Store.open(root)
    deadline, step = time.monotonic() + duration, 0
    while time.monotonic() < deadline:
        try:
            store.save(f"w{writer}-{step:05d}", make_items(writer, step),
                       metadata={"writer": writer, "step": step})
        except BaseException:
            print(f"save {step} failed:\\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            sys.exit(1)
        step += 1
    print(step, flush=True)
    """
)

MAINTAINER = textwrap.dedent(
    """
    import json, sys, time
    from deltackpt.store import Store
    from deltackpt.store.gc import plan_gc
    from deltackpt.store.retention import plan_forget

    root, duration = sys.argv[1], float(sys.argv[2])
    store = Store.open(root)
    deadline, runs, deleted = time.monotonic() + duration, 0, 0
    while time.monotonic() < deadline:
        plan_forget(store, keep_last=2).execute()
        result = plan_gc(store, grace_s=0).execute()
        runs += 1
        deleted += result.deleted_packs + result.repacked_packs
        time.sleep(0.05)
    print(json.dumps({"runs": runs, "deleted": deleted}), flush=True)
    """
)


def _items(writer: int, step: int) -> dict:
    scope: dict = {}
    exec(ITEMS, scope)
    return scope["make_items"](writer, step)


def _run_concurrently(tmp_path, root, duration_s: float, own_caches: bool = False) -> tuple[list[int], dict]:
    """Run the two writers and the maintainer; their output goes to files (a full pipe would stall them).
    ``own_caches``: each process keeps its index cache in its own directory (as on several hosts)."""
    roles = {"writer0": [WRITER, str(root), "0"], "writer1": [WRITER, str(root), "1"],
             "maintainer": [MAINTAINER, str(root)]}
    procs = {}
    try:
        for role, args in roles.items():
            with open(tmp_path / f"{role}.out", "w") as out, open(tmp_path / f"{role}.err", "w") as err:
                env = subprocess_env()
                if own_caches:
                    env["DELTACKPT_CACHE_DIR"] = str(tmp_path / f"cache-{role}")
                procs[role] = subprocess.Popen([sys.executable, "-c", *args, str(duration_s)], cwd=REPO_ROOT,
                                               env=env, stdout=out, stderr=err)
        for role, p in procs.items():
            p.wait(timeout=duration_s + 120)
            err = (tmp_path / f"{role}.err").read_text()
            assert p.returncode == 0, f"{role} exited {p.returncode}:\n{err[-5000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    outs = {role: (tmp_path / f"{role}.out").read_text() for role in roles}
    return [int(outs["writer0"]), int(outs["writer1"])], json.loads(outs["maintainer"])


def check_saves_and_gc_interleave(tmp_path, duration_s: float, own_caches: bool = False) -> None:
    root = tmp_path / "store"
    Store.init(root, **CONFIG)
    saves, gc = _run_concurrently(tmp_path, root, duration_s, own_caches)
    assert min(saves) >= 3, saves  # both writers really saved in a loop
    assert gc["runs"] >= 2 and gc["deleted"] > 0, gc  # and gc really swept while they did

    store = Store.open(root)
    report = verify_store(store, level=2)
    assert report.ok, [p.as_dict() for p in report.problems]
    names = store.checkpoint_names()
    assert names
    for name in names:
        meta = store.read_manifest(name).metadata
        assert name == f"w{meta['writer']}-{meta['step']:05d}"
        assert_items_equal(_items(meta["writer"], meta["step"]), store.load(name))


@pytest.mark.timeout(240)
def test_saves_and_gc_interleave_briefly(tmp_path):
    check_saves_and_gc_interleave(tmp_path, duration_s=12)


@pytest.mark.timeout(240)
def test_saves_and_gc_interleave_with_a_cache_per_process(tmp_path):
    """As on several hosts sharing one store (NFS, Lustre): every process keeps its own index cache."""
    check_saves_and_gc_interleave(tmp_path, duration_s=12, own_caches=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_saves_and_gc_interleave_for_a_minute(tmp_path):
    check_saves_and_gc_interleave(tmp_path, duration_s=60)


def test_a_reader_that_caught_up_half_way_through_a_gc_reads_after_it(tmp_path, rng):
    # Two caches stand for two hosts. The reader's read of a forgotten checkpoint finds its pack gone while
    # gc is between its deletes and catches up then; a pack gc deletes after that must not read as damage.
    import numpy as np

    from deltackpt.errors import DeltackptError
    from deltackpt.store.gc import plan_gc
    from store_helpers import SMALL

    Store.init(tmp_path / "s", **{**SMALL, "pack_target_bytes": 1 << 20})
    writer = Store.open(tmp_path / "s", cache_dir=tmp_path / "cache-writer")
    shared = rng.standard_normal(16 * 1024).astype(np.float32)
    data = {"c0": {"a": shared, "b": rng.standard_normal(16 * 1024).astype(np.float32)},  # one pack: a, b
            "c1": {"a": shared, "b": rng.standard_normal(16 * 1024).astype(np.float32)},
            "c2": {"x": rng.standard_normal(16 * 1024).astype(np.float32)}}
    for name, items in data.items():
        writer.save(name, items)
    reader = Store.open(tmp_path / "s", cache_dir=tmp_path / "cache-reader")
    for name in data:
        reader.load(name)
    reading = [reader.open_checkpoint("c2")]
    writer.forget(["c0", "c2"])  # c2's pack is dead, c0's half dead (a lives on): repacked

    gcs = Store.open(tmp_path / "s", cache_dir=tmp_path / "cache-gc")
    delete = gcs.backend.delete

    def delete_then_read(key, *args, **kwargs):
        delete(key, *args, **kwargs)
        if key.startswith("packs/") and reading:
            with pytest.raises(DeltackptError):  # c2 is gone, rightly; the reader catches up mid-gc
                reading.pop().read_many(data["c2"])

    gcs.backend.delete = delete_then_read
    result = plan_gc(gcs, grace_s=0).execute()
    assert not reading and result.deleted_packs and result.repacked_packs
    assert_items_equal(data["c1"], reader.load("c1"))

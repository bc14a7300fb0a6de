"""A failed save leaves no checkpoint and no temp file: a full disk (a real tmpfs), a real SIGINT, an exception
mid-save. Every earlier checkpoint loads bit-exact. The packs it had published stay (another writer may rely
on them, see store/packsink.py): unreferenced, removed by gc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from deltackpt.errors import DiskFullError
from deltackpt.store import LocalBackend, Store
from deltackpt.store.gc import plan_gc
from deltackpt.store.verify import verify_store

from store_helpers import REPO_ROOT, assert_items_equal, pack_keys

MiB = 1 << 20


def stray_files(root: Path) -> list[str]:
    """Every temp or spool file anywhere in the store (the index cache aside)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and ".tmp-" in p.name and "cache" not in p.relative_to(root).parts)


def assert_clean(store: Store, packs_before: set[str], expected: dict[str, dict]) -> None:
    """No temp file, earlier checkpoints intact; the failed save's packs are orphans, which gc removes."""
    root = store.backend.local_path()
    assert stray_files(root) == []
    for name, items in expected.items():
        assert_items_equal(items, Store.open(root).load(name))
    left = set(pack_keys(store)) - packs_before
    report = verify_store(Store.open(root), level=2)
    assert report.ok and {f"packs/{n[:2]}/{n}" for n in report.orphan_packs} == left, report.as_dict()
    plan_gc(Store.open(root), grace_s=0).execute()
    assert set(pack_keys(store)) == packs_before
    report = verify_store(Store.open(root), level=2)
    assert report.ok and report.orphan_packs == [], report.as_dict()


@pytest.fixture
def tmpfs(tmp_path):
    """A real 64 MiB tmpfs (needs root and mount); skipped where it cannot be mounted."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("threads", [1, 2])
def test_disk_full_save_fails_typed_and_cleans_up(tmpfs, rng, threads):
    store = Store.init(tmpfs / "s", chunk_size_bytes=1 * MiB, pack_target_bytes=8 * MiB)
    first = {"w": rng.bytes(3 * MiB), "b": np.arange(1000, dtype=np.float32)}
    first = {"w": np.frombuffer(first["w"], dtype=np.uint8).copy(), "b": first["b"]}
    store.save("first", first)
    packs_before = set(pack_keys(store))

    big = {f"layer{i}": np.frombuffer(rng.bytes(20 * MiB), dtype=np.float32) for i in range(10)}  # 200 MiB
    with pytest.raises(DiskFullError) as ei:
        store.save("big", big, num_threads=threads)
    err = ei.value
    assert isinstance(err, OSError) and err.errno == 28
    assert str(err).startswith("disk full while writing ") and str(tmpfs / "s") in str(err)
    assert not store.exists("big")
    assert_clean(store, packs_before, {"first": first})
    # the space came back: a save that fits succeeds
    store.save("after", {"x": big["layer0"][: 2 * MiB]})
    np.testing.assert_array_equal(Store.open(tmpfs / "s").load("after")["x"], big["layer0"][: 2 * MiB])


def test_exception_mid_save_cleans_up(tmp_path, rng):
    store = Store.init(LocalBackend(tmp_path / "s", fsync=False), chunk_size_bytes=64 * 1024,
                       pack_target_bytes=64 * 1024)
    first = {"a": rng.standard_normal(50_000).astype(np.float32)}
    store.save("first", first)
    packs_before = set(pack_keys(store))
    seen = []

    class Spy(dict):  # records how many packs exist when the bad item is reached
        def items(self):
            for k, v in super().items():
                if k == "bad":
                    seen.append(len(pack_keys(store)))
                yield k, v

    items = Spy(x=rng.standard_normal(300_000).astype(np.float32), bad=object(),
                y=rng.standard_normal(1000).astype(np.float32))
    with pytest.raises(TypeError, match="'bad'"):
        store.save("second", items, num_threads=1)
    assert seen and seen[0] > len(packs_before)  # the failed save had published packs of its own
    assert not store.exists("second")
    # a retry reuses what the failed save published (its writer indexed it): only what it never reached is new
    retry = {"x": items["x"], "y": items["y"]}
    m = Store.open(store.backend.local_path()).save("retry", retry, num_threads=1)
    assert m.stats.new_chunks <= m.stats.num_chunks - (seen[0] - len(packs_before)), m.stats
    assert_items_equal(retry, Store.open(store.backend.local_path()).load("retry"))
    Store.open(store.backend.local_path()).forget(["retry"])
    assert_clean(store, packs_before, {"first": first})


_CHILD = textwrap.dedent("""
    import signal, sys, time
    import numpy as np
    from deltackpt.store import Store

    # Ctrl-C as a user's process gets it: a shell that starts a job in the background without job control
    # (nohup ... &) hands it SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    class Slow(dict):
        # The save pauses after a few items, its packs published, so the signal lands mid-save however
        # fast the rest would go (the whole 384 MB takes 0.5 s).
        def items(self):
            for i, kv in enumerate(super().items()):
                if i == 4:
                    time.sleep(120)
                yield kv

    store = Store.open(sys.argv[1])
    rng = np.random.default_rng(7)
    state = Slow({f"p{i}": rng.integers(0, 256, size=16 << 20, dtype=np.uint8) for i in range(24)})
    print("ready", flush=True)
    store.save("big", state, num_threads=int(sys.argv[2]))
    print("committed", flush=True)
""")


@pytest.mark.parametrize("threads", [1, 2])
def test_sigint_mid_save_cleans_up(tmp_path, rng, threads):
    root = tmp_path / "s"
    store = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=1 * MiB, pack_target_bytes=4 * MiB)
    first = {"a": rng.standard_normal(100_000).astype(np.float32)}
    store.save("first", first)
    packs_before = set(pack_keys(store))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(threads)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while set(pack_keys(store)) == packs_before:  # interrupt once the save has published a pack
            assert child.poll() is None and time.monotonic() < deadline, "the save never published a pack"
            time.sleep(0.005)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "committed" not in out and "KeyboardInterrupt" in err, err[-2000:]
    assert not store.exists("big")
    assert_clean(store, packs_before, {"first": first})


def test_an_interrupt_while_a_spool_file_is_opened_removes_it(tmp_path, monkeypatch):
    """A Ctrl-C is raised at the first Python call after the one it arrived in: one that lands while a pack's
    spool file is created is raised inside the builder, before any writer knows of the file (seen once in
    test_sigint_mid_save_cleans_up: a stray spool file)."""
    from deltackpt.store import pack as pack_mod

    def interrupted(self, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack_mod.PackBuilder, "_write", interrupted)
    spool = tmp_path / "spool.tmp-x"
    with pytest.raises(KeyboardInterrupt):
        pack_mod.PackBuilder(spool)
    assert not spool.exists()


def test_packs_another_writer_indexed_are_kept(tmp_path, rng):
    """Once another process's index has recorded a pack of ours it may dedup against it: the pack stays."""
    root = tmp_path / "s"
    store = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=64 * 1024, pack_target_bytes=64 * 1024)
    store.save("first", {"a": np.zeros(10, dtype=np.float32)})
    before = set(pack_keys(store))
    data = rng.standard_normal(600_000).astype(np.float32)  # more than one coding batch (1 MiB)
    w = store.writer(num_threads=1)
    w.add_array("x", data, dtype="<f4", elem_size=4, shape=data.shape)
    published = set(pack_keys(store)) - before
    assert published
    other = Store.open(root)
    other.refresh_index()  # what a save starting now does: its index records the packs listed
    w.abort()
    assert published <= set(pack_keys(store))
    # the other writer dedups against them and commits a checkpoint that loads
    s = other.writer(num_threads=1)
    s.add_array("x", data[:16384], dtype="<f4", elem_size=4, shape=(16384,))
    summary = s.finish()
    assert summary.packs == {}  # every chunk deduplicated against the aborted writer's packs
    other.commit("second", summary.items, entries=summary.entries, packs=summary.packs)
    np.testing.assert_array_equal(Store.open(root).load("second")["x"], data[:16384])


def test_identical_pack_published_by_another_writer_is_kept(tmp_path, rng):
    """A pack of the same bytes already there (another writer's, not yet indexed) is never ours to remove."""
    root = tmp_path / "s"
    a = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=64 * 1024, pack_target_bytes=1 << 20)
    b = Store.open(root)
    a.refresh_index(), b.refresh_index()  # both indexes are up to date before either writer publishes
    data = rng.standard_normal(50_000).astype(np.float32)
    wb = b.writer(num_threads=1)
    wb.add_array("x", data, dtype="<f4", elem_size=4, shape=data.shape)
    sb = wb.finish()
    wa = a.writer(num_threads=1)
    wa.add_array("x", data, dtype="<f4", elem_size=4, shape=data.shape)
    sa = wa.finish()
    assert sa.packs == sb.packs  # the same pack, published again by the second writer
    wa.abort()  # e.g. its commit failed
    assert set(pack_keys(a)) == {f"packs/{n[:2]}/{n}" for n in sb.packs}
    b.commit("from-b", sb.items, entries=sb.entries, packs=sb.packs)
    np.testing.assert_array_equal(Store.open(root).load("from-b")["x"], data)


def test_abort_after_a_failed_commit_leaves_its_packs_to_gc(tmp_path, rng):
    root = tmp_path / "s"
    store = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=64 * 1024, pack_target_bytes=1 << 20)
    store.refresh_index()
    w = store.writer(num_threads=1)
    w.add_bytes("x", rng.bytes(300_000))
    summary = w.finish()
    assert len(pack_keys(store)) == len(summary.packs) == 1
    w.abort()
    assert len(pack_keys(store)) == 1 and stray_files(root) == []
    plan_gc(Store.open(root), grace_s=0).execute()
    assert pack_keys(store) == []


def test_a_writer_that_published_the_same_pack_first_and_failed_leaves_it(tmp_path, rng):
    """Two saves of the same bytes publish the same pack; the first to publish fails before the other commits:
    the pack stays, and the other's checkpoint loads (its cleanup once deleted the pack: a committed checkpoint
    that could not be loaded)."""
    root = tmp_path / "s"
    a = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=64 * 1024, pack_target_bytes=1 << 20)
    b = Store.open(root)
    a.refresh_index(), b.refresh_index()
    data = rng.standard_normal(50_000).astype(np.float32)
    wa = a.writer(num_threads=1)
    wa.add_array("x", data, dtype="<f4", elem_size=4, shape=data.shape)
    sa = wa.finish()  # published first: the pack did not exist before
    wb = b.writer(num_threads=1)
    wb.add_array("x", data, dtype="<f4", elem_size=4, shape=data.shape)
    sb = wb.finish()
    assert sa.packs == sb.packs
    wa.abort()
    b.commit("from-b", sb.items, entries=sb.entries, packs=sb.packs, checked_packs=sb.reused_packs)
    np.testing.assert_array_equal(Store.open(root).load("from-b")["x"], data)
    assert verify_store(Store.open(root), level=2).ok


def test_a_failed_save_keeps_packs_a_writer_with_its_index_elsewhere_committed_against(tmp_path, rng):
    """A writer whose index cache is outside the store lists a running save's packs, deduplicates against them
    and commits; that save then fails: its packs stay (the in-store index, all the failing save could ask, had
    never recorded them)."""
    root = tmp_path / "s"
    a = Store.init(LocalBackend(root, fsync=False), chunk_size_bytes=64 * 1024, pack_target_bytes=64 * 1024)
    a.save("old", {"y": np.arange(100_000, dtype=np.float32)})
    a.forget(["old"])
    assert plan_gc(a, grace_s=0).execute().deleted_packs  # a store gc has run on (it has a gc epoch)
    data = rng.standard_normal(300_000).astype(np.float32)
    wa = a.writer(num_threads=1)
    wa.add_array("x", data, dtype="<f4", elem_size=4, shape=data.shape)  # more than a batch: packs published
    assert pack_keys(a)
    b = Store.open(root, cache_dir=tmp_path / "elsewhere")
    m = b.save("from-b", {"x": data}, num_threads=1)
    assert m.stats.new_chunks < m.stats.num_chunks  # it deduplicated against the running save's packs
    wa.abort()
    np.testing.assert_array_equal(Store.open(root).load("from-b")["x"], data)
    assert verify_store(Store.open(root), level=2).ok

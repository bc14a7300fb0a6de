"""Faults of the index cache never make a store unusable: a read-only store, a damaged cache, a full disk.

The faults are real: another user (``setpriv`` to nobody) on a ``chmod -R a-w`` store, bytes flipped in
``data.mdb``, a small tmpfs filled to the last byte.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from deltackpt.errors import DiskFullError
from deltackpt.store import LocalBackend, Store
from deltackpt.store import index as index_mod
from deltackpt.store.gc import plan_gc
from deltackpt.store.verify import verify_store

from store_helpers import REPO_ROOT, SMALL, assert_items_equal, close_index, random_array

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def _two_checkpoints(root: Path, rng) -> dict[str, dict]:
    store = Store.init(LocalBackend(root, fsync=False), **SMALL)
    saved = {"one": {"w": random_array(rng, "float32", (40_000,)), "b": rng.bytes(5_000)},
             "two": {"w": random_array(rng, "float32", (40_000,))}}
    for name, items in saved.items():
        store.save(name, items)
    close_index(store)
    return saved


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "cache" not in p.parts}


# -- read-only store ---------------------------------------------------------------------------------------
@pytest.fixture
def readonly_store(rng):
    """A store with two checkpoints, made read-only for everyone (``chmod -R a-w``), in a directory another
    user can reach; (root, saved items)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as another user")
    top = Path(tempfile.mkdtemp(prefix="deltackpt-ro-", dir="/tmp"))
    top.chmod(0o755)
    root = top / "S"
    saved = _two_checkpoints(root, rng)
    subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)
    yield root, saved
    subprocess.run(["chmod", "-R", "u+w", str(top)], check=True)
    shutil.rmtree(top)


def _as_nobody(args: list[str], **env) -> subprocess.CompletedProcess:
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO_ROOT),
                "HOME": "/nonexistent", **env}
    return subprocess.run([*NOBODY, sys.executable, *args], cwd="/", env=full_env, capture_output=True,
                          text=True, timeout=120)


_READER = """
import json, sys
import numpy as np
from deltackpt.errors import StorePermissionError
from deltackpt.store import Store
from deltackpt.store.gc import plan_gc
from deltackpt.store.verify import verify_store
s = Store.open(sys.argv[1])
out = {"names": [i.name for i in s.list_checkpoints()], "verify_ok": verify_store(s, level=2).ok,
       "num_chunks": s.usage().num_chunks, "index_path": str(s.index.path),
       "loaded": {n: {k: (v.tobytes() if isinstance(v, np.ndarray) else v).hex() for k, v in s.load(n).items()}
                  for n in ("one", "two")}}
refused = []
for what, call in [("save", lambda: s.save("three", {"x": b"abc"})), ("forget", lambda: s.forget("one")),
                   ("gc", lambda: plan_gc(s, grace_s=0).execute())]:
    try:
        call()
    except StorePermissionError as e:
        refused.append((what, str(e)))
out["refused"] = refused
print(json.dumps(out))
"""


def test_readonly_store_reads_with_a_per_user_cache_and_refuses_writes(readonly_store):
    root, saved = readonly_store
    before = _snapshot(root)
    r = _as_nobody(["-c", _READER, str(root)])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["names"] == ["one", "two"] and out["verify_ok"] and out["num_chunks"] > 0
    for name, items in saved.items():
        assert out["loaded"][name] == {k: (v.tobytes() if hasattr(v, "tobytes") else v).hex()
                                       for k, v in items.items()}
    # No home: the per-user temp directory, keyed by store id, holds the cache.
    store_id = Store.open(root).config.store_id
    assert out["index_path"] == str(Path(tempfile.gettempdir()) / "deltackpt-65534" / store_id / "index.lmdb")
    assert [w for w, _ in out["refused"]] == ["save", "forget", "gc"]
    assert all("read-only" in msg and str(root) in msg for _, msg in out["refused"])
    assert _snapshot(root) == before  # nothing written, nothing removed
    shutil.rmtree(Path(out["index_path"]).parent, ignore_errors=True)


def test_readonly_store_uses_xdg_cache_home(readonly_store, tmp_path):
    root, _ = readonly_store
    xdg = Path(tempfile.mkdtemp(prefix="deltackpt-xdg-", dir="/tmp"))
    try:
        os.chown(xdg, 65534, 65534)
        r = _as_nobody(["-c", "import sys; from deltackpt.store import Store; s = Store.open(sys.argv[1]); "
                              "s.load('two'); print(s.index.path)", str(root)], XDG_CACHE_HOME=str(xdg))
        assert r.returncode == 0, r.stderr
        store_id = Store.open(root).config.store_id
        assert r.stdout.strip() == str(xdg / "deltackpt" / store_id / "index.lmdb")
    finally:
        shutil.rmtree(xdg)


def test_readonly_store_cli(readonly_store):
    root, _ = readonly_store
    cli = ["-m", "deltackpt"]
    for args in (["ls", str(root)], ["show", str(root), "latest"], ["du", str(root)], ["verify", str(root)],
                 ["verify", "--level", "2", str(root)]):
        r = _as_nobody(cli + args)
        assert r.returncode == 0 and not r.stderr, (args, r.stderr)
    assert "two" in _as_nobody(cli + ["ls", str(root)]).stdout
    for args in (["gc", "--grace", "0", str(root)], ["forget", "--keep-last", "1", str(root)],
                 ["tag", str(root), "one", "keep"], ["init", str(root / "new")]):
        r = _as_nobody(cli + args)
        assert r.returncode == 3, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "read-only" in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)
    assert sorted(p.name for p in (root / "manifests").iterdir()) == ["one", "two"]


def test_unwritable_explicit_cache_dir_keeps_the_index_in_memory(tmp_path, rng, caplog):
    root = tmp_path / "S"
    saved = _two_checkpoints(root, rng)
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")  # no cache directory can be made under a file
    with caplog.at_level(logging.WARNING, logger="deltackpt"):
        s = Store.open(root, cache_dir=blocker / "cache")
        for name, items in saved.items():
            assert_items_equal(items, s.load(name))
        assert s.index.in_memory and s.index.num_chunks() > 0
        third = {"w": saved["two"]["w"] + 1}
        s.save("three", third)  # commits through the in-memory index
        assert_items_equal(third, Store.open(root).load("three"))
        assert verify_store(s, level=2).ok
    memory_warnings = [r for r in caplog.records if "in memory" in r.getMessage()]
    assert len(memory_warnings) == 1


# -- damaged cache -----------------------------------------------------------------------------------------
_CHECK = """
import sys
from deltackpt.store import Store
from deltackpt.store.verify import verify_store
s = Store.open(sys.argv[1])
names = [i.name for i in s.list_checkpoints()]
ok = verify_store(s, level=0).ok
print(names, ok, [sorted(s.load(n)) for n in names])
"""


def _run_on_damaged_copy(src: Path, dst: Path, damage) -> subprocess.CompletedProcess:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    data = dst / "cache" / "index.lmdb" / "data.mdb"
    data.write_bytes(damage(bytearray(data.read_bytes())))
    # A subprocess: LMDB has no page checksums, and some damage could crash the process (see below).
    return subprocess.run([sys.executable, "-c", _CHECK, str(dst)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


@pytest.mark.slow  # a sweep: one subprocess per flipped offset, ~20 s (the fast suite keeps the garbage cache)
def test_flipped_bytes_in_the_cache_are_repaired(tmp_path, rng):
    src = tmp_path / "S"
    _two_checkpoints(src, rng)
    size = (src / "cache" / "index.lmdb" / "data.mdb").stat().st_size
    failures, warned = [], 0
    for offset in range(13, size, 1021):
        def flip(b, offset=offset):
            b[offset] ^= 0x5A
            return b
        r = _run_on_damaged_copy(src, tmp_path / "F", flip)
        if r.returncode == -7:
            continue  # SIGBUS: a page pointer flipped past the file's end; LMDB cannot check (see report)
        if r.returncode != 0 or "['one', 'two'] True" not in r.stdout:
            failures.append((offset, r.returncode, r.stderr.strip().splitlines()[-1:]))
        warned += "index cache" in r.stderr
    assert not failures
    assert warned > 0  # the repairs are not silent


@pytest.mark.parametrize("damage", ["garbage", "zeroed-tail"])
def test_garbage_cache_is_rebuilt(tmp_path, rng, damage):
    src = tmp_path / "S"
    _two_checkpoints(src, rng)

    def spoil(b: bytearray) -> bytearray:
        if damage == "garbage":
            return bytearray(os.urandom(len(b)))
        return b[:8192] + bytearray(len(b) - 8192)

    r = _run_on_damaged_copy(src, tmp_path / "F", spoil)
    assert r.returncode == 0, r.stderr
    assert "['one', 'two'] True" in r.stdout
    assert r.stderr.count("index cache") <= 2  # one line per kind of repair, no traceback
    assert "Traceback" not in r.stderr


def test_index_rebuild_never_opens_the_damaged_cache(tmp_path, rng):
    """A truncated data.mdb can crash LMDB (SIGBUS on a page past the end, which no check of LMDB's
    catches); ``deltackpt index rebuild`` deletes the cache unread, so it is always the way out."""
    src = tmp_path / "S"
    _two_checkpoints(src, rng)
    data = src / "cache" / "index.lmdb" / "data.mdb"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-m", "deltackpt", "index", "rebuild", str(src)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0 and "index rebuilt" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-c", _CHECK, str(src)], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0 and "['one', 'two'] True" in r.stdout, r.stderr


@pytest.mark.parametrize("keep", [1 / 3, 1 / 2, 0.9])
def test_a_truncated_cache_is_rebuilt_not_a_crash(tmp_path, rng, keep):
    """A data.mdb cut short (a copy or a disk that filled up) is refused before LMDB reads past its end
    (SIGBUS): every command treats it as any damaged cache."""
    src = tmp_path / "S"
    _two_checkpoints(src, rng)
    data = src / "cache" / "index.lmdb" / "data.mdb"
    data.write_bytes(data.read_bytes()[: int(data.stat().st_size * keep) // 4096 * 4096 + 100])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-c", _CHECK, str(src)], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0 and "['one', 'two'] True" in r.stdout, (r.returncode, r.stderr[-2000:])
    assert "rebuilding it from the pack tables" in r.stderr


_DAMAGE_UNDER_AN_OPEN_STORE = """
import os, sys
from deltackpt.store import Store
s = Store.open(sys.argv[1])
assert [i.name for i in s.list_checkpoints()] == ["one", "two"]
data = os.path.join(sys.argv[1], "cache", "index.lmdb", "data.mdb")
size = os.path.getsize(data)
with open(data, "r+b") as f:  # another process writes garbage over every page but the two meta pages
    f.seek(8192)
    f.write(bytes(size - 8192))
print(sorted(s.load("one")), sorted(s.load("two")), [i.name for i in s.list_checkpoints()], s.index.in_memory)
"""


def test_lmdb_error_in_a_transaction_is_repaired(tmp_path, rng):
    """The cache damaged under an open store: the next operation meets an LMDB error, and the cache is
    dropped, rebuilt from the packs, and the operation carried on, with one warning."""
    root = tmp_path / "S"
    _two_checkpoints(root, rng)
    r = subprocess.run([sys.executable, "-c", _DAMAGE_UNDER_AN_OPEN_STORE, str(root)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['b', 'w'] ['w'] ['one', 'two'] False"
    assert r.stderr.count("is damaged") == 1 and "Traceback" not in r.stderr, r.stderr


# -- full disk ---------------------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs():
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="deltackpt-full-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        for key in [k for k in index_mod._envs if k.startswith(str(mnt))]:
            index_mod._close_env(Path(key))
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def _fill(mnt: Path) -> None:
    with open(mnt / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\xff" * 65536)
        except OSError:
            pass
        try:
            while True:  # the last partial block
                f.write(b"\xff")
        except OSError:
            pass


def _free_bytes(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize


def test_full_disk_reads_work_and_gc_frees_space(small_tmpfs, rng, caplog):
    root = small_tmpfs / "S"
    saved = _two_checkpoints(root, rng)
    # A pack nobody indexed yet (a save's packs before the commit): the first read must add it to the cache.
    orphan = Store.open(root)
    w = orphan.writer()
    w.add_array("x", random_array(rng, "float32", (30_000,)), dtype="<f4", elem_size=4, shape=(30_000,))
    w.finish()
    close_index(orphan)
    shutil.rmtree(root / "cache")  # and no cache at all: it must be built on the full disk
    _fill(small_tmpfs)
    assert _free_bytes(small_tmpfs) == 0

    with caplog.at_level(logging.WARNING, logger="deltackpt"):
        s = Store.open(root)
        assert [i.name for i in s.list_checkpoints()] == ["one", "two"]
        for name, items in saved.items():
            assert_items_equal(items, s.load(name))
        assert s.read_manifest("latest").name == "two"
        report = verify_store(s, level=2)
        assert report.ok and report.orphan_packs
        with pytest.raises(DiskFullError, match="disk full"):
            s.save("three", {"x": random_array(rng, "float32", (30_000,))})
        close_index(s)

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cli = [sys.executable, "-m", "deltackpt"]
    for args in (["ls", str(root)], ["show", str(root), "one"], ["verify", str(root)]):
        r = subprocess.run(cli + args, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr)

    r = subprocess.run(cli + ["forget", "--keep-last", "1", str(root)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cli + ["gc", "--grace", "0", str(root)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert _free_bytes(small_tmpfs) > 100_000  # the forgotten checkpoint's and the orphan's packs are gone
    s = Store.open(root)
    assert [i.name for i in s.list_checkpoints()] == ["two"]
    assert_items_equal(saved["two"], s.load("two"))
    assert verify_store(s, level=2).ok


def test_gc_on_a_completely_full_disk_says_disk_full(small_tmpfs, rng):
    """With not one free block, gc cannot write its lock object, and running without it could delete what a
    save is about to commit: it refuses, naming the cause, and deletes nothing."""
    root = small_tmpfs / "S"
    _two_checkpoints(root, rng)
    Store.open(root).forget("one")
    s = Store.open(root)
    planned = plan_gc(s, grace_s=0).delete_packs
    assert planned
    _fill(small_tmpfs)
    before = _snapshot(root)
    with pytest.raises(DiskFullError, match="disk full"):
        plan_gc(s, grace_s=0).execute()  # the mark phase's shared lock is already an object to write
    assert _snapshot(root) == before
    (small_tmpfs / "filler").unlink()  # space freed elsewhere: now it runs
    assert plan_gc(s, grace_s=0).execute().deleted_packs == len(planned)


def _put_cache_record(store, chunk_id: bytes, record: bytes) -> None:
    chunks, _, _ = store.index._dbs()
    with store.index.env.begin(write=True, db=chunks) as txn:
        txn.put(chunk_id, record)


def _cache_record(store, chunk_id: bytes) -> bytes:
    chunks, _, _ = store.index._dbs()
    with store.index.env.begin(db=chunks) as txn:
        return bytes(txn.get(chunk_id))


def test_a_cache_record_placing_a_chunk_at_anothers_place_in_one_bundle_is_never_served(tmp_path):
    """Two chunks at one place of a pack were read and checked once, as one chunk used twice: a cache record
    that put chunk B where chunk A is gave B's item A's bytes, with no error."""
    store = Store.init(tmp_path / "s", chunk_size_bytes=4096)
    rng = np.random.default_rng(0)
    items = {f"x{i}": rng.integers(0, 2**31, 1024, dtype=np.int32) for i in range(64)}  # a raw chunk each
    store.save("c", items)
    ids = {it.key: it.chunks[0].id for it in store.read_manifest("c").items}
    _put_cache_record(store, ids["x1"], _cache_record(store, ids["x0"]))
    assert_items_equal(Store.open(tmp_path / "s").load("c"), items)


def test_a_cache_record_with_a_wrong_length_is_not_taken_for_a_damaged_manifest(tmp_path):
    """A part of a chunk was judged against the cache's length before the chunk was read and checked: an
    intact checkpoint failed with CorruptManifestError (and a resume fell back to an older one)."""
    from deltackpt.store.records import RECORD_DTYPE

    store = Store.init(tmp_path / "s", chunk_size_bytes=4096)
    a = np.arange(1024, dtype=np.float32)
    store.save("c", {"a": a})
    cid = store.read_manifest("c").items[0].chunks[0].id
    rec = np.frombuffer(_cache_record(store, cid), RECORD_DTYPE).copy()
    rec["raw_len"] -= 8
    _put_cache_record(store, cid, rec.tobytes())
    assert Store.open(tmp_path / "s").load("c")["a"].tobytes() == a.tobytes()


def _save_in_forked_child(root: str, queue) -> None:
    try:
        store = Store.open(root)
        store.save("child", {"w": np.arange(1000, dtype=np.float32) + 1})
        queue.put(("ok", str(store.index.path)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(("error", repr(e)))


@pytest.mark.timeout(120)
def test_a_forked_child_leaves_its_parents_cache_alone(tmp_path, monkeypatch):
    """A child forked from a process that had the index cache open (a multiprocessing worker) could not open
    those files again (py-lmdb's guard survives fork), took them for a damaged cache and deleted them under
    the live parent. It now uses the next cache location and leaves the parent's files as they were."""
    import multiprocessing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "store"
    store = Store.init(LocalBackend(root, fsync=False), **SMALL)
    store.save("parent", {"w": np.arange(1000, dtype=np.float32)})
    data = root / "cache" / "index.lmdb" / "data.mdb"
    before = os.stat(data).st_ino
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_save_in_forked_child, args=(str(root), queue))
    child.start()
    status, where = queue.get(timeout=60)
    child.join(60)
    assert status == "ok", where
    assert Path(where) != root / "cache" / "index.lmdb"  # the next location
    assert os.stat(data).st_ino == before  # the parent's cache is the same file, still in use
    store.save("after", {"w": np.arange(1000, dtype=np.float32) + 2})
    fresh = Store.open(root)
    assert [float(fresh.load(n)["w"][0]) for n in ("parent", "child", "after")] == [0.0, 1.0, 2.0]

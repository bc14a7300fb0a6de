"""Store locks: shared/exclusive semantics, staleness, refresh, check(), and a lock held by another process."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from deltackpt.errors import StoreLockedError
from deltackpt.store.gc import plan_gc
from deltackpt.store.lock import EXCLUSIVE, SHARED, STALE_AFTER_S, StoreLock, list_locks

from store_helpers import REPO_ROOT, random_array, subprocess_env


def _keys(backend) -> list[str]:
    return [i.key for i in backend.list("locks/")]


def test_a_lock_object_is_written_without_fsync_but_whole(tmp_path, monkeypatch):
    """A lock speaks only for its running holder, which a crash ends too: taking one costs no fsync (the
    store's other objects still get theirs), and the object is never seen half written."""
    from deltackpt.store import LocalBackend

    backend = LocalBackend(tmp_path / "s")
    for key in ("locks/.keep-dir", "tags/t"):  # the folders exist, as in any store (made, and synced, once)
        backend.put(key, b"[]")
    backend.delete("locks/.keep-dir")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    with StoreLock(backend, SHARED, refresh=False) as lock:
        assert synced == []
        assert json.loads(backend.get(lock.key))["id"] == lock.id
        lock.check()
        assert [i.key for i in backend.list("locks/")] == [lock.key]  # no temp file left beside it
    backend.put("tags/t", b"[]")
    assert len(synced) == 2  # an ordinary put: the file and its folder


def test_lock_object_lifecycle(mem_store):
    be = mem_store.backend
    lock = StoreLock(be, SHARED, refresh=False)
    assert lock.key.startswith("locks/shared-")
    with lock:
        assert _keys(be) == [lock.key]
        info = json.loads(be.get(lock.key))
        assert info["kind"] == SHARED and info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        assert abs(info["time"] - time.time()) < 60 and info["id"] == lock.id
        lock.check()  # valid while held
    assert _keys(be) == []
    with pytest.raises(StoreLockedError):
        lock.check()  # released


def test_bad_kind_is_refused(mem_store):
    with pytest.raises(ValueError):
        StoreLock(mem_store.backend, "read")


def test_shared_locks_coexist_exclusive_is_alone(mem_store):
    be = mem_store.backend
    with StoreLock(be, SHARED, refresh=False), StoreLock(be, SHARED, refresh=False):
        assert len(_keys(be)) == 2
        with pytest.raises(StoreLockedError, match="gc needs the store alone"):
            StoreLock(be, EXCLUSIVE, refresh=False, wait_s=0).acquire()
        assert len(_keys(be)) == 2  # the refused lock removed its object
    with StoreLock(be, EXCLUSIVE, refresh=False):
        with pytest.raises(StoreLockedError, match="a gc is running"):
            StoreLock(be, SHARED, refresh=False, wait_s=0).acquire()
        with pytest.raises(StoreLockedError, match="another gc is running"):
            StoreLock(be, EXCLUSIVE, refresh=False).acquire()  # never waits for another exclusive lock
        assert len(_keys(be)) == 1
    assert _keys(be) == []


def test_negative_wait_is_refused(mem_store):
    with pytest.raises(ValueError, match="wait_s"):
        StoreLock(mem_store.backend, SHARED, wait_s=-1)


def test_exclusive_lock_waiting_for_saves_stays_fresh(mem_store):
    """gc may wait minutes for running saves: its pending lock is refreshed meanwhile, never judged stale."""
    be = mem_store.backend
    save = StoreLock(be, SHARED, stale_after_s=0.2).acquire()
    threading.Timer(0.6, save.release).start()
    with StoreLock(be, EXCLUSIVE, stale_after_s=0.2, wait_s=30) as gc:
        gc.check()
        assert _keys(be) == [gc.key]


def test_refresh_keeps_a_long_held_lock_fresh(mem_store):
    be = mem_store.backend
    lock = StoreLock(be, SHARED, stale_after_s=0.2)  # refreshed every 0.05 s
    with lock:
        t0 = json.loads(be.get(lock.key))["time"]
        time.sleep(0.5)
        t1 = json.loads(be.get(lock.key))["time"]
        assert t1 > t0 + 0.2
        lock.check()  # older than stale_after_s, but refreshed: still valid


def test_refresh_never_resurrects_a_removed_lock(mem_store):
    be = mem_store.backend
    lock = StoreLock(be, SHARED, stale_after_s=0.2)
    with lock:
        be.delete(lock.key)
        time.sleep(0.3)
        assert not be.exists(lock.key)
        with pytest.raises(StoreLockedError, match="lost"):
            lock.check()


def test_unrefreshed_lock_goes_stale(mem_store):
    be = mem_store.backend
    lock = StoreLock(be, SHARED, stale_after_s=0.05, refresh=False).acquire()
    time.sleep(0.1)
    with pytest.raises(StoreLockedError):
        lock.check()
    # and another process's exclusive lock treats it as abandoned
    with StoreLock(be, EXCLUSIVE, stale_after_s=0.05, refresh=False):
        assert not be.exists(lock.key)
    lock.release()


def test_list_locks_flags_stale_ones(mem_store):
    be = mem_store.backend
    old = {"kind": "exclusive", "host": "elsewhere", "pid": 1, "time": time.time() - 10_000, "id": "old"}
    with StoreLock(be, SHARED, refresh=False) as lock:
        be.put("locks/exclusive-old", json.dumps(old).encode())  # after acquire, which would clean it up
        be.put("locks/shared-junk", b"{not json")
        locks = {d["key"]: d for d in list_locks(be)}
        assert set(locks) == {"locks/exclusive-old", lock.key}  # garbage is not a lock
        assert locks["locks/exclusive-old"]["stale"] is True
        assert locks[lock.key]["stale"] is False


def test_a_lock_dated_far_in_the_future_is_stale(mem_store):
    # A damaged digit (or a clock a year ahead) held every save and gc off the store for good.
    be = mem_store.backend
    ahead = {"kind": "exclusive", "host": "elsewhere", "pid": 1, "time": time.time() + 365 * 86400, "id": "f"}
    be.put("locks/exclusive-f", json.dumps(ahead).encode())
    assert {d["key"]: d["stale"] for d in list_locks(be)} == {"locks/exclusive-f": True}
    with StoreLock(be, SHARED, refresh=False, wait_s=0):
        assert not be.exists("locks/exclusive-f")


def test_held_lock_cannot_be_pickled(mem_store):
    with StoreLock(mem_store.backend, SHARED, refresh=False) as lock:
        with pytest.raises(TypeError):
            pickle.dumps(lock)


@pytest.mark.parametrize("fields", [{"pid": "abc"}, {"time": "soon"}, {"time": None}, {"pid": 10**30},
                                    {"time": float("inf")}],
                         ids=["pid-str", "time-str", "time-null", "pid-huge", "time-inf"])
def test_malformed_lock_object_is_treated_as_garbage(mem_store, fields):
    be = mem_store.backend
    info = {"kind": "shared", "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "id": "m"}
    info.update(fields)
    be.put("locks/shared-malformed", json.dumps(info).encode())
    lock = StoreLock(be, EXCLUSIVE, refresh=False)
    try:
        lock.acquire()
    except StoreLockedError:
        pass
    finally:
        leaked = [k for k in _keys(be) if k.startswith("locks/exclusive-")]
        held = lock._held
        lock.release()
    # malformed = garbage: the exclusive lock is granted (and the garbage removed), never leaked unheld
    assert held and leaked == [lock.key]
    assert "locks/shared-malformed" not in _keys(be)


# -- a lock held by another process -------------------------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys, time
    from deltackpt.store import Store
    from deltackpt.store.lock import SHARED
    store = Store.open(sys.argv[1])
    with store.lock(SHARED):
        print("locked", flush=True)
        time.sleep(120)
    """
)


def test_lock_of_another_process_blocks_until_it_dies(local_store, rng):
    store = local_store
    store.save("a", {"x": random_array(rng, "float32", (3000,))})
    store.forget("a")
    root = store.backend.local_path()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], cwd=REPO_ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
        (held,) = list_locks(store.backend)
        assert held["pid"] == proc.pid and held["stale"] is False
        with pytest.raises(StoreLockedError, match=f"pid {proc.pid}"):
            plan_gc(store, grace_s=0).execute(wait_s=0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)  # reaped: its pid no longer exists
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert list_locks(store.backend)[0]["stale"] is True  # dead pid on this host
    result = plan_gc(store, grace_s=0).execute()
    assert result.deleted_packs == 1
    assert _keys(store.backend) == []  # the abandoned lock was cleaned up


def test_a_failing_release_never_hides_the_error_inside_the_lock(tmp_path):
    from deltackpt.store import MemoryBackend
    from deltackpt.store.lock import StoreLock

    class Unreachable(MemoryBackend):
        down = False

        def delete(self, key):
            if self.down:
                raise OSError("connection reset")
            super().delete(key)

    backend = Unreachable()
    with pytest.raises(ValueError, match="the real failure") as ei:
        with StoreLock(backend, "shared", refresh=False):
            backend.down = True
            raise ValueError("the real failure")
    assert any("could not be released" in n for n in ei.value.__notes__)
    backend.down = True
    with pytest.raises(OSError, match="connection reset"):  # with nothing else to report, the release error
        with StoreLock(backend, "shared", refresh=False):
            backend.down = True


def test_a_lock_of_another_pid_namespace_on_this_host_is_not_judged_by_its_pid(tmp_path):
    """A process in another PID namespace (a container with the node's network: same host name) holds a pid
    this process cannot see: only its time can make its lock stale. The same lock in this space with a dead
    pid is stale at once; one of an older release (no space) goes stale by its time only."""
    from deltackpt.store import lock as lock_mod

    if not lock_mod._process_space():
        pytest.skip("no /proc here: every lock is judged by its time")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    info = {"kind": "shared", "host": socket.gethostname(), "pid": dead.pid, "time": now, "id": "c"}
    assert lock_mod._is_stale({**info, "space": lock_mod._process_space()}, now, STALE_AFTER_S)
    assert not lock_mod._is_stale({**info, "space": lock_mod._process_space().split(":")[0] + ":1"}, now, STALE_AFTER_S)
    assert not lock_mod._is_stale(info, now, STALE_AFTER_S)
    assert lock_mod._is_stale({**info, "time": now - 2 * STALE_AFTER_S}, now, STALE_AFTER_S)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_killed_process_not_yet_reaped_holds_no_lock():
    """A zombie answers kill(pid, 0); a save killed before its parent waits on it must not hold gc back."""
    from deltackpt.store.lock import _pid_alive

    child = subprocess.Popen(["sleep", "60"])
    try:
        assert _pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _pid_alive(child.pid) and time.monotonic() < deadline:  # dead once the kernel made it a zombie
            time.sleep(0.01)
        assert not _pid_alive(child.pid)
        with open(f"/proc/{child.pid}/stat", "rb") as f:  # not yet reaped: still there, as a zombie
            assert f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    finally:
        child.kill()
        child.wait()
    assert _pid_alive(os.getpid())


def test_a_refresh_put_in_flight_at_release_does_not_bring_the_lock_back(monkeypatch):
    """release() stops the refresh thread: a refresh put still running then (a slow NFS or object-store
    write, longer than release's wait for the thread) used to land after the lock object was deleted, a lock
    nobody held that kept gc out until it went stale."""
    from deltackpt.store import lock as lock_mod
    from deltackpt.store.backend import MemoryBackend

    class SlowRefresh(MemoryBackend):
        def put_transient(self, key, data):
            if threading.current_thread().name == "deltackpt-lock":
                time.sleep(0.6)
            return super().put_transient(key, data)

    monkeypatch.setattr(lock_mod, "_JOIN_S", 0.1)
    backend = SlowRefresh()
    lock = StoreLock(backend, SHARED, stale_after_s=0.4).acquire()  # refreshes every 0.1 s
    time.sleep(0.25)  # the refresh thread is inside its put
    lock.release()
    assert _keys(backend) == []
    time.sleep(0.8)  # long enough for any put in flight to have landed
    assert _keys(backend) == []
    StoreLock(backend, EXCLUSIVE, wait_s=0).acquire().release()


def test_check_in_a_while_looks_at_most_every_tenth_of_the_stale_limit():
    from deltackpt.store.backend import MemoryBackend

    backend = MemoryBackend()
    gets = []
    real_get = backend.get
    backend.get = lambda key: gets.append(key) or real_get(key)
    lock = StoreLock(backend, EXCLUSIVE, stale_after_s=STALE_AFTER_S).acquire()
    gets.clear()
    try:
        for _ in range(50):
            lock.check_in_a_while()
        assert len(gets) == 1
        backend.delete(lock.key)  # removed as stale by another process
        lock._checked_at -= STALE_AFTER_S / 10
        with pytest.raises(StoreLockedError):
            lock.check_in_a_while()
    finally:
        lock.release()

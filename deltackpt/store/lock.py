"""Store locks: saves share the store, gc's short delete phase needs it alone.

A lock is an object ``locks/<kind>-<id>`` holding JSON {kind, host, pid, space, time, id}; it is refreshed
(rewritten with a new time) while held. Taking a lock writes the object first, then lists the others: an exclusive
lock must be alone, a shared lock must see no exclusive one. Writing before looking means two racing
processes can both back off, but never both proceed.

Waiting, so that maintenance never costs a save: a shared lock (a save, gc's mark phase) that meets an
exclusive one removes its object, logs once on the ``deltackpt`` logger that it waits for gc, and tries
again until ``wait_s`` (default :data:`DEFAULT_WAIT_S`) has passed. An exclusive lock (gc's delete phase)
that meets shared ones keeps its object while it waits for them to be released, so no new save starts
meanwhile and gc is not starved by saves that overlap one another; it gives up after ``wait_s``. Two
exclusive locks never wait for each other: the later one is refused at once (:class:`StoreLockedError`).

The protocol with gc (see :mod:`.gc`): a save holds its shared lock from before it decides which existing
chunks to reuse (its *claims*: the index's chunks it deduplicates against, its parent's chunks and delta
bases) until its manifest is written. gc deletes only under the exclusive lock, after re-checking its plan
against the manifests present at that moment, so no chunk a committed checkpoint or an in-flight save
needs is ever deleted. Lock objects are written through temp files; gc never removes a temp file under
``locks/`` younger than ``STALE_AFTER_S`` (it may be a lock being taken right now). They are not fsynced
(``Backend.put_transient``): a lock speaks only for its running holder, which a crash ends too; one that a
crash damaged is garbage that the next taker removes, and one lost under a live holder fails its ``check``.

A lock is *stale* when its time is older than ``stale_after_s`` (its holder stopped refreshing it), or when it
was taken on this host, in this PID namespace (``space``), by a process that no longer exists. Stale locks are
ignored and removed by whoever finds them. A holder whose own lock went stale or was removed must not commit:
:meth:`StoreLock.check` raises, because gc may already have deleted chunks it relies on.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid

from ..errors import StoreLockedError

SHARED = "shared"
EXCLUSIVE = "exclusive"
STALE_AFTER_S = 300.0
DEFAULT_WAIT_S = 600.0  # how long a save waits for gc (and gc for running saves) before giving up
_POLL_S = (0.02, 1.0)  # first and longest pause between two looks while waiting
_LOCK_ID = re.compile(r"[0-9a-f]{16}")
_JOIN_S = 5.0  # how long release() waits for the refresh thread to end (its put in flight is waited for anyway)

log = logging.getLogger("deltackpt")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed process its parent has not reaped yet (a zombie) still answers kill(0), but holds nothing.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]  # the field after "(comm)", which may hold ")"
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


@functools.cache
def _process_space() -> str:
    """Which processes a pid names here: this boot of the machine and this PID namespace. Containers that share
    the node's network share its host name, not its pids: a holder's pid is looked up only in its own space
    (a save on the host looked dead to a gc in a container, which removed its lock and deleted packs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""  # no /proc: locks of this host go stale by their time only



def _is_stale(info: dict, now: float, stale_after_s: float) -> bool:
    # Either way: a time further ahead than a refresh interval's worth of clock skew is a damaged or forged
    # time, and would otherwise hold the store forever (clocks are assumed within stale_after_s both ways).
    if abs(now - float(info.get("time", 0))) > stale_after_s:
        return True
    # (A lock of an older release names no space: stale by its time only.)
    space = _process_space()
    return (bool(space) and info.get("space") == space and info.get("host") == socket.gethostname()
            and not _pid_alive(int(info.get("pid", -1))))


def _parse(data: bytes) -> dict | None:
    """A lock object's fields, or None for anything malformed (treated as garbage and removed)."""
    try:
        info = json.loads(data)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    if not isinstance(info, dict) or info.get("kind") not in (SHARED, EXCLUSIVE):
        return None
    pid, when = info.get("pid"), info.get("time")
    if type(pid) is not int or not (0 < pid < 2**31) or type(when) not in (int, float) or not math.isfinite(when):
        return None
    if not isinstance(info.get("host"), str):
        return None
    return info


class StoreLock:
    """A held lock; use as a context manager. Refreshed by a daemon thread every ``stale_after_s / 4``.

    ``wait_s``: how long :meth:`acquire` waits for a conflicting lock to go away (0: not at all)."""

    def __init__(self, backend, kind: str, *, stale_after_s: float = STALE_AFTER_S, refresh: bool = True,
                 wait_s: float = DEFAULT_WAIT_S, lock_id: str | None = None):
        """``lock_id``: 16 hex digits chosen by the caller (see :func:`remove_lock`), else a random one."""
        if kind not in (SHARED, EXCLUSIVE):
            raise ValueError(f"lock kind must be {SHARED!r} or {EXCLUSIVE!r}")
        if lock_id is not None and not _LOCK_ID.fullmatch(lock_id):
            raise ValueError(f"lock_id must be 16 hex digits, got {lock_id!r}")
        if not wait_s >= 0:
            raise ValueError(f"wait_s must be >= 0 seconds, got {wait_s!r}")
        self.wait_s = float(wait_s)
        self.backend = backend
        self.kind = kind
        self.id = lock_id or uuid.uuid4().hex[:16]
        self.key = f"locks/{kind}-{self.id}"
        self.stale_after_s = stale_after_s
        self._refresh = refresh
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False
        self._io = threading.Lock()  # a refresh's look-and-put, which release() must not overtake
        self._checked_at = float("-inf")  # when check_in_a_while last looked (monotonic)

    def _payload(self) -> bytes:
        return json.dumps({"kind": self.kind, "host": socket.gethostname(), "pid": os.getpid(),
                           "space": _process_space(),
                           "time": time.time(), "id": self.id}).encode()

    def acquire(self) -> "StoreLock":
        deadline = time.monotonic() + self.wait_s
        if self.kind == SHARED:
            self._acquire_shared(deadline)
        else:
            self._acquire_exclusive(deadline)
        self._held = True
        return self

    def _acquire_shared(self, deadline: float) -> None:
        pause, waited = _POLL_S[0], False
        while True:
            self.backend.put_transient(self.key, self._payload())
            try:
                other = self._conflict()
            except BaseException:
                self.backend.delete(self.key)  # never leave our lock behind when we did not get it
                raise
            if other is None:
                break
            self.backend.delete(self.key)  # a waiting save holds nothing: gc must not wait for it
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._locked_error(other, waited)
            if not waited:
                log.warning("waiting for gc to finish (exclusive lock by pid %s on %s), up to %.0f s",
                            other["pid"], other["host"], self.wait_s)
                waited = True
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _POLL_S[1])
        if waited:
            log.info("gc finished; continuing")
        self._start_refresh()

    def _acquire_exclusive(self, deadline: float) -> None:
        self.backend.put_transient(self.key, self._payload())
        self._start_refresh()  # a long wait for saves must not let our own lock go stale
        pause, waited = _POLL_S[0], False
        try:
            while True:
                other = self._conflict()
                if other is None:
                    break
                remaining = deadline - time.monotonic()
                if other["kind"] == EXCLUSIVE or remaining <= 0:
                    raise self._locked_error(other, waited)
                if not waited:
                    log.info("gc waits for running saves to finish (shared lock by pid %s on %s), up to %.0f s",
                             other["pid"], other["host"], self.wait_s)
                    waited = True
                time.sleep(min(pause, remaining))
                pause = min(pause * 2, _POLL_S[1])
            self._held = True
            self.check()  # still ours after the wait (never judged stale meanwhile)
        except BaseException:
            self._held = False
            self._stop_refresh()
            self.backend.delete(self.key)  # never leave our lock behind when we did not get it
            raise

    def _start_refresh(self) -> None:
        if self._refresh and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._refresh_loop, name="deltackpt-lock", daemon=True)
            self._thread.start()

    def _stop_refresh(self) -> None:
        self._stop.set()
        with self._io:  # a refresh put in flight ends before the caller deletes the object
            pass
        if self._thread is not None:
            self._thread.join(timeout=_JOIN_S)
            self._thread = None

    def _conflict(self) -> dict | None:
        """The first live lock that conflicts with ours, or None; garbage and stale locks are removed."""
        now = time.time()
        for info in self.backend.list("locks/"):
            if info.key == self.key:
                continue
            try:
                other = _parse(self.backend.get(info.key))
            except FileNotFoundError:
                continue
            if other is None or _is_stale(other, now, self.stale_after_s):
                self.backend.delete(info.key)  # garbage or abandoned: clean it up
                continue
            if self.kind == EXCLUSIVE or other["kind"] == EXCLUSIVE:
                return other
        return None

    def _locked_error(self, other: dict, waited: bool) -> StoreLockedError:
        why = ("another gc is running" if self.kind == EXCLUSIVE and other["kind"] == EXCLUSIVE
               else "gc needs the store alone" if self.kind == EXCLUSIVE else "a gc is running")
        after = f"; gave up after waiting {self.wait_s:.0f}s" if waited else ""
        return StoreLockedError(
            f"store is locked ({other['kind']} lock by pid {other['pid']} on {other['host']}, "
            f"{time.time() - float(other['time']):.0f}s ago); {why}{after}")

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.stale_after_s / 4):
            with self._io:
                if self._stop.is_set():
                    break  # released meanwhile: never write the object back
                try:
                    if self.backend.exists(self.key):  # never resurrect a lock someone removed as stale
                        self.backend.put_transient(self.key, self._payload())
                except OSError:
                    pass

    def check_in_a_while(self, margin: float = 0.5) -> None:
        """:meth:`check` (``margin``) at most every tenth of the stale limit: for a holder acting in a long loop
        (gc's deletes) while its refreshes may be failing, so that a lock gone stale, maybe a save's by now,
        stops it, at one read of the lock object per 30 s instead of one per step."""
        now = time.monotonic()
        if now - self._checked_at >= self.stale_after_s / 10:
            self.check(margin)
            self._checked_at = now

    def check(self, margin: float = 1.0) -> None:
        """Raise StoreLockedError if this lock is no longer valid (removed, or gone stale). ``margin`` < 1:
        also when its object is older than that share of the stale limit (a holder about to act for a while)."""
        try:
            info = _parse(self.backend.get(self.key))
        except FileNotFoundError:
            info = None
        if not self._held or info is None or _is_stale(info, time.time(), self.stale_after_s * margin):
            raise StoreLockedError(f"this process's {self.kind} lock on the store was lost (stale or removed); "
                                   "refusing to commit, since gc may have run")

    def release(self) -> None:
        self._stop_refresh()
        if self._held:
            self.backend.delete(self.key)
            self._held = False

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.release()
            return
        try:
            self.release()
        except Exception as e:  # noqa: BLE001 - the error already on its way out is the one to report
            exc.add_note(f"(the store lock {self.key} could not be released either: {e}; it goes stale in "
                         f"{self.stale_after_s:.0f} s)")

    def __getstate__(self):
        raise TypeError("a held StoreLock cannot be pickled")


def remove_lock(backend, kind: str, lock_id: str) -> None:
    """Delete the lock object ``lock_id`` of ``kind`` if it is there: a lock another process took for this one
    and holds no more use for (DCP's checkpoint process, whose save failed on another rank, is told nothing).
    Its holder's refreshes look before they write, so they do not write it back, unless the removal falls
    between a refresh's look and its write (one round trip in each quarter of the stale limit): then the lock
    lives on until its holder is collected, at the latest until it goes stale once that process ends."""
    if kind not in (SHARED, EXCLUSIVE) or not _LOCK_ID.fullmatch(lock_id):
        raise ValueError(f"not a lock: {kind!r} {lock_id!r}")
    backend.delete(f"locks/{kind}-{lock_id}")


def list_locks(backend) -> list[dict]:
    """Every lock object, with a ``stale`` flag (for the CLI)."""
    out, now = [], time.time()
    for info in backend.list("locks/"):
        try:
            parsed = _parse(backend.get(info.key))
        except FileNotFoundError:
            continue
        if parsed is not None:
            parsed["stale"] = _is_stale(parsed, now, STALE_AFTER_S)
            parsed["key"] = info.key
            out.append(parsed)
    return out

"""Store locks: saves share the store, gc needs it alone.

A lock is an object ``locks/<kind>-<id>`` holding JSON {kind, host, pid, time, id}; it is refreshed (rewritten
with a new time) while held. Taking a lock writes the object first, then lists the others: an exclusive
lock must be alone, a shared lock must see no exclusive one; on conflict the new lock is removed and
:class:`StoreLockedError` names the holder. Writing before looking means two racing processes can both back
off, but never both proceed.

A lock is *stale* when its time is older than ``stale_after_s`` (its holder stopped refreshing it), or when it
was taken on this host by a process that no longer exists. Stale locks are ignored and removed by whoever
finds them. A holder whose own lock went stale or was removed must not commit: :meth:`StoreLock.check`
raises, because gc may already have deleted chunks it relies on.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from ..errors import StoreLockedError

SHARED = "shared"
EXCLUSIVE = "exclusive"
STALE_AFTER_S = 300.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stale(info: dict, now: float, stale_after_s: float) -> bool:
    if now - float(info.get("time", 0)) > stale_after_s:
        return True
    return info.get("host") == socket.gethostname() and not _pid_alive(int(info.get("pid", -1)))


def _parse(data: bytes) -> dict | None:
    """A lock object's fields, or None for anything malformed (treated as garbage and removed)."""
    try:
        info = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(info, dict) or info.get("kind") not in (SHARED, EXCLUSIVE):
        return None
    pid, when = info.get("pid"), info.get("time")
    if type(pid) is not int or not (0 < pid < 2**31) or type(when) not in (int, float) or when != when:
        return None
    if not isinstance(info.get("host"), str):
        return None
    return info


class StoreLock:
    """A held lock; use as a context manager. Refreshed by a daemon thread every ``stale_after_s / 4``."""

    def __init__(self, backend, kind: str, *, stale_after_s: float = STALE_AFTER_S, refresh: bool = True):
        if kind not in (SHARED, EXCLUSIVE):
            raise ValueError(f"lock kind must be {SHARED!r} or {EXCLUSIVE!r}")
        self.backend = backend
        self.kind = kind
        self.id = uuid.uuid4().hex[:16]
        self.key = f"locks/{kind}-{self.id}"
        self.stale_after_s = stale_after_s
        self._refresh = refresh
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False

    def _payload(self) -> bytes:
        return json.dumps({"kind": self.kind, "host": socket.gethostname(), "pid": os.getpid(),
                           "time": time.time(), "id": self.id}).encode()

    def acquire(self) -> "StoreLock":
        self.backend.put(self.key, self._payload())
        try:
            self._check_others()
        except BaseException:
            self.backend.delete(self.key)  # never leave our lock behind when we did not get it
            raise
        self._held = True
        if self._refresh:
            self._thread = threading.Thread(target=self._refresh_loop, name="deltackpt-lock", daemon=True)
            self._thread.start()
        return self

    def _check_others(self) -> None:
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
                raise StoreLockedError(
                    f"store is locked ({other['kind']} lock by pid {other['pid']} on {other['host']}, "
                    f"{now - float(other['time']):.0f}s ago); "
                    + ("gc needs the store alone" if self.kind == EXCLUSIVE else "a gc is running"))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.stale_after_s / 4):
            try:
                if self.backend.exists(self.key):  # never resurrect a lock someone removed as stale
                    self.backend.put(self.key, self._payload())
            except OSError:
                pass

    def check(self) -> None:
        """Raise StoreLockedError if this lock is no longer valid (removed, or gone stale)."""
        try:
            info = _parse(self.backend.get(self.key))
        except FileNotFoundError:
            info = None
        if not self._held or info is None or _is_stale(info, time.time(), self.stale_after_s):
            raise StoreLockedError(f"this process's {self.kind} lock on the store was lost (stale or removed); "
                                   "refusing to commit, since gc may have run")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._held:
            self.backend.delete(self.key)
            self._held = False

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __getstate__(self):
        raise TypeError("a held StoreLock cannot be pickled")


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

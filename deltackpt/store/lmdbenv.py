"""The index cache's LMDB: environments opened once per path per process, and a cache that repairs itself.

LMDB allows one open environment per path per process, so environments are shared through a small
process-level registry (keyed by resolved path, tagged with the pid that opened it) and never pickled or
inherited across ``fork``. Opening refuses what would crash the process instead of raising: too little free
space (LMDB maps its lock file) and a data file shorter than its pages. :class:`LmdbCache` picks the first
writable location (else memory) and, through :func:`guarded`, repairs a damaged cache and retries.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import lmdb

try:
    import fcntl
except ImportError:  # not on Windows: no turns (LmdbCache.one_at_a_time holds nothing)
    fcntl = None

from ..errors import ManifestFormatError
from .memenv import MemoryEnv

log = logging.getLogger("deltackpt.store")

MAP_SIZE = 1 << 36  # virtual; the file grows as needed
DB_NAMES = (b"chunks", b"packs", b"meta", b"ckpts", b"verified")
# LMDB maps its lock file: touching a page of it on a full disk is SIGBUS, not an error Python can catch.
_MIN_FREE_BYTES = 1 << 20
_TURN_FILE = "turn.lock"  # in a cache's directory: flocked by the process whose turn it is (LmdbCache.one_at_a_time)
_TURN_WAIT_S = 600.0  # a turn held longer (a hung holder) is not waited for: the caller goes ahead alone

_envs: dict[str, tuple] = {}  # resolved path -> (pid, environment, named databases, data file identity)
_envs_lock = threading.Lock()

# Errors that say the cache cannot be written at this place (permissions, space, I/O), not that it is damaged.
_CANNOT_WRITE = (lmdb.ReadonlyError, lmdb.DiskError, lmdb.MapFullError, lmdb.MemoryError, lmdb.LockError,
                 lmdb.ReadersFullError, lmdb.TlsFullError)
_CANNOT_WRITE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO,
                        errno.ENOMEM}


def cannot_write(exc: BaseException) -> bool:
    """Whether ``exc`` says the cache cannot be written at its place (not that it is damaged)."""
    return (isinstance(exc, (OSError, *_CANNOT_WRITE))
            or (isinstance(exc, lmdb.Error) and getattr(exc, "code", None) in _CANNOT_WRITE_ERRNOS))


def open_env(path: Path) -> tuple[lmdb.Environment, dict[bytes, object]]:
    """The process's environment for ``path`` and its named databases, opened once."""
    key = str(path.resolve())
    with _envs_lock:
        hit = _live(_envs.get(key), path)
        if hit is not None:
            return hit[1], hit[2]
        path.mkdir(parents=True, exist_ok=True)
        free = os.statvfs(path)
        if free.f_bavail * free.f_frsize < _MIN_FREE_BYTES:
            raise OSError(errno.ENOSPC, "too little free space to open an LMDB cache", str(path))
        # metasync=False: one flush per commit instead of two (a save commits twice); a power loss may undo
        # the last commit, never tear one, and a cache behind the store's newest commit catches up by listing.
        env = lmdb.open(str(path), map_size=MAP_SIZE, max_dbs=8, subdir=True, lock=True, readahead=False,
                        metasync=False)
        try:
            _check_not_truncated(env, path)
            dbs = {name: env.open_db(name) for name in DB_NAMES}
        except lmdb.Error:
            env.close()
            raise
        _envs[key] = (os.getpid(), env, dbs, _identity(path))
        return env, dbs


def opened_here(path: Path) -> tuple[lmdb.Environment, dict[bytes, object]] | None:
    """The environment this process has open at ``path`` (and its databases), or None."""
    hit = _live(_envs.get(str(path.resolve())), path)
    return (hit[1], hit[2]) if hit is not None else None


def inherited(path: Path) -> bool:
    """Whether the process this one was forked from had the environment at ``path`` open (on the files now
    there). This process cannot open those files again: py-lmdb's guard against opening one environment twice
    survives the fork, and closing the inherited environment here could release reader slots the parent's
    transactions hold. The files are not damaged: they must be left alone."""
    hit = _envs.get(str(path.resolve()))
    return hit is not None and hit[0] != os.getpid() and hit[3] == _identity(path)


def in_use(path: Path) -> bool:
    """Whether the files at ``path`` are an environment this process, or the one it was forked from, has open:
    readable, and never to be deleted as damage."""
    return opened_here(path) is not None or inherited(path)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path / "data.mdb")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _live(hit: tuple | None, path: Path) -> tuple | None:
    """``hit`` if it was opened by this process on the files now at ``path``: a cache directory deleted and
    made again (a store restored from a copy) is other files, and its old environment a stale index (a
    benchmark that replaced a store's copy at one path forgot against the previous copy's summaries)."""
    if hit is None or hit[0] != os.getpid() or hit[3] != _identity(path):
        return None
    return hit


def _check_not_truncated(env: lmdb.Environment, path: Path) -> None:
    """A data file shorter than the pages its meta page says it has (a copy cut short, a full disk) would
    crash the process with SIGBUS on the first read past its end: refuse it as a damaged cache instead."""
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(path / "data.mdb")
    if size < used:
        raise lmdb.CorruptedError(f"{path / 'data.mdb'} has {size} bytes, its pages need {used}")


def close_env(path: Path) -> None:
    key = str(path.resolve())
    with _envs_lock:
        hit = _envs.pop(key, None)
    if hit is not None and hit[0] == os.getpid():
        hit[1].close()


def guarded(best_effort: bool = False):
    """Run an index operation so that a fault of the cache is repaired and the operation retried.

    ``best_effort``: the operation only caches what can be had again (summaries, verification times), so
    when the cache cannot be written it is skipped rather than moving the index into memory.
    """

    def wrap(op):
        @functools.wraps(op)
        def run(self, *args, **kwargs):
            for attempt in range(3):
                gen = self._gen
                try:
                    return op(self, *args, **kwargs)
                except (lmdb.Error, ManifestFormatError) as exc:
                    # A malformed record in a cache this process rebuilt from the packs is not the cache's fault.
                    if attempt == 2 or (isinstance(exc, ManifestFormatError) and self._trusted):
                        raise
                    if best_effort and cannot_write(exc):
                        self._warn("skip", f"index cache {self.path} cannot be written ({exc}); not caching")
                        return None
                    self._recover(exc, gen)
            raise AssertionError("unreachable")

        return run

    return wrap


class LmdbCache:
    """A cache in LMDB under the first of ``candidates`` this process can write, else in memory, that repairs
    itself on a fault (see :func:`guarded`); a subclass says how to refill it (``_rebuild``)."""

    def __init__(self, candidates: list[Path]) -> None:
        self._candidates = candidates
        self.path: Path | None = candidates[0]  # the LMDB in use; None while the cache is in memory
        self._env = None
        self._db: dict[bytes, object] = {}
        self._pid = None
        self._gen = 0  # bumped by every repair: an operation that failed before it just retries
        self._trusted = False  # rebuilt from the packs by this process (or in memory)
        self._repair_lock = threading.RLock()
        self._warned: set[str] = set()

    def _rebuild(self, *args, **kwargs):
        raise NotImplementedError

    @contextlib.contextmanager
    def one_at_a_time(self):
        """Held by one process (or thread) of this cache at a time: an flock on a file in its directory, so
        that of the processes sharing a node-local cache one does a costly refresh and the others find it done.
        Where no lock can be had (a cache in memory, a directory this user cannot write) it holds nothing."""
        self.env  # opened: path is the location in use, None in memory
        fd = None
        if self.path is not None:
            try:
                fd = os.open(self.path / _TURN_FILE, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                fd = None
        try:
            if fd is not None:
                _flock(fd)
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the flock

    @property
    def env(self):
        if self._env is None or (self.path is not None and self._pid != os.getpid()):
            with self._repair_lock:
                if self._env is None or (self.path is not None and self._pid != os.getpid()):
                    self._open()
        return self._env

    def _open(self) -> None:
        """Open the first candidate location this process can write; else keep the index in memory."""
        for path in self._candidates:
            opened = self._open_at(path)
            if opened is not None:
                self._env, self._db = opened
                self.path, self._pid = path, os.getpid()
                return
        self._use_memory(f"no index cache location is writable ({', '.join(map(str, self._candidates))})")

    def _open_at(self, path: Path):
        if inherited(path):
            # A forked child (a multiprocessing worker): the parent's cache stays as it is, in use; this process
            # takes the next location. (Taken for damage, it was deleted under the parent and its other users.)
            log.debug("index cache %s is open in the process this one was forked from; trying the next "
                      "location", path)
            return None
        try:
            return open_env(path)
        except (lmdb.Error, OSError) as exc:
            if cannot_write(exc):
                log.debug("index cache %s is not usable (%s); trying the next location", path, exc)
                return None
            # An unreadable cache is rebuilt, never trusted.
            self._warn("damaged", f"index cache {path} is damaged ({exc}); rebuilding it from the pack tables")
            close_env(path)
            shutil.rmtree(path, ignore_errors=True)
            try:
                return open_env(path)
            except (lmdb.Error, OSError):
                return None

    def _use_memory(self, why: str) -> None:
        self._warn("memory", f"{why}; keeping the chunk index in memory (rebuilt from the pack tables)")
        self._env = MemoryEnv(DB_NAMES)
        self._db = self._env.dbs
        self.path = None

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)

    def _recover(self, exc: BaseException, gen: int) -> None:
        """Make the index usable again after ``exc`` (seen by an operation started at generation ``gen``)."""
        with self._repair_lock:
            if gen != self._gen:
                return  # another thread repaired it meanwhile
            self._gen += 1
            path = self.path
            if path is not None:
                here = opened_here(path)
                if here is not None and here[0] is not self._env:
                    self._env, self._db = here  # another index of this process already reopened it
                    return
            if path is not None and not cannot_write(exc):
                self._warn("damaged", f"index cache {path} is damaged ({exc}); rebuilding it from the pack tables")
                close_env(path)
                shutil.rmtree(path, ignore_errors=True)
                try:
                    self._env, self._db = open_env(path)
                    self._pid = os.getpid()
                    self._rebuild()
                    return
                except (lmdb.Error, OSError) as again:
                    exc = again
            if path is not None:
                close_env(path)
            self._use_memory(f"index cache {path} cannot be written ({exc})")
            self._rebuild()


def _flock(fd: int) -> None:
    """Take an exclusive flock on ``fd``, waiting up to _TURN_WAIT_S (then going ahead without it)."""
    if fcntl is None:
        return
    deadline, pause = time.monotonic() + _TURN_WAIT_S, 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                log.warning("an index cache refresh by another process has taken over %.0f s; going ahead",
                            _TURN_WAIT_S)
                return
            time.sleep(pause)
            pause = min(2 * pause, 0.1)
        except OSError:
            return  # a file system without flock: no turns

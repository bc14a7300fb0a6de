"""Object backends: where the store's immutable objects live.

The engine sees a flat namespace of keys (``config``, ``packs/ab/ab12...``, ``manifests/step-100``) mapped
to whole, immutable byte objects. :class:`Backend` is that small core: put / put_new / get / get_range
(and get_range_into) / list / delete / exists / size, with no append and no in-place edit; object storage
(``fsspec_backend.FsspecBackend``) and ``MemoryBackend`` implement only it. What only files on this machine
allow (a spool file published by a rename, caches beside the objects, page-cache probes, crash temp files)
is the optional :class:`LocalFiles` capability, which the engine checks with ``isinstance``.

``LocalBackend`` makes each ``put`` atomic and durable: write a temp file in the same directory, fsync it,
rename it over the key, fsync the directory. A crash therefore leaves either the old object, the new one,
or a stray ``*.tmp-*`` file that ``list`` ignores and ``gc`` removes. ``put_transient`` (lock objects) is
atomic the same way but skips the fsyncs: such an object speaks only for running processes, which a crash ends.
"""

from __future__ import annotations

import abc
import errno
import functools
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import DeltackptError, DiskFullError, StorePermissionError

_TMP_MARK = ".tmp-"
STORE_FOLDERS = ("packs", "manifests", "locks", "tags", "commits")  # the store's folders of objects; see Store.init
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def raise_if_disk_full(err: OSError, path, needed_bytes: int | None = None) -> None:
    """Raise :class:`DiskFullError` naming ``path`` (from ``err``) when ``err`` says the filesystem is full."""
    if err.errno not in _NO_SPACE or isinstance(err, DiskFullError):
        return
    try:
        st = os.statvfs(os.path.dirname(os.fspath(path)) or ".")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    raise DiskFullError(os.fspath(path), needed_bytes, free, err.errno) from err


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size_bytes: int
    mtime_s: float = 0.0  # when the object was written (seconds since the epoch)


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, with no empty, '.' or '..' segment."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in key or "\0" in key or _TMP_MARK in key:
        raise ValueError(f"invalid object key {key!r}")
    return key


class Backend(abc.ABC):
    """Whole-object storage. Every method is safe to call from several threads."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key`` atomically; replaces an existing object."""

    def put_transient(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """:meth:`put` for an object that only coordinates running processes (a lock), or a hint whose loss
        costs only time (a commit record): as atomic, but it need not survive a crash. Backends may skip
        making it durable."""
        self.put(key, data)

    @abc.abstractmethod
    def put_new(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key`` only if no object is there (atomically); else FileExistsError.

        A remote backend may succeed when the object already holds exactly ``data`` (its own earlier send,
        whose response was lost); callers that race put distinct bytes."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; ``FileNotFoundError`` when absent."""

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset``; fewer only when the object ends first."""

    def get_range_into(self, key: str, offset: int, buffers) -> int:
        """Fill the writable ``buffers`` (a sequence, in order, like ``preadv``) with the bytes from ``offset``.

        Returns how many bytes were read: fewer than the buffers hold only when the object ends first. Saves
        the copy a reader would make from ``get_range``'s bytes into its own buffers (a destination tensor);
        this default does make it, through ``get_range``.
        """
        views = [memoryview(b).cast("B") for b in buffers]
        data = memoryview(self.get_range(key, offset, sum(len(v) for v in views)))
        pos = 0
        for v in views:
            n = min(len(v), len(data) - pos)
            v[:n] = data[pos : pos + n]
            pos += n
        return pos

    def get_ranges_into(self, key: str, ranges) -> list[int]:
        """``get_range_into`` for each ``(offset, buffers)`` of ``ranges`` (one object's ranges, in order): the
        byte counts. A reader of many chunks of one pack reads them with one call; a local backend opens the
        file once for all of them, a remote one sends a ranged GET per range."""
        return [self.get_range_into(key, offset, buffers) for offset, buffers in ranges]

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (a '/'-terminated prefix lists a folder)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` holds an object."""

    def size(self, key: str) -> int:
        """The object's size in bytes; ``FileNotFoundError`` when absent."""
        for info in self.list(key):
            if info.key == key:
                return info.size_bytes
        raise FileNotFoundError(key)


class LocalFiles(abc.ABC):
    """What only a backend whose objects are files on this machine can do (the engine checks for it with
    ``isinstance``): stream a pack into a spool file and publish it by a rename, keep caches beside the
    objects, probe the page cache, and find the temp files a crash left."""

    @abc.abstractmethod
    def local_path(self) -> Path:
        """The directory holding the objects."""

    @abc.abstractmethod
    def spool_path(self) -> Path:
        """A fresh temp path on the store's file system to stream a new object into."""

    @abc.abstractmethod
    def put_spooled(self, key: str, f) -> None:
        """Publish the bytes written to the open spool file ``f`` (from ``spool_path``) under ``key``."""

    @abc.abstractmethod
    def is_cached(self, key: str, offset: int) -> bool | None:
        """Whether the byte at ``offset`` of ``key`` can be read without waiting on a device (page cache),
        or None when the file system cannot tell."""

    @abc.abstractmethod
    def list_temp(self) -> list[tuple[str, float]]:
        """Stray temp files left by a crash mid-put: (relative path, mtime)."""

    @abc.abstractmethod
    def delete_temp(self, rel_path: str) -> None:
        """Remove one of ``list_temp``'s files."""


def local_root(backend) -> Path | None:
    """The directory of a local backend's objects, or None for object storage and memory."""
    return backend.local_path() if isinstance(backend, LocalFiles) else None


def spool_for(backend) -> Path | None:
    """A spool file path to stream a new pack into, on a local backend; None elsewhere (built in memory)."""
    return backend.spool_path() if isinstance(backend, LocalFiles) else None


class MemoryBackend(Backend):
    """A dict of bytes, for tests and scratch stores."""

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._mtimes: dict[str, float] = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        with self._lock:
            return {"_objects": dict(self._objects), "_mtimes": dict(self._mtimes)}

    def __setstate__(self, state):
        self._objects = state["_objects"]
        self._mtimes = state.get("_mtimes", {})
        self._lock = threading.Lock()

    def put(self, key, data):
        check_key(key)
        with self._lock:
            self._objects[key] = bytes(data)
            self._mtimes[key] = time.time()

    def put_new(self, key, data):
        check_key(key)
        with self._lock:
            if key in self._objects:
                raise FileExistsError(key)
            self._objects[key] = bytes(data)
            self._mtimes[key] = time.time()

    def get(self, key):
        check_key(key)
        with self._lock:
            try:
                return self._objects[key]
            except KeyError:
                raise FileNotFoundError(key) from None

    def get_range(self, key, offset, length):
        check_key(key)
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        return self.get(key)[offset : offset + length]

    def list(self, prefix=""):
        with self._lock:
            items = sorted((k, len(v), self._mtimes.get(k, 0.0)) for k, v in self._objects.items()
                           if k.startswith(prefix))
        return iter([ObjectInfo(k, n, t) for k, n, t in items])

    def delete(self, key):
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)
            self._mtimes.pop(key, None)

    def exists(self, key):
        check_key(key)
        with self._lock:
            return key in self._objects

    def size(self, key):
        return len(self.get(key))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writes(method):
    """A LocalBackend method that writes: the OS's refusal becomes the store's typed error, naming the path."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            if isinstance(e, DeltackptError):
                raise
            path = e.filename or self.root
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StorePermissionError(f"cannot write {path} ({e.strerror}): the store at {self.root} is "
                                           "read-only for this user") from e
            raise_if_disk_full(e, path)
            raise

    return run


_IOV_MAX = 1024  # buffers one preadv takes on Linux (UIO_MAXIOV); more fail with EINVAL


def _byte_view(buf) -> memoryview:
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous:
        return buf  # already one (a reader's slices of its destination): casting costs 1 us a chunk
    return memoryview(buf).cast("B")


def _preadv_all(fd: int, buffers, offset: int) -> int:
    """Fill ``buffers`` in order from ``offset`` of ``fd`` (at most _IOV_MAX per call); the bytes read, fewer
    only when the file ends first."""
    views = [v for v in map(_byte_view, buffers) if len(v)]
    done, first = 0, 0
    while first < len(views):
        n = os.preadv(fd, views[first:first + _IOV_MAX], offset + done)
        if n == 0:
            break  # the object ended
        done += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]
    return done


class LocalBackend(Backend, LocalFiles):
    """Objects as files under a root directory; puts are temp file + fsync + rename + fsync(dir)."""

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self._read_paths: dict[str, str] = {}  # key -> file path, for reads (a probe reads hundreds per save)
        self._made_dirs: set[Path] = set()
        self._dirs_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalBackend({str(self.root)!r})"

    def __getstate__(self):
        return {"root": self.root, "fsync": self.fsync}

    def __setstate__(self, state):
        self.__init__(state["root"], fsync=state["fsync"])

    def local_path(self) -> Path:
        return self.root

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _read_path(self, key: str) -> str:
        """``_path(key)`` as a string, remembered: building and checking it took 15 us a read."""
        path = self._read_paths.get(key)
        if path is None:
            if len(self._read_paths) >= 65536:
                self._read_paths.clear()
            path = self._read_paths[key] = os.path.join(self.root, check_key(key))
        return path

    def _ensure_dir(self, d: Path) -> None:
        if d in self._made_dirs:
            return
        created = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        if created and self.fsync:
            _fsync_dir(d.parent)
        with self._dirs_lock:
            self._made_dirs.add(d)

    def _write_temp(self, path: Path, data, durable: bool = True) -> Path:
        """Write ``data`` (durably) to a temp file beside ``path``; the caller links or renames it into place."""
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}")
        try:
            self._ensure_dir(path.parent)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync and durable:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise_if_disk_full(e, path, memoryview(data).nbytes)
            raise
        return tmp

    def put(self, key, data):
        self._put(key, data, durable=True)

    def put_transient(self, key, data):
        # Two fsyncs (file, directory) were 10-18 ms of a save's lock on a busy disk; a lock lost to a crash
        # is one whose holder died with it, and a lock that vanished is caught by StoreLock.check.
        self._put(key, data, durable=False)

    @_writes
    def _put(self, key, data, durable: bool):
        path = self._path(key)
        tmp = self._write_temp(path, data, durable)
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync and durable:
            _fsync_dir(path.parent)

    @_writes
    def spool_path(self) -> Path:
        d = self.root / "packs"
        self._ensure_dir(d)
        return d / f"spool{_TMP_MARK}{uuid.uuid4().hex[:12]}"

    @_writes
    def put_spooled(self, key, f):
        path = self._path(key)
        try:
            self._ensure_dir(path.parent)
            try:
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            finally:
                f.close()
            os.replace(f.name, path)
        except OSError as e:
            raise_if_disk_full(e, path)
            raise
        if self.fsync:
            _fsync_dir(path.parent)

    @_writes
    def put_new(self, key, data):
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)  # fails if the key exists: create-if-absent, atomically
        finally:
            tmp.unlink(missing_ok=True)
        if self.fsync:
            _fsync_dir(path.parent)

    def get(self, key):
        with open(self._read_path(key), "rb") as f:
            return f.read()

    def get_range(self, key, offset, length):
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        with open(self._read_path(key), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def is_cached(self, key, offset):
        """A one-byte ``preadv(RWF_NOWAIT)``: it fails with EAGAIN when the page is not in the page cache."""
        flag = getattr(os, "RWF_NOWAIT", None)
        if flag is None:
            return None
        try:
            fd = os.open(self._read_path(key), os.O_RDONLY)
        except OSError:
            return None
        try:
            return os.preadv(fd, [bytearray(1)], offset, flag) == 1
        except BlockingIOError:
            return False
        except OSError:
            return None  # e.g. a file system without RWF_NOWAIT
        finally:
            os.close(fd)

    def get_range_into(self, key, offset, buffers):
        return self.get_ranges_into(key, [(offset, buffers)])[0]

    def get_ranges_into(self, key, ranges):
        ranges = list(ranges)
        if any(offset < 0 for offset, _ in ranges):
            raise ValueError("offset must be >= 0")
        fd = os.open(self._read_path(key), os.O_RDONLY)
        try:
            return [_preadv_all(fd, buffers, offset) for offset, buffers in ranges]
        finally:
            os.close(fd)

    def list(self, prefix=""):
        if prefix and any(p in (".", "..") for p in prefix.split("/")[:-1]):
            raise ValueError(f"invalid list prefix {prefix!r}")
        # Walk only the directory the prefix points into.
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base_dir if base_dir else self.root
        if not start.is_dir():
            return iter(())
        out = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            for name in sorted(filenames):
                key = rel_dir + name
                if _TMP_MARK in name or not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return iter(sorted(out, key=lambda i: i.key))

    def list_temp(self) -> list[tuple[str, float]]:
        """Stray temp files left by a crash mid-put: (relative path, mtime); gc removes old ones.

        Only the store's own folders and its config's temp files are looked at: the directory may hold
        files that are not the store's."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            if dirpath == str(self.root):
                dirnames[:] = [d for d in dirnames if d in STORE_FOLDERS]
                filenames = [n for n in filenames if n.startswith((f"config{_TMP_MARK}", f"tier{_TMP_MARK}", f"gc-epoch{_TMP_MARK}"))]
            for name in filenames:
                if _TMP_MARK in name:
                    path = os.path.join(dirpath, name)
                    try:
                        out.append((os.path.relpath(path, self.root), os.stat(path).st_mtime))
                    except FileNotFoundError:
                        continue
        return sorted(out)

    @_writes
    def delete_temp(self, rel_path: str) -> None:
        parts = rel_path.split(os.sep)
        owned = parts[0] in STORE_FOLDERS or (len(parts) == 1 and parts[0].startswith((f"config{_TMP_MARK}", f"tier{_TMP_MARK}", f"gc-epoch{_TMP_MARK}")))
        if _TMP_MARK not in parts[-1] or ".." in parts or not owned:
            raise ValueError(f"not a temp file of the store: {rel_path!r}")
        (self.root / rel_path).unlink(missing_ok=True)

    @_writes
    def delete(self, key):
        self._path(key).unlink(missing_ok=True)

    def exists(self, key):
        return self._path(key).is_file()

    def size(self, key):
        return self._path(key).stat().st_size

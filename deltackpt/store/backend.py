"""Object backends: where the store's immutable objects live.

The engine sees a flat namespace of keys (``config``, ``packs/ab/ab12...``, ``manifests/step-100``) mapped
to whole, immutable byte objects. :class:`Backend` is that small core: put / put_new / get / get_range
(and get_range_into) / list / delete / exists / size, with no append and no in-place edit; object storage
(``fsspec_backend.FsspecBackend``) and ``MemoryBackend`` implement only it. What only files on this machine
allow (a spool file published by a rename, caches beside the objects, page-cache probes, crash temp files)
is the optional :class:`LocalFiles` capability, which the engine checks with ``isinstance``.

Objects as files on this machine are ``localbackend.LocalBackend``, whose every ``put`` is atomic and durable.
"""

from __future__ import annotations

import abc
import errno
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import DiskFullError

TMP_MARK = ".tmp-"
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


@dataclass(frozen=True, slots=True)  # a listing of a million packs holds a million of them
class ObjectInfo:
    key: str
    size_bytes: int
    mtime_s: float = 0.0  # when the object was written (seconds since the epoch)
    # What tells this write of the object from another write under the same key and size where ``mtime_s`` may
    # not (S3's LastModified has 1 s resolution): an S3 ETag, a local file's inode and mtime in ns; "" if none.
    version: str = ""


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, with no empty, '.' or '..' segment."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in key or "\0" in key or TMP_MARK in key:
        raise ValueError(f"invalid object key {key!r}")
    return key


class Backend(abc.ABC):
    """Whole-object storage. Every method is safe to call from several threads."""

    # Whether ObjectInfo.version comes from the object's bytes (an S3 ETag: a copy of the same bytes has the
    # same one), so a cache keyed by it survives a copy of the store; a local file's version (its inode) does
    # not, and its mtime in ns already tells a rewrite.
    content_versions = False

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


class UnfinishedUploads(abc.ABC):
    """What a backend whose large objects upload in parts (S3 multipart uploads) can do: find and abort the
    uploads a killed process or a failed completion left. Their parts are stored, and billed, until aborted,
    yet belong to no object: ``gc`` aborts those older than its grace period."""

    @abc.abstractmethod
    def list_unfinished(self) -> list[tuple[str, float]]:
        """(token, start time as a Unix timestamp) of each unfinished upload of an object of this store."""

    @abc.abstractmethod
    def abort_unfinished(self, token: str) -> None:
        """Abort one of ``list_unfinished``'s uploads (one already gone is no error)."""


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
        self._mtimes: dict[str, float] = {}  # when each object was written: strictly increasing
        self._last = 0.0
        self._lock = threading.Lock()

    def __getstate__(self):
        with self._lock:
            return {"_objects": dict(self._objects), "_mtimes": dict(self._mtimes)}

    def __setstate__(self, state):
        self._objects = state["_objects"]
        self._mtimes = state.get("_mtimes", {})
        self._last = max(self._mtimes.values(), default=0.0)
        self._lock = threading.Lock()

    def _stamp(self) -> float:
        """Now, later than any write before (under the lock)."""
        self._last = max(time.time(), self._last + 1e-6)  # 1 us apart: distinct as floats
        return self._last

    def put(self, key, data):
        check_key(key)
        with self._lock:
            self._objects[key] = bytes(data)
            self._mtimes[key] = self._stamp()

    def put_new(self, key, data):
        check_key(key)
        with self._lock:
            if key in self._objects:
                raise FileExistsError(key)
            self._objects[key] = bytes(data)
            self._mtimes[key] = self._stamp()

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
        return iter([ObjectInfo(k, n, t) for k, n, t in items])  # distinct mtimes: no version needed

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

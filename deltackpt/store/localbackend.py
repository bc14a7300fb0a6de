"""localbackend: the store's objects as files under a root directory (:class:`LocalBackend`).

Each ``put`` is atomic and durable: write a temp file in the same directory, fsync it, rename it over the
key, fsync the directory. A crash therefore leaves either the old object, the new one, or a stray
``*.tmp-*`` file that ``list`` ignores and ``gc`` removes. ``put_transient`` (lock objects) is atomic the
same way but skips the fsyncs: such an object speaks only for running processes, which a crash ends. It
implements the :class:`~.backend.LocalFiles` capability too: spool files, page-cache probes, temp files.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import uuid
from pathlib import Path

from ..errors import DeltackptError, StorePermissionError
from .backend import STORE_FOLDERS, TMP_MARK, Backend, LocalFiles, ObjectInfo, check_key, raise_if_disk_full

# The temp files of the objects at the store's top level (the rest live in STORE_FOLDERS).
_TOP_TEMPS = (f"config{TMP_MARK}", f"tier{TMP_MARK}", f"gc-epoch{TMP_MARK}")


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
        """``_path(key)`` as a string, remembered for packs: building and checking it took 15 us a read (other
        keys, a manifest's, are read about once: remembering them would only hold memory)."""
        path = self._read_paths.get(key)
        if path is None:
            if not key.startswith("packs/"):
                return os.path.join(self.root, check_key(key))
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
        tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}")
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
        return d / f"spool{TMP_MARK}{uuid.uuid4().hex[:12]}"

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
                if TMP_MARK in name or not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(key, st.st_size, st.st_mtime, f"{st.st_ino}-{st.st_mtime_ns}"))
        return iter(sorted(out, key=lambda i: i.key))

    def list_temp(self) -> list[tuple[str, float]]:
        """Stray temp files left by a crash mid-put: (relative path, mtime); gc removes old ones.

        Only the store's own folders and its config's temp files are looked at: the directory may hold
        files that are not the store's."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            if dirpath == str(self.root):
                dirnames[:] = [d for d in dirnames if d in STORE_FOLDERS]
                filenames = [n for n in filenames if n.startswith(_TOP_TEMPS)]
            for name in filenames:
                if TMP_MARK in name:
                    path = os.path.join(dirpath, name)
                    try:
                        out.append((os.path.relpath(path, self.root), os.stat(path).st_mtime))
                    except FileNotFoundError:
                        continue
        return sorted(out)

    @_writes
    def delete_temp(self, rel_path: str) -> None:
        parts = rel_path.split(os.sep)
        owned = parts[0] in STORE_FOLDERS or (len(parts) == 1 and parts[0].startswith(_TOP_TEMPS))
        if TMP_MARK not in parts[-1] or ".." in parts or not owned:
            raise ValueError(f"not a temp file of the store: {rel_path!r}")
        (self.root / rel_path).unlink(missing_ok=True)

    @_writes
    def delete(self, key):
        self._path(key).unlink(missing_ok=True)

    def exists(self, key):
        return self._path(key).is_file()

    def size(self, key):
        return self._path(key).stat().st_size

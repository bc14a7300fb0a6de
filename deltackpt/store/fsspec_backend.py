"""A Backend on any fsspec filesystem: S3 (s3fs), GCS, Azure, ``memory://``.

Object stores have no rename and no append, which the engine never needs: every object is written whole and
never changed (packs are named by their hash; a manifest put is the commit point). What the protocol relies on
(``docs/decisions.md``): S3's strong read-after-write consistency for PUT, GET, HEAD and LIST (since 2020,
and on MinIO/Ceph RGW), so a manifest is visible to every reader once its PUT returns and a commit's HEAD of
the packs it references sees them; a PUT is atomic (a reader sees the old object or the new one); and
``put_new`` is a conditional ``If-None-Match: *`` PUT where the filesystem supports it (S3), else a HEAD
followed by a PUT (two racers may both succeed).

Retries live here, not in the engine: throttling (503 SlowDown), 5xx, timeouts, refused, reset and dropped
connections and cut-off responses -- any error but the ones below -- are retried with exponential backoff and
full jitter (``backoff_s * 2**n``, at most ``max_backoff_s``), ``max_attempts`` tries in all (6 by default), then
:class:`BackendError` names the object and the operation on one line. Not retried: missing objects
(FileNotFoundError; but a PUT that answers "no such upload" is a multipart upload whose completion's response
was lost, and is retried), refused access and a missing bucket (BackendError at once), failed preconditions
and bad arguments. s3fs's and botocore's own retry loops are turned off so there is one policy, with one bound;
a connect timeout (10 s) and a read timeout (60 s, between two reads of a response) bound every attempt, so a
server that stops answering costs at most ``max_attempts`` timeouts (both are ``config_kwargs`` to change).
Every operation is safe to repeat after a lost response (aiohttp itself resends an idempotent request once
when a reused connection drops): objects are written whole and never changed, and a conditional put
(``put_new``) that finds exactly its own bytes there has succeeded. Multipart uploads a killed process left
(their parts are billed) are listed and aborted by ``gc`` past its grace period (:class:`UnfinishedUploads`);
empty "folder" objects (a console's "Create folder", FUSE mounts) are not keys of a store.
"""

from __future__ import annotations

import errno
import json
import os
import random
import threading
import time
from datetime import datetime
from typing import Callable, Iterator, TypeVar

from ..errors import BackendError
from .backend import Backend, ObjectInfo, UnfinishedUploads, check_key

T = TypeVar("T")

MiB = 1 << 20
MULTIPART_PART_BYTES = 8 * MiB  # objects of more than two parts upload as multipart, parts in parallel
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0  # the longest silence while reading a response (botocore's default, made explicit)
_NOT_RETRIED = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
                ValueError, TypeError, NotImplementedError, KeyError)


_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError")
_UPLOAD_TOKEN = "?uploadId="  # an unfinished upload's token: key + this + upload id


class _LostCompletion(Exception):
    """A PUT answered "no such upload": a multipart upload s3fs aborted after the response to its completion
    was lost (the server completed it, the abort found nothing). Retried: the object is there, and a resend
    writes it whole again (a conditional one finds its own bytes)."""


def _range_not_satisfiable(e: OSError) -> bool:
    """Whether ``e`` is S3's 416 (a range past the end of the object). s3fs maps it to EINVAL, and with it
    400s (InvalidRequest, TokenRefreshRequired, a 400 without a body) and 412: only the 416 means the end, the
    rest are errors to retry (read as an empty object, one made a good manifest look damaged)."""
    if e.errno != errno.EINVAL or isinstance(e, _NOT_RETRIED):
        return False
    resp = getattr(e.__cause__, "response", None) or {}
    return (resp.get("Error", {}).get("Code") == "InvalidRange"
            or resp.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416)


def _precondition_failed(e: OSError) -> bool:
    """Whether ``e`` is S3's 412 to a conditional (``If-None-Match: *``) PUT: the key exists. s3fs makes it a
    FileExistsError only when the error names its condition (AWS, moto); servers that leave the element out
    (MinIO and other S3-compatible stores) give OSError(EINVAL), which was retried as transient."""
    if isinstance(e, FileExistsError):
        return True
    response = getattr(e.__cause__, "response", None)
    if not isinstance(response, dict):
        return False
    return (response.get("Error", {}).get("Code") == "PreconditionFailed"
            or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412)


def _drop_expect(request, **_kwargs) -> None:
    """botocore sends PUTs with ``Expect: 100-continue``, and aiohttp waits for the 100 with no timeout: a
    server that accepted the connection and never answers hung the PUT (a save, an upload, a close waiting on
    it) for good. Without the header the body is sent at once and the read timeout bounds the wait."""
    if "Expect" in request.headers:
        del request.headers["Expect"]


_EXPECT_OPERATIONS = ("PutObject", "UploadPart", "CompleteMultipartUpload", "CreateMultipartUpload")


def _without_expect_continue(fs) -> None:
    """Drop ``Expect: 100-continue`` from the S3 writes of ``fs`` (an S3FileSystem). s3fs makes (and remakes,
    on a refresh or once its connections closed) its session and client in ``set_session``, which it awaits
    before every request: wrapped, each new client is fixed before its first request, and so is a session s3fs
    made itself (the clients it makes later per region). A session the caller passed in is left as it is: its
    other clients keep their header."""
    if getattr(fs, "_deltackpt_no_expect", False):
        return
    set_session = fs.set_session

    async def set_session_without_expect(*args, **kwargs):
        client = await set_session(*args, **kwargs)
        if getattr(fs, "_session_is_owned", False):
            _register_once(fs.session, fs.session)
        _register_once(fs._s3, getattr(fs._s3, "meta", None) and fs._s3.meta.events)
        return client

    fs.set_session = set_session_without_expect
    fs._deltackpt_no_expect = True


def _register_once(owner, events) -> None:
    if owner is None or events is None or getattr(owner, "_deltackpt_no_expect", False):
        return
    for op in _EXPECT_OPERATIONS:
        events.register(f"before-sign.s3.{op}", _drop_expect)
    owner._deltackpt_no_expect = True


def _put_once(fn: Callable[[], None]) -> None:
    try:
        fn()
    except FileNotFoundError as e:
        if "bucket does not exist" in str(e).lower():
            raise
        raise _LostCompletion(f"upload answered: {e}") from e


class FsspecBackend(Backend, UnfinishedUploads):
    """Objects under ``url`` (``s3://bucket/prefix``, ``memory://name``, ...) through fsspec.

    ``storage_options`` go to the fsspec filesystem (for S3: ``endpoint_url``, ``key``, ``secret``,
    ``client_kwargs``...); with none, s3fs takes credentials, region and ``AWS_ENDPOINT_URL`` from the
    environment and ``~/.aws`` as every AWS tool does. ``put_new`` (a manifest's commit) is a conditional PUT
    on S3, atomic on the server; on other filesystems it looks, then puts, so two saves of one name racing
    there can both succeed, the later manifest replacing the earlier (use distinct names per writer).
    """

    content_versions = True  # ETags, MD5 hashes: whole-second mtimes need them to tell a rewrite

    def __init__(self, url: str, storage_options: dict | None = None, *, max_attempts: int = 6,
                 backoff_s: float = 0.1, max_backoff_s: float = 5.0) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.max_attempts = max(1, int(max_attempts))
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        protocol = self.url.split("://", 1)[0]
        self.protocol = protocol
        options = dict(self.storage_options)
        # Listings are never cached, on any filesystem: other hosts add and delete objects (gcsfs and adlfs
        # answer info and listings from a per-instance cache that never expires, by default).
        options.setdefault("use_listings_cache", False)
        if protocol in ("s3", "s3a"):
            # One retry policy (ours).
            cfg = dict(options.pop("config_kwargs", {}) or {})
            cfg.setdefault("retries", {"total_max_attempts": 1})
            # A server that accepts a connection and never answers must cost a bounded time, not a hang.
            cfg.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
            cfg.setdefault("read_timeout", READ_TIMEOUT_S)
            options["config_kwargs"] = cfg
        options.setdefault("skip_instance_cache", True)
        self.fs, root = fsspec.core.url_to_fs(self.url, **options)
        if protocol in ("s3", "s3a"):
            self.fs.retries = 1  # s3fs's own loop (an instance attribute; not a constructor option)
        self.root = root.rstrip("/")
        self.fs = _shared_filesystem(self.fs, options)
        self._s3 = protocol in ("s3", "s3a")
        if self._s3:
            with _FILESYSTEMS_LOCK:
                _without_expect_continue(self.fs)
        self._put_kwargs = {"chunksize": MULTIPART_PART_BYTES} if self._s3 else {}
        self._rand = random.Random()
        self._rand_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FsspecBackend({self.url!r})"

    def __getstate__(self):
        return {"url": self.url, "storage_options": self.storage_options, "max_attempts": self.max_attempts,
                "backoff_s": self.backoff_s, "max_backoff_s": self.max_backoff_s}

    def __setstate__(self, state):
        self.__init__(state["url"], state["storage_options"], max_attempts=state["max_attempts"],
                      backoff_s=state["backoff_s"], max_backoff_s=state["max_backoff_s"])

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}" if self.root else check_key(key)

    # -- retries -----------------------------------------------------------------------------------------------
    def _retry(self, op: str, key: str, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except FileNotFoundError as e:
                if "bucket does not exist" in str(e).lower():
                    raise BackendError(f"{op} {self.url}: the bucket does not exist", key=key, operation=op) from None
                raise
            except PermissionError as e:
                raise BackendError(f"{op} {self.url}/{key}: access denied ({e}); check the credentials "
                                   "(environment, ~/.aws or storage options)", key=key, operation=op) from None
            except TypeError as e:
                if not self.storage_options:
                    raise
                # The filesystem's client refused an option it was given (a mistyped name, a number where it
                # takes a string).
                raise BackendError(f"{op} {self.url}: {e}; check the storage options "
                                   f"({', '.join(sorted(self.storage_options))})", key=key, operation=op) from None
            except _NOT_RETRIED:
                raise
            except Exception as e:  # noqa: BLE001 - throttling, 5xx, timeouts, resets: transient
                if type(e).__name__ in _NO_CREDENTIALS:  # botocore's: no retry finds credentials
                    raise BackendError(f"{op} {self.url}: {e}; set them in the environment, ~/.aws or the storage "
                                       "options", key=key, operation=op) from None
                if attempt == self.max_attempts:
                    detail = " ".join(f"{type(e).__name__}: {e}".split())  # HTTP client messages span lines
                    raise BackendError(f"{op} {self.url}/{key} failed after {attempt} attempt"
                                       f"{'s' if attempt > 1 else ''}: {detail}", key=key, operation=op) from e
                with self._rand_lock:
                    jitter = self._rand.random()
                time.sleep(jitter * min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
        raise AssertionError("unreachable")

    # -- core operations ---------------------------------------------------------------------------------------
    def put(self, key, data):
        path, body = self._path(key), bytes(data)
        self._retry("PUT", key, lambda: _put_once(lambda: self.fs.pipe_file(path, body, **self._put_kwargs)))

    def put_new(self, key, data):
        path, body = self._path(key), bytes(data)
        if self._put_kwargs:  # S3: a conditional PUT, atomic on the server
            def create() -> None:
                try:
                    _put_once(lambda: self.fs.pipe_file(path, body, mode="create", **self._put_kwargs))
                except OSError as e:  # (FileExistsError among them)
                    if not _precondition_failed(e):
                        raise
                    # A resend after a lost response (ours, or aiohttp's own on a dropped connection) finds what
                    # the first send created: ours if the bytes are (put_new's use, the config, has a random id).
                    if self._retry("GET", key, lambda: bytes(self.fs.cat_file(path))) == body:
                        return
                    raise FileExistsError(f"{self.url}/{key} exists") from None

            self._retry("PUT", key, create)
            return
        if self.exists(key):
            raise FileExistsError(key)
        self.put(key, body)

    def get(self, key):
        path = self._path(key)
        if not self._s3:
            return bytes(self._retry("GET", key, lambda: self.fs.cat_file(path)))

        def whole() -> bytes:
            # A ranged read from 0 is one GET; s3fs's plain cat_file sends a HEAD first, and on a missing key
            # a LIST after it (three round trips for what a GET answers).
            try:
                return bytes(self.fs.cat_file(path, start=0))
            except OSError as e:
                if _range_not_satisfiable(e):
                    return b""  # 416 at offset 0: the object is empty
                raise

        return self._retry("GET", key, whole)

    def get_range(self, key, offset, length):
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        path = self._path(key)
        if length == 0:
            self.size(key)  # a missing object is still an error
            return b""

        def ranged() -> bytes:
            try:
                return bytes(self.fs.cat_file(path, start=offset, end=offset + length))
            except OSError as e:
                if _range_not_satisfiable(e):
                    return b""  # 416: the range starts past the end of the object
                raise

        return self._retry("GET", key, ranged)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and any(p in (".", "..") for p in prefix.split("/")[:-1]):
            raise ValueError(f"invalid list prefix {prefix!r}")
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = "/".join(p for p in (self.root, folder) if p)

        rest = prefix[len(folder) + 1:] if folder else prefix

        def find() -> dict:
            try:
                if self._s3 and rest:  # the server filters by key prefix (manifests/step-1: one key, not all)
                    return self.fs.find(base, detail=True, prefix=rest)
                return self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}

        root = self.root.strip("/")  # some filesystems name paths with a leading '/', some without
        skip = len(root) + 1 if root else 0
        out = []
        for name, info in self._retry("LIST", prefix or "/", find).items():
            name = name.lstrip("/")
            if root and not name.startswith(root + "/"):
                continue
            key = name[skip:]
            if info.get("type", "file") != "file" or not key.startswith(prefix) or not key or key.endswith("/"):
                continue  # (a "folder" marker object, as consoles and FUSE mounts make: no key of a store)
            out.append(ObjectInfo(key, int(info.get("size", 0)), _mtime(info), _version(info)))
        return iter(sorted(out, key=lambda i: i.key))

    def delete(self, key):
        path = self._path(key)

        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._retry("DELETE", key, rm)

    # -- unfinished multipart uploads ----------------------------------------------------------------------------
    def list_unfinished(self) -> list[tuple[str, float]]:
        if not self._s3:
            return []  # other filesystems upload whole or not at all
        bucket, prefix, _ = self.fs.split_path(self.root)
        prefix = f"{prefix}/" if prefix else ""

        def listing() -> list[tuple[str, float]]:
            out, marker = [], {}
            while True:
                page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
                for up in page.get("Uploads", []):
                    key = up["Key"][len(prefix):]
                    started = up.get("Initiated")
                    out.append((key + _UPLOAD_TOKEN + up["UploadId"], started.timestamp() if started else 0.0))
                if not page.get("IsTruncated"):
                    return out
                marker = {"KeyMarker": page.get("NextKeyMarker", ""),
                          "UploadIdMarker": page.get("NextUploadIdMarker", "")}

        return self._retry("LIST", "unfinished uploads", listing)

    def abort_unfinished(self, token: str) -> None:
        key, sep, upload_id = token.rpartition(_UPLOAD_TOKEN)
        if not sep or not upload_id:
            raise ValueError(f"not an unfinished upload: {token!r}")
        bucket, obj, _ = self.fs.split_path(self._path(key))

        def abort() -> None:
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=obj, UploadId=upload_id)
            except FileNotFoundError:
                pass  # aborted or completed meanwhile

        self._retry("DELETE", key, abort)

    def _info(self, key: str) -> dict:
        path = self._path(key)
        if self._s3:
            # One HEAD: s3fs's info() follows a 404 with a LIST to look for a "directory" of that name.
            bucket, obj, _ = self.fs.split_path(path)
            head = self._retry("HEAD", key, lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=obj))
            return {"type": "file", "size": head["ContentLength"], "LastModified": head.get("LastModified")}
        info = self._retry("HEAD", key, lambda: self.fs.info(path))
        if info.get("type", "file") != "file":
            raise FileNotFoundError(key)
        return info

    def exists(self, key):
        try:
            self._info(key)
            return True
        except FileNotFoundError:
            return False

    def size(self, key):
        return int(self._info(key)["size"])


_FILESYSTEMS: dict[tuple, object] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def _shared_filesystem(fs, options: dict):
    """One filesystem object per protocol and options in this process: a new S3 client costs 0.04-0.3 s
    (botocore session, service model, connections) on its first request, which every Store.open would pay
    (a DCP save or load opens one). Keyed by the process id too: a forked child needs its own client."""
    key = (os.getpid(), type(fs).__name__, json.dumps(options, sort_keys=True, default=repr))
    with _FILESYSTEMS_LOCK:
        return _FILESYSTEMS.setdefault(key, fs)


def _version(info: dict) -> str:
    """What tells one write of an object from another (ObjectInfo.version): its ETag (S3, GCS, Azure) or hash."""
    for field in ("ETag", "etag", "md5Hash", "VersionId"):
        value = info.get(field)
        if value:
            return str(value)
    return ""


def _mtime(info: dict) -> float:
    for field in ("LastModified", "mtime", "created", "last_modified"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0

"""Store locations: a directory path, a ``file://`` URL, or any fsspec URL (``s3://bucket/prefix``).

- :func:`open_backend`: a location as a Backend. A string with a scheme is never a local directory
  (``"s3://b/run"`` must not become a folder named ``s3:``).
- :func:`read_store_config`, :func:`create_store_config`: the store's config at a location, read or published
  once; a location that holds packs or manifests but no readable config is a damaged store, named as such
  (with the ``deltackpt repair`` command to run), never a new one.
"""

from __future__ import annotations

import os
import re

from ..errors import BackendError, ManifestFormatError, StoreExistsError, StoreNotFoundError
from .backend import Backend, local_root
from .config import CONFIG_KEY, StoreConfig, decode_config, encode_config, new_config
from .localbackend import LocalBackend

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Packages that implement well-known schemes (fsspec's own table says the same for more of them).
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
             "abfss": "adlfs"}


def scheme_of(location) -> str | None:
    """The URL scheme of ``location`` ('s3', 'file', ...), or None for a plain path or a Backend."""
    if isinstance(location, str):
        m = _SCHEME.match(location)
        return m.group(1).lower() if m else None
    return None


def open_backend(location, storage_options: dict | None = None) -> Backend:
    """The Backend for a path, a URL or a Backend (returned as is)."""
    if isinstance(location, Backend):
        if storage_options:
            raise ValueError("storage_options apply to a path or URL, not to a Backend")
        return location
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str):
        raise TypeError(f"store location must be a path, a URL or a Backend, got {type(location).__name__}")
    scheme = scheme_of(location)
    if scheme is None:
        if storage_options:
            raise ValueError("storage_options apply to URLs (s3://...), not to a local path")
        return LocalBackend(location)
    if scheme == "file":
        return LocalBackend(location[len("file://"):])
    _check_scheme(scheme, location)
    if "//" in location[len(scheme) + 3:].rstrip("/"):
        # s3fs lists "bucket//run" as no keys at all while it reads and writes them: saves that vanish.
        raise BackendError(f"{location}: an empty path segment ('//') in a store URL; object stores do not "
                           "agree on what it names, so remove it")
    from .fsspec_backend import FsspecBackend
    return FsspecBackend(location, storage_options)


def _check_scheme(scheme: str, location: str) -> None:
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise BackendError(f"{location}: URLs need fsspec; pip install fsspec") from None
    if scheme not in known_implementations and scheme not in fsspec.registry:
        raise BackendError(f"{location}: unknown storage scheme {scheme!r} (known: file, s3, gs, az, memory, "
                           "and the other fsspec protocols)")
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        package = _PACKAGES.get(scheme) or known_implementations.get(scheme, {}).get("err", "its fsspec package")
        raise BackendError(f"{location}: the {scheme}:// scheme needs {package}; pip install {package}"
                           if " " not in package else f"{location}: {package}") from None


def read_store_config(backend: Backend) -> StoreConfig:
    """The config of the store at ``backend``; StoreNotFoundError if there is none, and a missing or damaged
    config of a store that holds data is refused naming ``deltackpt repair``."""
    try:
        data = backend.get(CONFIG_KEY)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        if holds_store_data(backend):
            raise StoreNotFoundError(f"{describe(backend)} holds deltackpt packs or manifests but no config "
                                     f"(lost or deleted); {_repair_hint(backend)}") from None
        raise not_a_store_error(backend) from None
    try:
        return decode_config(data)
    except ManifestFormatError as e:
        if holds_store_data(backend):
            raise ManifestFormatError(f"{e}; {_repair_hint(backend)}") from None
        raise


def create_store_config(backend: Backend, exist_ok: bool, overrides: dict) -> StoreConfig | None:
    """Publish a new store's config (the defaults with ``overrides``) at ``backend``; None when a store is
    there already and ``exist_ok`` (the caller opens it), else StoreExistsError."""
    local = local_root(backend)
    if local is not None and local.exists() and not local.is_dir():
        raise StoreExistsError(f"{local} is a file, not a directory: a store is a directory")
    if backend.exists(CONFIG_KEY):
        if exist_ok:
            return None
        raise StoreExistsError(f"{describe(backend)} already holds a deltackpt store")
    # A store's config is written before any pack or manifest: objects with still no config after they
    # were listed belong to a damaged store, not to an init racing with us (that one wins put_new below).
    if holds_store_data(backend) and not backend.exists(CONFIG_KEY):
        raise StoreExistsError(f"{describe(backend)} holds a deltackpt store's packs or manifests but no config "
                               f"(a damaged store); {_repair_hint(backend)}")
    cfg = new_config(**overrides)
    try:
        backend.put_new(CONFIG_KEY, encode_config(cfg))  # two racing inits: exactly one wins
    except FileExistsError:
        if exist_ok:
            return None
        raise StoreExistsError(f"{describe(backend)} already holds a deltackpt store") from None
    return cfg


def describe(backend: Backend) -> str:
    """Where ``backend`` is, for a message: its directory or URL."""
    local = local_root(backend)
    return str(local) if local is not None else getattr(backend, "url", None) or repr(backend)


def _repair_hint(backend: Backend) -> str:
    return f"run `deltackpt repair {describe(backend)}` to recreate it from the packs and manifests"


def holds_store_data(backend: Backend) -> bool:
    """Whether ``backend`` holds packs or manifests: a store, even one whose config was lost."""
    return any(next(iter(backend.list(prefix)), None) is not None for prefix in ("packs/", "manifests/"))


def not_a_store_error(backend: Backend) -> StoreNotFoundError:
    return StoreNotFoundError(
        f"{describe(backend)} is not a deltackpt store (no config); create one with `deltackpt init`")

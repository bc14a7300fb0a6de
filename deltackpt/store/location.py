"""Store locations: a directory path, a ``file://`` URL, or any fsspec URL (``s3://bucket/prefix``).

A string with a scheme is never a local directory (``"s3://b/run"`` must not become a folder named ``s3:``).
"""

from __future__ import annotations

import os
import re

from ..errors import BackendError
from .backend import Backend
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

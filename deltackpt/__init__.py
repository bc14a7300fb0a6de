"""deltackpt: an incremental, content-addressed checkpoint store for PyTorch Distributed Checkpoint.

``deltackpt.store`` is the torch-free engine; ``deltackpt.dcp`` adapts it to DCP's StorageWriter /
StorageReader. Torch-dependent names are loaded lazily, so ``import deltackpt`` and the CLI stay fast.
"""

from __future__ import annotations

from importlib import import_module

from .errors import (
    BackendError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointPinnedError,
    CorruptChunkError,
    CorruptManifestError,
    DeltackptError,
    DiskFullError,
    InvalidNameError,
    ManifestFormatError,
    MissingChunkError,
    SilentDataCorruptionError,
    SourceFormatError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
    StorePermissionError,
    TargetExistsError,
    UnsafeSourceError,
    UnsupportedFormatError,
)

__version__ = "0.2.0"

# name -> module that defines it; imported on first access.
_LAZY = {
    "Store": "deltackpt.store",
    "LocalBackend": "deltackpt.store",
    "MemoryBackend": "deltackpt.store",
    "DeltaStorageWriter": "deltackpt.dcp.writer",
    "DeltaStorageReader": "deltackpt.dcp.reader",
    "DeltaSavePlanner": "deltackpt.dcp.planner",
    "PlainLoadPlanner": "deltackpt.dcp.planner",
    "save": "deltackpt.dcp.api",
    "load": "deltackpt.dcp.api",
    "async_save": "deltackpt.dcp.api",
    "unwrap": "deltackpt.dcp.api",
    "copy": "deltackpt.store.copy",
    "export": "deltackpt.interop.export",
    "import_checkpoint": "deltackpt.interop.importer",
    "import_all": "deltackpt.interop.importer",
    "diff": "deltackpt.interop.diff",
    "TrainState": "deltackpt.train",
    "CheckpointManager": "deltackpt.train",
}

__all__ = [
    "__version__",
    "BackendError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPinnedError",
    "CorruptChunkError",
    "CorruptManifestError",
    "DeltackptError",
    "DiskFullError",
    "InvalidNameError",
    "ManifestFormatError",
    "MissingChunkError",
    "SilentDataCorruptionError",
    "SourceFormatError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StorePermissionError",
    "TargetExistsError",
    "UnsafeSourceError",
    "UnsupportedFormatError",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deltackpt' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)

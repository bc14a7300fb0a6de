"""deltackpt's storage engine: a torch-free, content-addressed store of checkpoints.

Terms
-----
store
    A directory (or any :class:`Backend`) of immutable objects, described by its ``config`` object.
item
    One named array (a tensor shard, with dtype, element size, shape and a place in its *group*, the global
    tensor) or one opaque byte string (a pickled Python value) of a checkpoint.
chunk
    A piece of an item's raw bytes, identified by the xxh3-128 of those bytes (the *chunk id*). Array items
    are cut on a fixed grid of ``chunk_size_bytes`` in their group's global byte space; byte items with
    FastCDC. A chunk is stored once per store, however many items and checkpoints use it.
codec
    How a chunk is stored: ``raw``, ``zstd`` over byte planes, or a delta against a *base* chunk, then byte
    planes and zstd: ``delta`` (XOR) or ``zdelta`` (zigzag integer difference). See :mod:`deltackpt.store.codec`.
keyframe / base
    A chunk coded without reference to another (raw or zstd) is a keyframe. A delta's base is always a
    keyframe, so restoring a chunk reads at most two chunks.
pack
    An immutable object of many coded chunks plus a table of them, named by the hash of its bytes.
index
    An LMDB cache, chunk id -> (pack, offset, lengths, codec, base), rebuilt from pack tables at will.
manifest
    One object per checkpoint listing its items and their chunk refs. Writing it is the commit point: a
    checkpoint exists if and only if its manifest does.

On-disk format, version 2 (``FORMAT_VERSION``; history and features in ``docs/format.md``)
----------------------------------------------------------------------------------------
::

    config                     JSON StoreConfig: format_version, features, store_id, chunk/CDC/pack sizes
    packs/<h[:2]>/<h>          pack, h = xxh3-128 hex of its bytes (layout in deltackpt.store.pack)
    manifests/<name>           b"DCMF" version:u8 zstd(msgpack(Manifest))  (schema in deltackpt.store.manifest)
    cache/index.lmdb/          index cache (local stores only; not part of the format, safe to delete)

All stored metadata is parsed with strict schemas and bounds checks (msgspec Structs, struct layouts with
checksums); nothing is ever unpickled. A store whose ``format_version`` is newer than this code's is refused
with :class:`~deltackpt.errors.UnsupportedFormatError`, and so is a store that lists a feature this code lacks.

This package never imports torch; the DCP layer (``deltackpt.dcp``) sits on top of it and imports only the
names in ``__all__`` below (the other submodules are the engine's own parts).
"""

from .backend import Backend, LocalFiles, MemoryBackend, ObjectInfo
from .basecache import AUTO_CAP_BYTES, BaseCache
from .config import FORMAT_VERSION, StoreConfig
from .localbackend import LocalBackend
from .lock import SHARED, StoreLock, remove_lock
from .manifest import LATEST, ChunkRef, Item, Manifest, Stats, validate_name
from .progress import NULL_PROGRESS, Progress, phase
from .parentmap import ParentMap
from .pausegc import paused_gc
from .reader import CheckpointReader
from .records import decode_entries, encode_entries
from .repository import Store
from .summary import CheckpointInfo, StoreUsage
from .threads import default_read_threads, default_write_threads
from .writer import ChunkWriter, WriteSummary

# Maintenance and transfer names load on first use: a save or a load (and the CLI's start) needs none of them.
_LAZY = {
    "CopyReport": ".copy", "copy_checkpoints": ".copy",
    "ForgetPlan": ".retention", "plan_forget": ".retention",
    "Uploader": ".tier",
    "ProblemKind": ".verifyreport", "VerifyReport": ".verify", "verify_store": ".verify",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deltackpt.store' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AUTO_CAP_BYTES",
    "BaseCache",
    "FORMAT_VERSION",
    "LATEST",
    "NULL_PROGRESS",
    "SHARED",
    "Backend",
    "CheckpointInfo",
    "CheckpointReader",
    "ChunkRef",
    "ChunkWriter",
    "CopyReport",
    "ForgetPlan",
    "Item",
    "LocalBackend",
    "LocalFiles",
    "Manifest",
    "MemoryBackend",
    "ObjectInfo",
    "ParentMap",
    "ProblemKind",
    "Progress",
    "Stats",
    "Store",
    "StoreConfig",
    "StoreLock",
    "StoreUsage",
    "Uploader",
    "VerifyReport",
    "WriteSummary",
    "copy_checkpoints",
    "decode_entries",
    "default_read_threads",
    "default_write_threads",
    "encode_entries",
    "paused_gc",
    "phase",
    "plan_forget",
    "remove_lock",
    "validate_name",
    "verify_store",
]

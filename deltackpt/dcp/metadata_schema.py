"""Pickle-free, strict schema for DCP's ``torch.distributed.checkpoint.metadata.Metadata``.

DCP's own ``FileSystemWriter`` pickles ``Metadata``; loading such a file executes code. deltackpt stores it
with msgspec Structs instead (``forbid_unknown_fields=True`` everywhere, a tagged union for the storage types)
and maps torch enums (dtype, layout, memory_format) through explicit allow-list tables.

Mirrored (torch 2.13 ``metadata.py``)::

    Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version)
    TensorStorageMetadata(properties, size, chunks) | BytesStorageMetadata()
    ChunkStorageMetadata(offsets, sizes)
    TensorProperties(dtype, layout, requires_grad, memory_format, pin_memory)
    StorageMeta(checkpoint_id, save_id, load_id, modules)
    MetadataIndex(fqn, offset, index)

Supported shapes of the two free-form fields:

* ``planner_data``: ``None`` or what ``DefaultSavePlanner`` (flatten_state_dict=True) stores: a dict
  ``fqn -> OBJ_PATH`` where OBJ_PATH is a tuple of ``str | int``. Tuples come back as tuples.
* ``storage_data``: ``None`` or ``dict[MetadataIndex, X]`` where ``X`` is a tree of msgpack builtins:
  ``None, bool, int (int64/uint64 range), float, str, bytes, list, dict`` (dict keys ``str`` or ``int``).
  Exact types only (no subclasses, no tuples) so that decoding gives back an ``==`` value. Anything else
  raises ``TypeError`` at encode time. ``MetadataIndex.index`` (the hint) round-trips too, and entry order is
  kept.

``StorageMeta.checkpoint_id`` may be ``str`` or ``os.PathLike``; a PathLike is stored with a flag and comes
back as ``pathlib.Path`` (FileSystemWriter puts a ``PosixPath`` there).

API
---
``encode_metadata(md) -> dict``: plain builtins (dict/list/tuple/str/int/float/bool/None/bytes), ready to embed in a
larger msgpack manifest (``msgspec.msgpack.encode`` it, or nest it). Typed embedding is possible too: use
``metadata_to_record`` / ``record_to_metadata`` and the ``MetadataRecord`` Struct as a field type.
``decode_metadata(obj) -> Metadata``: accepts that builtins tree (or a ``MetadataRecord``); any schema
violation raises ``ManifestFormatError`` naming the bad field (``$.state_dict_metadata['w'].size[0]``).
``metadata_to_bytes`` / ``metadata_from_bytes``: msgpack round trip of a standalone blob.

The records (the on-disk schema) are in :mod:`.metadata_records`; ``Metadata`` -> record, with its checks,
in :mod:`.metadata_encode`; record -> ``Metadata`` and the entry points here.
"""

from __future__ import annotations

import pathlib
from typing import Any, Union

import msgspec
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import ManifestFormatError
from .metadata_encode import metadata_to_record
from .metadata_records import (
    DTYPE_BY_NAME,
    DTYPE_NAMES,
    LAYOUT_BY_NAME,
    LAYOUT_NAMES,
    MEMFMT_BY_NAME,
    MEMORY_FORMAT_NAMES,
    SCHEMA_VERSION,
    BytesStorageRecord,
    MetadataRecord,
    TensorStorageRecord,
    check_builtin_tree,
)

__all__ = [
    "SCHEMA_VERSION",
    "DTYPE_NAMES",
    "LAYOUT_NAMES",
    "MEMORY_FORMAT_NAMES",
    "MetadataRecord",
    "encode_metadata",
    "decode_metadata",
    "metadata_to_record",
    "record_to_metadata",
    "metadata_to_bytes",
    "metadata_from_bytes",
]


# ---------------------------------------------------------------------------------------------------------
# record -> Metadata
# ---------------------------------------------------------------------------------------------------------
def _record_storage(r: TensorStorageRecord | BytesStorageRecord, path: str) -> Any:
    if isinstance(r, BytesStorageRecord):
        return BytesStorageMetadata()
    rank = len(r.size)
    chunks = []
    for i, c in enumerate(r.chunks):
        if not len(c.offsets) == len(c.sizes) == rank:
            raise ManifestFormatError(f"{path}.chunks[{i}]: offsets/sizes rank differs from size rank {rank}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)))
    p = r.properties
    props = TensorProperties(
        dtype=DTYPE_BY_NAME[p.dtype],
        layout=LAYOUT_BY_NAME[p.layout],
        requires_grad=p.requires_grad,
        memory_format=MEMFMT_BY_NAME[p.memory_format],
        pin_memory=p.pin_memory,
    )
    return TensorStorageMetadata(properties=props, size=torch.Size(r.size), chunks=chunks)


_BAD = "invalid DCP metadata: $"


def record_to_metadata(rec: MetadataRecord) -> Metadata:
    """Rebuild a torch ``Metadata`` from a validated record. Semantic violations -> ``ManifestFormatError``."""
    sdm = {
        fqn: _record_storage(v, f"{_BAD}.state_dict_metadata[{fqn!r}]") for fqn, v in rec.state_dict_metadata.items()
    }
    storage_data = None
    if rec.storage_data is not None:
        storage_data = {}
        for i, e in enumerate(rec.storage_data):
            check_builtin_tree(e.value, f"{_BAD}.storage_data[{i}].value", ManifestFormatError)
            ix = e.index
            key = MetadataIndex(ix.fqn, None if ix.offset is None else torch.Size(ix.offset), ix.index)
            if key in storage_data:
                raise ManifestFormatError(f"{_BAD}.storage_data[{i}].index: duplicate entry for {key!r}")
            storage_data[key] = e.value
    sm = rec.storage_meta
    storage_meta = None
    if sm is not None:
        if sm.checkpoint_id_is_path and sm.checkpoint_id is None:
            raise ManifestFormatError(f"{_BAD}.storage_meta.checkpoint_id_is_path: set but checkpoint_id is null")
        cid = pathlib.Path(sm.checkpoint_id) if sm.checkpoint_id_is_path else sm.checkpoint_id
        storage_meta = StorageMeta(
            checkpoint_id=cid, save_id=sm.save_id, load_id=sm.load_id, modules=list(sm.modules)
        )
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=None if rec.planner_data is None else dict(rec.planner_data),
        storage_data=storage_data,
        storage_meta=storage_meta,
        version=rec.version,
    )


# ---------------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------------
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(MetadataRecord)


def encode_metadata(md: Metadata) -> dict:
    """Return ``md`` as plain msgpack builtins (a dict); ``TypeError`` if it holds unsupported values."""
    return msgspec.to_builtins(metadata_to_record(md), builtin_types=(bytes,))


def decode_metadata(obj: Any) -> Metadata:
    """Strictly decode what ``encode_metadata`` produced (after any msgpack round trip).

    Lists are accepted where tuples were encoded. Any mismatch raises ``ManifestFormatError`` whose message
    ends with the path of the offending field, e.g. ``- at `$.state_dict_metadata[...].size[0]```.
    """
    if isinstance(obj, MetadataRecord):
        rec = obj
    else:
        try:
            rec = msgspec.convert(obj, MetadataRecord, strict=True)
        except msgspec.ValidationError as e:
            raise ManifestFormatError(f"invalid DCP metadata: {_locate_dict_key(obj, e)}") from None
        except RecursionError:
            raise ManifestFormatError("invalid DCP metadata: nested deeper than the stack allows") from None
    try:
        return record_to_metadata(rec)
    except RecursionError:  # a storage_data value's builtin tree, checked in Python
        raise ManifestFormatError("invalid DCP metadata: a value nested deeper than the stack allows") from None


_ENTRY_TYPES = {
    "state_dict_metadata": Union[TensorStorageRecord, BytesStorageRecord],
    "planner_data": tuple[Union[str, int], ...],
}


def _locate_dict_key(obj: Any, err: msgspec.ValidationError) -> str:
    """msgspec reports dict entries as ``[...]``; re-validate entry by entry to name the offending key."""
    msg = str(err)
    for field, typ in _ENTRY_TYPES.items():
        marker = f"$.{field}[...]"
        if marker not in msg or not isinstance(obj, dict) or not isinstance(obj.get(field), dict):
            continue
        for key, value in obj[field].items():
            try:
                msgspec.convert(value, typ, strict=True)
            except msgspec.ValidationError:
                return msg.replace(marker, f"$.{field}[{key!r}]")
    return msg


def metadata_to_bytes(md: Metadata) -> bytes:
    """Serialize ``md`` as a standalone msgpack blob."""
    return _ENCODER.encode(metadata_to_record(md))


def metadata_from_bytes(data: bytes) -> Metadata:
    """Strictly parse a blob from ``metadata_to_bytes``; never unpickles. Bad input -> ``ManifestFormatError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, got {type(data).__name__}")
    try:
        rec = _DECODER.decode(data)
    except msgspec.ValidationError as e:
        try:
            where = _locate_dict_key(msgspec.msgpack.decode(data), e)
        except (msgspec.DecodeError, RecursionError):
            where = str(e)
        raise ManifestFormatError(f"invalid DCP metadata blob: {where}") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise ManifestFormatError(f"invalid DCP metadata blob: {e!s:.200}") from None
    return record_to_metadata(rec)

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
"""

from __future__ import annotations

import os
import pathlib
from typing import Annotated, Any, Literal, Union

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

SCHEMA_VERSION = 1

# ---------------------------------------------------------------------------------------------------------
# Allow-list tables. Names are the torch attribute names; an entry is live only if this torch has it.
# Aliases (torch.float, torch.half, ...) are the same objects, so each dtype has exactly one name.
# ---------------------------------------------------------------------------------------------------------
_DTYPE_CANDIDATES = (
    "float32", "float64", "float16", "bfloat16",
    "complex32", "complex64", "complex128",
    "bool",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
)  # fmt: skip
_LAYOUT_CANDIDATES = (
    "strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged",
)  # fmt: skip
_MEMORY_FORMAT_CANDIDATES = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")


def _table(names: tuple[str, ...], kind: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        obj = getattr(torch, name, None)
        if isinstance(obj, kind) and obj not in out.values():
            out[name] = obj
    return out


_DTYPE_BY_NAME: dict[str, torch.dtype] = _table(_DTYPE_CANDIDATES, torch.dtype)
_LAYOUT_BY_NAME: dict[str, torch.layout] = _table(_LAYOUT_CANDIDATES, torch.layout)
_MEMFMT_BY_NAME: dict[str, torch.memory_format] = _table(_MEMORY_FORMAT_CANDIDATES, torch.memory_format)
_NAME_BY_DTYPE = {v: k for k, v in _DTYPE_BY_NAME.items()}
_NAME_BY_LAYOUT = {v: k for k, v in _LAYOUT_BY_NAME.items()}
_NAME_BY_MEMFMT = {v: k for k, v in _MEMFMT_BY_NAME.items()}

DTYPE_NAMES: tuple[str, ...] = tuple(_DTYPE_BY_NAME)
LAYOUT_NAMES: tuple[str, ...] = tuple(_LAYOUT_BY_NAME)
MEMORY_FORMAT_NAMES: tuple[str, ...] = tuple(_MEMFMT_BY_NAME)

# Literal types built from the tables: msgspec rejects unknown names itself and reports the field path.
_DtypeName = Literal[DTYPE_NAMES]  # type: ignore[valid-type]
_LayoutName = Literal[LAYOUT_NAMES]  # type: ignore[valid-type]
_MemFmtName = Literal[MEMORY_FORMAT_NAMES]  # type: ignore[valid-type]

_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_Dims = tuple[_NonNeg, ...]

# ---------------------------------------------------------------------------------------------------------
# Records (the on-disk schema). Field names mirror torch's; do not rename without bumping SCHEMA_VERSION.
# ---------------------------------------------------------------------------------------------------------


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class TensorPropertiesRecord(_Strict):
    dtype: _DtypeName  # type: ignore[valid-type]
    layout: _LayoutName  # type: ignore[valid-type]
    requires_grad: bool
    memory_format: _MemFmtName  # type: ignore[valid-type]
    pin_memory: bool


class ChunkRecord(_Strict):
    offsets: _Dims
    sizes: _Dims


class TensorStorageRecord(_Strict, tag_field="type", tag="tensor"):
    properties: TensorPropertiesRecord
    size: _Dims
    chunks: list[ChunkRecord]


class BytesStorageRecord(_Strict, tag_field="type", tag="bytes"):
    pass


class StorageMetaRecord(_Strict):
    checkpoint_id: Union[str, None]
    checkpoint_id_is_path: bool
    save_id: Union[str, None]
    load_id: Union[str, None]
    modules: list[str]


class MetadataIndexRecord(_Strict):
    fqn: str
    offset: Union[_Dims, None]
    index: Union[_NonNeg, None]


class StorageDataEntry(_Strict):
    index: MetadataIndexRecord
    value: Any  # msgpack builtins tree, validated by _check_builtin_tree on both sides


class MetadataRecord(_Strict):
    schema: Literal[1]
    state_dict_metadata: dict[str, Union[TensorStorageRecord, BytesStorageRecord]]
    planner_data: Union[dict[str, tuple[Union[str, int], ...]], None]
    storage_data: Union[list[StorageDataEntry], None]
    storage_meta: Union[StorageMetaRecord, None]
    version: Union[str, None]


# ---------------------------------------------------------------------------------------------------------
# Metadata -> record
# ---------------------------------------------------------------------------------------------------------
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SCALARS = (type(None), bool, int, float, str, bytes)


def _check_builtin_tree(value: Any, path: str, err: type[Exception]) -> None:
    """Raise ``err`` unless ``value`` is a tree that msgpack encodes and decodes back to an equal value."""
    t = type(value)
    if t in _SCALARS:
        if t is int and not (_INT_MIN <= value <= _INT_MAX):
            raise err(f"{path}: int {value} is outside the msgpack range [-2**63, 2**64-1]")
        return
    if t is list:
        for i, v in enumerate(value):
            _check_builtin_tree(v, f"{path}[{i}]", err)
        return
    if t is dict:
        for k, v in value.items():
            if type(k) not in (str, int):
                raise err(f"{path}: dict key {k!r} has type {type(k).__name__}; only str and int keys are allowed")
            _check_builtin_tree(v, f"{path}[{k!r}]", err)
        return
    hint = " (use a list; tuples would come back as lists)" if t is tuple else ""
    raise err(
        f"{path}: unsupported type {t.__module__}.{t.__qualname__}{hint}; storage_data values must be "
        "trees of None/bool/int/float/str/bytes/list/dict"
    )


def _dims(value: Any, path) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints. ``path`` (a str, or a function making it: the paths of
    thousands of chunks are only formatted when one is wrong) names it in the error."""
    if type(value) in (torch.Size, tuple, list):
        out = tuple(value)
        for d in out:
            if type(d) is not int or d < 0:
                break
        else:
            return out
    path = path() if callable(path) else path
    if not isinstance(value, (torch.Size, tuple, list)):
        raise TypeError(f"{path}: expected torch.Size, got {type(value).__name__}")
    for i, d in enumerate(value):
        if type(d) is not int:
            raise TypeError(f"{path}[{i}]: expected int, got {type(d).__name__}")
        if d < 0:
            raise ValueError(f"{path}[{i}]: negative value {d}")
    return tuple(value)  # a subclass of tuple or list, all ints


def _enum_name(table: dict[Any, str], value: Any, path: str, what: str) -> str:
    try:
        return table[value]
    except (KeyError, TypeError):
        raise TypeError(f"{path}: unsupported {what} {value!r}") from None


def _properties_to_record(p: TensorProperties, path) -> TensorPropertiesRecord:
    if type(p.requires_grad) is not bool or type(p.pin_memory) is not bool:
        raise TypeError(f"{_path(path)}: requires_grad and pin_memory must be bool")
    key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
    try:
        rec = _PROPERTIES_SEEN.get(key)
    except TypeError:  # an unhashable value: checked below, and refused
        key, rec = None, None
    if rec is not None:
        return rec  # a model's tensors share a few: each checked once (370 of a fine-tune's save)
    rec = TensorPropertiesRecord(
        dtype=_enum_name(_NAME_BY_DTYPE, p.dtype, f"{_path(path)}.dtype", "dtype"),
        layout=_enum_name(_NAME_BY_LAYOUT, p.layout, f"{_path(path)}.layout", "layout"),
        requires_grad=p.requires_grad,
        memory_format=_enum_name(_NAME_BY_MEMFMT, p.memory_format, f"{_path(path)}.memory_format",
                                 "memory_format"),
        pin_memory=p.pin_memory,
    )
    if key is not None and len(_PROPERTIES_SEEN) < 1024:
        _PROPERTIES_SEEN[key] = rec
    return rec


_PROPERTIES_SEEN: dict[tuple, TensorPropertiesRecord] = {}  # properties -> their (immutable) record


def _path(path) -> str:
    """A field's path for an error message: given as a str, or as a function that formats it (the paths of
    thousands of items are only formatted when one is wrong)."""
    return path() if callable(path) else path


def _storage_to_record(v: Any, path) -> TensorStorageRecord | BytesStorageRecord:
    if type(v) is BytesStorageMetadata:
        return BytesStorageRecord()
    if type(v) is not TensorStorageMetadata:
        raise TypeError(f"{_path(path)}: unsupported storage metadata type {type(v).__name__}")
    size = _dims(v.size, lambda: f"{_path(path)}.size")
    chunks = []
    for i, c in enumerate(v.chunks):
        if type(c) is not ChunkStorageMetadata:
            raise TypeError(f"{_path(path)}.chunks[{i}]: expected ChunkStorageMetadata, got {type(c).__name__}")
        offsets = _dims(c.offsets, lambda: f"{_path(path)}.chunks[{i}].offsets")
        sizes = _dims(c.sizes, lambda: f"{_path(path)}.chunks[{i}].sizes")
        if not len(offsets) == len(sizes) == len(size):
            raise ValueError(f"{_path(path)}.chunks[{i}]: offsets/sizes rank differs from the tensor rank "
                             f"{len(size)}")
        chunks.append(ChunkRecord(offsets=offsets, sizes=sizes))
    return TensorStorageRecord(
        properties=_properties_to_record(v.properties, lambda: f"{_path(path)}.properties"), size=size,
        chunks=chunks
    )


def _planner_data_to_record(pd: Any) -> dict[str, tuple[str | int, ...]] | None:
    if pd is None:
        return None
    if type(pd) is not dict:
        raise TypeError(
            f"planner_data: unsupported type {type(pd).__name__}; only None or DefaultSavePlanner's "
            "dict[fqn, tuple[str | int, ...]] is supported"
        )
    out = {}
    for k, path in pd.items():
        if type(k) is not str:
            raise TypeError(f"planner_data: key {k!r} is not a str")
        if type(path) is not tuple or any(type(p) not in (str, int) for p in path):
            raise TypeError(f"planner_data[{k!r}]: expected a tuple of str|int, got {path!r}")
        out[k] = path
    return out


def _index_to_record(idx: Any, i: int) -> MetadataIndexRecord:
    if (type(idx) is not MetadataIndex or type(idx.fqn) is not str
            or idx.index is not None and (type(idx.index) is not int or idx.index < 0)):
        _refuse_index(idx, f"storage_data key #{i}")
    offset = None if idx.offset is None else _dims(idx.offset, lambda: f"storage_data key #{i}.offset")
    return MetadataIndexRecord(fqn=idx.fqn, offset=offset, index=idx.index)


def _refuse_index(idx: Any, path: str) -> None:
    if type(idx) is not MetadataIndex:
        raise TypeError(f"{path}: storage_data keys must be MetadataIndex, got {type(idx).__name__}")
    if type(idx.fqn) is not str:
        raise TypeError(f"{path}.fqn: expected str")
    raise TypeError(f"{path}.index: expected a non-negative int or None")


def _storage_data_to_record(sd: Any) -> list[StorageDataEntry] | None:
    if sd is None:
        return None
    if type(sd) is not dict:
        raise TypeError(f"storage_data: expected None or dict[MetadataIndex, value], got {type(sd).__name__}")
    entries = []
    for i, (k, v) in enumerate(sd.items()):
        rec = _index_to_record(k, i)
        if type(v) is not str:  # our own values are item keys; anything else is checked in full
            _check_builtin_tree(v, f"storage_data[{k!r}]", TypeError)
        entries.append(StorageDataEntry(index=rec, value=v))
    return entries


def _storage_meta_to_record(sm: Any) -> StorageMetaRecord | None:
    if sm is None:
        return None
    if type(sm) is not StorageMeta:
        raise TypeError(f"storage_meta: expected StorageMeta, got {type(sm).__name__}")
    cid, is_path = sm.checkpoint_id, False
    if cid is not None and type(cid) is not str:
        if not isinstance(cid, os.PathLike):
            raise TypeError(f"storage_meta.checkpoint_id: expected str, os.PathLike or None, got {cid!r}")
        cid, is_path = os.fspath(cid), True
        if type(cid) is not str:
            raise TypeError("storage_meta.checkpoint_id: bytes paths are not supported")
    for name in ("save_id", "load_id"):
        if getattr(sm, name) is not None and type(getattr(sm, name)) is not str:
            raise TypeError(f"storage_meta.{name}: expected str or None")
    if type(sm.modules) is not list or any(type(m) is not str for m in sm.modules):
        raise TypeError("storage_meta.modules: expected list[str]")
    return StorageMetaRecord(
        checkpoint_id=cid,
        checkpoint_id_is_path=is_path,
        save_id=sm.save_id,
        load_id=sm.load_id,
        modules=list(sm.modules),
    )


def metadata_to_record(md: Metadata) -> MetadataRecord:
    """Convert ``md`` to its schema record. Raises ``TypeError`` for values the schema cannot hold."""
    if not isinstance(md, Metadata):
        raise TypeError(f"expected torch.distributed.checkpoint.metadata.Metadata, got {type(md).__name__}")
    if type(md.state_dict_metadata) is not dict:
        raise TypeError("state_dict_metadata: expected dict[str, TensorStorageMetadata | BytesStorageMetadata]")
    sdm = {}
    for fqn, v in md.state_dict_metadata.items():
        if type(fqn) is not str:
            raise TypeError(f"state_dict_metadata: key {fqn!r} is not a str")
        sdm[fqn] = _storage_to_record(v, lambda: f"state_dict_metadata[{fqn!r}]")
    if md.version is not None and type(md.version) is not str:
        raise TypeError("version: expected str or None")
    return MetadataRecord(
        schema=SCHEMA_VERSION,
        state_dict_metadata=sdm,
        planner_data=_planner_data_to_record(md.planner_data),
        storage_data=_storage_data_to_record(md.storage_data),
        storage_meta=_storage_meta_to_record(md.storage_meta),
        version=md.version,
    )


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
        dtype=_DTYPE_BY_NAME[p.dtype],
        layout=_LAYOUT_BY_NAME[p.layout],
        requires_grad=p.requires_grad,
        memory_format=_MEMFMT_BY_NAME[p.memory_format],
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
            _check_builtin_tree(e.value, f"{_BAD}.storage_data[{i}].value", ManifestFormatError)
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
    return record_to_metadata(rec)


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
        except msgspec.DecodeError:
            where = str(e)
        raise ManifestFormatError(f"invalid DCP metadata blob: {where}") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise ManifestFormatError(f"invalid DCP metadata blob: {e!s:.200}") from None
    return record_to_metadata(rec)

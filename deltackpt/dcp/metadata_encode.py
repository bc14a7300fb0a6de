"""metadata_encode: DCP ``Metadata`` -> its schema record (:class:`~.metadata_records.MetadataRecord`).

Every value is checked on the way: what the schema cannot hold (an unknown dtype, a subclass where an exact
type is needed, a tuple in ``storage_data``) raises ``TypeError`` naming the field, before anything is written.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from .metadata_records import (
    NAME_BY_DTYPE,
    NAME_BY_LAYOUT,
    NAME_BY_MEMFMT,
    SCHEMA_VERSION,
    BytesStorageRecord,
    ChunkRecord,
    MetadataIndexRecord,
    MetadataRecord,
    StorageDataEntry,
    StorageMetaRecord,
    TensorPropertiesRecord,
    TensorStorageRecord,
    check_builtin_tree,
)


def _valid_dims(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of non-negative ints, or None when it is not one (:func:`_dims` says why)."""
    if type(value) in (torch.Size, tuple, list):
        out = tuple(value)
        for d in out:
            if type(d) is not int or d < 0:
                return None
        return out
    return None


def _dims(value: Any, path) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints. ``path`` (a str, or a function making it: the paths of
    thousands of chunks are only formatted when one is wrong) names it in the error."""
    out = _valid_dims(value)
    if out is not None:
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
        dtype=_enum_name(NAME_BY_DTYPE, p.dtype, f"{_path(path)}.dtype", "dtype"),
        layout=_enum_name(NAME_BY_LAYOUT, p.layout, f"{_path(path)}.layout", "layout"),
        requires_grad=p.requires_grad,
        memory_format=_enum_name(NAME_BY_MEMFMT, p.memory_format, f"{_path(path)}.memory_format",
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
    # The paths are formatted only for an error (no closure per field of every tensor and chunk).
    size = _valid_dims(v.size)
    if size is None:
        size = _dims(v.size, f"{_path(path)}.size")
    chunks = []
    for i, c in enumerate(v.chunks):
        if type(c) is not ChunkStorageMetadata:
            raise TypeError(f"{_path(path)}.chunks[{i}]: expected ChunkStorageMetadata, got {type(c).__name__}")
        offsets, sizes = _valid_dims(c.offsets), _valid_dims(c.sizes)
        if offsets is None:
            offsets = _dims(c.offsets, f"{_path(path)}.chunks[{i}].offsets")
        if sizes is None:
            sizes = _dims(c.sizes, f"{_path(path)}.chunks[{i}].sizes")
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
    for k, path in pd.items():
        if type(k) is not str:
            raise TypeError(f"planner_data: key {k!r} is not a str")
        if type(path) is not tuple:
            raise TypeError(f"planner_data[{k!r}]: expected a tuple of str|int, got {path!r}")
        for p in path:  # (a loop, not a generator per path: one entry per value of the state dict)
            if type(p) is not str and type(p) is not int:
                raise TypeError(f"planner_data[{k!r}]: expected a tuple of str|int, got {path!r}")
    return dict(pd)


def _index_to_record(idx: Any, i: int) -> MetadataIndexRecord:
    if (type(idx) is not MetadataIndex or type(idx.fqn) is not str
            or idx.index is not None and (type(idx.index) is not int or idx.index < 0)):
        _refuse_index(idx, f"storage_data key #{i}")
    offset = None if idx.offset is None else _valid_dims(idx.offset)
    if offset is None and idx.offset is not None:
        offset = _dims(idx.offset, f"storage_data key #{i}.offset")
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
            check_builtin_tree(v, f"storage_data[{k!r}]", TypeError)
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

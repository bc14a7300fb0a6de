"""metadata_records: the on-disk schema of DCP ``Metadata``, as strict msgspec Structs.

Field names mirror torch's (see :mod:`.metadata_schema` for the mapping and the API); torch's enums (dtype,
layout, memory_format) are stored by name through allow-list tables built from the torch in use, and
``storage_data`` values are trees of msgpack builtins checked by :func:`check_builtin_tree` on both sides.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
import torch

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


DTYPE_BY_NAME: dict[str, torch.dtype] = _table(_DTYPE_CANDIDATES, torch.dtype)
LAYOUT_BY_NAME: dict[str, torch.layout] = _table(_LAYOUT_CANDIDATES, torch.layout)
MEMFMT_BY_NAME: dict[str, torch.memory_format] = _table(_MEMORY_FORMAT_CANDIDATES, torch.memory_format)
NAME_BY_DTYPE = {v: k for k, v in DTYPE_BY_NAME.items()}
NAME_BY_LAYOUT = {v: k for k, v in LAYOUT_BY_NAME.items()}
NAME_BY_MEMFMT = {v: k for k, v in MEMFMT_BY_NAME.items()}

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_BY_NAME)
LAYOUT_NAMES: tuple[str, ...] = tuple(LAYOUT_BY_NAME)
MEMORY_FORMAT_NAMES: tuple[str, ...] = tuple(MEMFMT_BY_NAME)

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
    value: Any  # msgpack builtins tree, validated by check_builtin_tree on both sides


class MetadataRecord(_Strict):
    schema: Literal[1]
    state_dict_metadata: dict[str, Union[TensorStorageRecord, BytesStorageRecord]]
    planner_data: Union[dict[str, tuple[Union[str, int], ...]], None]
    storage_data: Union[list[StorageDataEntry], None]
    storage_meta: Union[StorageMetaRecord, None]
    version: Union[str, None]


# storage_data values: msgpack builtins only, exact types, so that decoding gives back an equal value.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SCALARS = (type(None), bool, int, float, str, bytes)


def check_builtin_tree(value: Any, path: str, err: type[Exception]) -> None:
    """Raise ``err`` unless ``value`` is a tree that msgpack encodes and decodes back to an equal value."""
    t = type(value)
    if t in _SCALARS:
        if t is int and not (_INT_MIN <= value <= _INT_MAX):
            raise err(f"{path}: int {value} is outside the msgpack range [-2**63, 2**64-1]")
        return
    if t is list:
        for i, v in enumerate(value):
            check_builtin_tree(v, f"{path}[{i}]", err)
        return
    if t is dict:
        for k, v in value.items():
            if type(k) not in (str, int):
                raise err(f"{path}: dict key {k!r} has type {type(k).__name__}; only str and int keys are allowed")
            check_builtin_tree(v, f"{path}[{k!r}]", err)
        return
    hint = " (use a list; tuples would come back as lists)" if t is tuple else ""
    raise err(
        f"{path}: unsupported type {t.__module__}.{t.__qualname__}{hint}; storage_data values must be "
        "trees of None/bool/int/float/str/bytes/list/dict"
    )

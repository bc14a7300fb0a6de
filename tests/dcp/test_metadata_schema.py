"""Round-trip and strictness tests for deltackpt.dcp.metadata_schema (pickle-free DCP Metadata)."""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import pickle
import warnings

import msgspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from deltackpt.dcp.metadata_schema import (
    DTYPE_NAMES,
    LAYOUT_NAMES,
    MEMORY_FORMAT_NAMES,
    decode_metadata,
    encode_metadata,
    metadata_from_bytes,
    metadata_to_bytes,
    metadata_to_record,
)
from deltackpt.errors import DeltackptError, ManifestFormatError


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------
def _index_keys(md: Metadata) -> list[tuple]:
    """MetadataIndex equality ignores the `index` hint; compare it (and order) explicitly."""
    if md.storage_data is None:
        return []
    return [(k.fqn, k.offset, k.index) for k in md.storage_data]


def _assert_identical(a: Metadata, b: Metadata) -> None:
    assert a == b
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    for fqn, va in a.state_dict_metadata.items():
        vb = b.state_dict_metadata[fqn]
        assert type(va) is type(vb)
        if isinstance(va, TensorStorageMetadata):
            assert type(vb.size) is torch.Size
            assert vb.properties.dtype is va.properties.dtype
            assert vb.properties.layout is va.properties.layout
            assert vb.properties.memory_format == va.properties.memory_format
            assert vb.properties.requires_grad is va.properties.requires_grad
            assert vb.properties.pin_memory is va.properties.pin_memory
            for ca, cb in zip(va.chunks, vb.chunks, strict=True):
                assert type(cb.offsets) is torch.Size and type(cb.sizes) is torch.Size
                assert (ca.offsets, ca.sizes) == (cb.offsets, cb.sizes)
    if a.planner_data is not None:
        for k, path in a.planner_data.items():
            assert type(b.planner_data[k]) is tuple
            assert [type(p) for p in b.planner_data[k]] == [type(p) for p in path]
    assert _index_keys(a) == _index_keys(b)
    if a.storage_meta is not None:
        ca, cb = a.storage_meta.checkpoint_id, b.storage_meta.checkpoint_id
        if isinstance(ca, os.PathLike):
            assert isinstance(cb, pathlib.Path) and os.fspath(cb) == os.fspath(pathlib.Path(os.fspath(ca)))
        else:
            assert type(cb) is type(ca) and cb == ca
    assert b.version == a.version


def _roundtrip_both_ways(md: Metadata) -> None:
    via_bytes = metadata_from_bytes(metadata_to_bytes(md))
    _assert_identical(md, via_bytes)
    # embedded in a larger msgpack manifest, decoded as untyped builtins, then strictly decoded
    outer = msgspec.msgpack.encode({"manifest": {"dcp_metadata": encode_metadata(md), "other": [1, 2]}})
    via_builtins = decode_metadata(msgspec.msgpack.decode(outer)["manifest"]["dcp_metadata"])
    _assert_identical(md, via_builtins)


def _storage_info_to_builtins(md: Metadata) -> Metadata:
    """FileSystemWriter stores _StorageInfo dataclasses; our writer will store builtins instead."""
    return dataclasses.replace(md, storage_data={k: dataclasses.asdict(v) for k, v in md.storage_data.items()})


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2, bias=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def _train_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net()
    model.head.to(torch.bfloat16)
    model.norm.weight.requires_grad_(False)  # frozen
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(3, 6)
    loss = model.head(model.norm(model.lin(x)).to(torch.bfloat16)).float().sum()
    loss.backward()
    opt.step()
    return model, opt


def _save_real_checkpoint(path: pathlib.Path) -> tuple[Metadata, Metadata]:
    model, opt = _train_state()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        # raw parameters keep requires_grad (module.state_dict() detaches them)
        "live": {"lin_weight": model.lin.weight, "frozen_norm": model.norm.weight, "bf16": model.head.weight},
        "extra": {"epoch": 3, "tag": "run-1", "mixed": [7, torch.arange(5, dtype=torch.int16)]},
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        saved = dcp.save(state, checkpoint_id=path)
    read = dcp.FileSystemReader(path).read_metadata()
    return saved, read


# --------------------------------------------------------------------------------------------------------
# real DCP metadata
# --------------------------------------------------------------------------------------------------------
def test_real_dcp_metadata_roundtrips(tmp_path: pathlib.Path) -> None:
    saved, read = _save_real_checkpoint(tmp_path / "ckpt")

    # sanity: the fixture really exercises what we claim
    tensors = {k: v for k, v in read.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert any(isinstance(v, BytesStorageMetadata) for v in read.state_dict_metadata.values())
    assert tensors["live.lin_weight"].properties.requires_grad is True
    assert tensors["live.frozen_norm"].properties.requires_grad is False
    assert tensors["live.bf16"].properties.dtype is torch.bfloat16
    assert tensors["model.head.weight"].properties.dtype is torch.bfloat16
    assert tensors["extra.mixed.1"].properties.dtype is torch.int16
    assert tensors["scalar"].size == torch.Size([])
    assert read.planner_data["extra.mixed.1"] == ("extra", "mixed", 1)
    assert read.planner_data["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")
    assert isinstance(read.storage_meta.checkpoint_id, pathlib.Path)
    assert read.storage_meta.save_id and read.storage_meta.load_id
    assert read.version == "1.0.0"
    assert any(k.index is not None for k in read.storage_data)  # planner index hints present

    # FileSystemWriter's _StorageInfo values are arbitrary objects: refused at encode time
    with pytest.raises(TypeError, match="_StorageInfo"):
        encode_metadata(read)
    with pytest.raises(TypeError, match="_StorageInfo"):
        metadata_to_bytes(read)

    for md in (read, saved):
        md = _storage_info_to_builtins(md)
        # non-default StorageMeta: every field set
        md = dataclasses.replace(md, storage_meta=dataclasses.replace(md.storage_meta, modules=["model", "optim"]))
        _roundtrip_both_ways(md)

    # loss-free also means every field individually
    md = _storage_info_to_builtins(read)
    back = metadata_from_bytes(metadata_to_bytes(md))
    assert back.storage_meta == md.storage_meta
    assert back.storage_meta.checkpoint_id == tmp_path / "ckpt"
    assert back.planner_data == md.planner_data
    assert back.storage_data == md.storage_data
    assert back.version == "1.0.0"
    assert back.state_dict_metadata["live.bf16"].properties.dtype is torch.bfloat16
    assert back.state_dict_metadata["live.lin_weight"].properties.requires_grad is True


def test_metadata_without_optional_parts() -> None:
    md = Metadata(state_dict_metadata={})
    _roundtrip_both_ways(md)
    md = Metadata(state_dict_metadata={"b": BytesStorageMetadata()}, storage_meta=StorageMeta())
    _roundtrip_both_ways(md)


def test_sharded_multi_chunk_metadata() -> None:
    # what FSDP2 dim-0 sharding over 4 ranks of a (5, 3) tensor produces: torch.chunk -> 2,2,1,0 rows
    props = TensorProperties(dtype=torch.float8_e4m3fn, requires_grad=True)
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([1, 3])),
        ChunkStorageMetadata(torch.Size([5, 0]), torch.Size([0, 3])),
    ]
    md = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([5, 3]), chunks)},
        planner_data={"w": ("w",)},
        storage_data={
            MetadataIndex("w", c.offsets, i): {"chunks": [f"ab{i:02x}"], "nbytes": 6 * i, "raw": b"\x00\xff"}
            for i, c in enumerate(chunks)
        },
        storage_meta=StorageMeta(checkpoint_id="step-100", save_id="s", load_id=None, modules=["m"]),
        version="1.0.0",
    )
    _roundtrip_both_ways(md)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_allowed_dtype_roundtrips(name: str) -> None:
    dtype = getattr(torch, name)
    md = Metadata({"t": TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size([2]), [])})
    back = metadata_from_bytes(metadata_to_bytes(md))
    assert back.state_dict_metadata["t"].properties.dtype is dtype
    assert encode_metadata(md)["state_dict_metadata"]["t"]["properties"]["dtype"] == name


def test_standard_dtypes_are_allowed() -> None:
    required = {"float32", "float64", "float16", "bfloat16", "complex64", "complex128", "bool", "uint8", "int8"}
    required |= {"int16", "int32", "int64", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"}
    assert required <= set(DTYPE_NAMES)
    assert {"strided", "sparse_coo"} <= set(LAYOUT_NAMES)
    assert {"contiguous_format", "channels_last", "preserve_format"} <= set(MEMORY_FORMAT_NAMES)


def test_all_layouts_and_memory_formats_roundtrip() -> None:
    sdm = {}
    for lay in LAYOUT_NAMES:
        for mf in MEMORY_FORMAT_NAMES:
            props = TensorProperties(
                dtype=torch.int32, layout=getattr(torch, lay), memory_format=getattr(torch, mf), pin_memory=True
            )
            sdm[f"{lay}/{mf}"] = TensorStorageMetadata(props, torch.Size([1, 2, 3, 4]), [])
    _roundtrip_both_ways(Metadata(sdm))


def test_pathlike_checkpoint_id_comes_back_as_path() -> None:
    class MyPath(os.PathLike):
        def __fspath__(self) -> str:
            return "/ckpt/x"

    md = Metadata({}, storage_meta=StorageMeta(checkpoint_id=MyPath()))
    back = metadata_from_bytes(metadata_to_bytes(md))
    assert back.storage_meta.checkpoint_id == pathlib.Path("/ckpt/x")
    md = Metadata({}, storage_meta=StorageMeta(checkpoint_id="/ckpt/x"))
    assert metadata_from_bytes(metadata_to_bytes(md)).storage_meta.checkpoint_id == "/ckpt/x"


def test_encode_output_is_plain_builtins() -> None:
    md = Metadata(
        {"t": TensorStorageMetadata(TensorProperties(), torch.Size([3]), [ChunkStorageMetadata((0,), (3,))])},
        planner_data={"t": ("t",)},
        storage_data={MetadataIndex("t", (0,), 0): {"k": [1, 2.5, None, True, b"x"]}},
        storage_meta=StorageMeta(checkpoint_id=pathlib.Path("/a")),
    )

    def walk(o: object) -> None:
        assert type(o) in (dict, list, tuple, str, int, float, bool, bytes, type(None)), type(o)
        if isinstance(o, dict):
            for k, v in o.items():
                assert type(k) in (str, int)
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    enc = encode_metadata(md)
    walk(enc)
    assert decode_metadata(enc) == md


# --------------------------------------------------------------------------------------------------------
# hypothesis
# --------------------------------------------------------------------------------------------------------
_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_leaf = st.none() | st.booleans() | _ints | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8)
_builtin_tree = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=3)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), kids, max_size=3),
    max_leaves=10,
)


@st.composite
def _tensor_md(draw: st.DrawFn) -> TensorStorageMetadata:
    rank = draw(st.integers(0, 3))
    size = torch.Size(draw(st.lists(st.integers(0, 2**40), min_size=rank, max_size=rank)))
    dim = st.lists(st.integers(0, 2**40), min_size=rank, max_size=rank)
    chunks = draw(st.lists(st.builds(ChunkStorageMetadata, dim.map(torch.Size), dim.map(torch.Size)), max_size=3))
    props = TensorProperties(
        dtype=getattr(torch, draw(st.sampled_from(DTYPE_NAMES))),
        layout=getattr(torch, draw(st.sampled_from(LAYOUT_NAMES))),
        requires_grad=draw(st.booleans()),
        memory_format=getattr(torch, draw(st.sampled_from(MEMORY_FORMAT_NAMES))),
        pin_memory=draw(st.booleans()),
    )
    return TensorStorageMetadata(props, size, chunks)


@st.composite
def _metadata(draw: st.DrawFn) -> Metadata:
    fqns = draw(st.lists(st.text(max_size=12), max_size=6, unique=True))
    sdm = {f: draw(_tensor_md() | st.just(BytesStorageMetadata())) for f in fqns}
    path_item = st.text(max_size=6) | st.integers(-(2**63), 2**63 - 1)
    planner_data = draw(
        st.none() | st.dictionaries(st.text(max_size=12), st.lists(path_item, max_size=4).map(tuple), max_size=6)
    )
    index = st.builds(
        MetadataIndex,
        st.text(max_size=8),
        st.none() | st.lists(st.integers(0, 2**40), max_size=3).map(torch.Size),
        st.none() | st.integers(0, 1000),
    )
    storage_data = draw(st.none() | st.dictionaries(index, _builtin_tree, max_size=6))
    cid = st.none() | st.text(max_size=10) | st.text(min_size=1, max_size=10).map(pathlib.Path)
    storage_meta = draw(
        st.none()
        | st.builds(
            StorageMeta,
            cid,
            st.none() | st.text(max_size=10),
            st.none() | st.text(max_size=10),
            st.lists(st.text(max_size=6), max_size=3),
        )
    )
    version = draw(st.none() | st.text(max_size=6))
    return Metadata(sdm, planner_data, storage_data, storage_meta, version)


def _consistent(md: Metadata) -> bool:
    return all(
        len(c.offsets) == len(c.sizes) == len(v.size)
        for v in md.state_dict_metadata.values()
        if isinstance(v, TensorStorageMetadata)
        for c in v.chunks
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_metadata())
def test_hypothesis_roundtrip(md: Metadata) -> None:
    assert _consistent(md)
    _roundtrip_both_ways(md)
    # The DCP writer puts the record itself in the manifest: msgpack must write it as its builtins.
    assert msgspec.msgpack.encode(metadata_to_record(md)) == msgspec.msgpack.encode(encode_metadata(md))


@settings(max_examples=60, deadline=None)
@given(_builtin_tree)
def test_hypothesis_storage_data_values_pass_through(value: object) -> None:
    md = Metadata({}, storage_data={MetadataIndex("x", (1, 2), 7): value})
    back = metadata_from_bytes(metadata_to_bytes(md))
    assert back.storage_data == md.storage_data
    assert type(next(iter(back.storage_data.values()))) is type(value)


# --------------------------------------------------------------------------------------------------------
# encode-time refusals
# --------------------------------------------------------------------------------------------------------
class _Opaque:
    pass


@pytest.mark.parametrize(
    "value",
    [_Opaque(), (1, 2), {1, 2}, bytearray(b"x"), [1, (2,)], {"k": _Opaque()}, {(1, 2): 3}, 2**64, -(2**63) - 1],
)
def test_encode_rejects_non_builtin_storage_data(value: object) -> None:
    md = Metadata({}, storage_data={MetadataIndex("x"): value})
    with pytest.raises(TypeError, match=r"storage_data\["):
        encode_metadata(md)
    with pytest.raises(TypeError):
        metadata_to_bytes(md)


@pytest.mark.parametrize(
    "md",
    [
        Metadata({}, planner_data=["not", "a", "dict"]),
        Metadata({}, planner_data={"a": ["a"]}),  # list instead of tuple
        Metadata({}, planner_data={"a": ("a", 1.5)}),
        Metadata({}, planner_data={"a": ("a", True)}),
        Metadata({}, storage_data={"not-an-index": 1}),
        Metadata({}, storage_data=[1, 2]),
        Metadata({"t": "not storage metadata"}),
        Metadata({"t": TensorStorageMetadata(TensorProperties(dtype="float32"), torch.Size([1]), [])}),
        Metadata({}, storage_meta=StorageMeta(checkpoint_id=42)),
        Metadata({}, storage_meta=StorageMeta(modules=("a",))),
        Metadata({}, version=1),
    ],
)
def test_encode_rejects_unsupported_shapes(md: Metadata) -> None:
    with pytest.raises(TypeError):
        encode_metadata(md)


@pytest.mark.parametrize(
    "offsets, sizes, err, where",
    [
        ((0, -1), (4, 4), ValueError, r"\['t'\]\.chunks\[1\]\.offsets\[1\]: negative"),
        ((0, 0), (4, 4.0), TypeError, r"\['t'\]\.chunks\[1\]\.sizes\[1\]: expected int"),
        ((0, 0), "44", TypeError, r"\['t'\]\.chunks\[1\]\.sizes: expected torch.Size"),
    ],
)
def test_encode_names_the_bad_chunk(offsets, sizes, err, where) -> None:
    good = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))
    bad = ChunkStorageMetadata(offsets, sizes)
    md = Metadata({"t": TensorStorageMetadata(TensorProperties(), torch.Size([8, 4]), [good, bad])})
    with pytest.raises(err, match=where):
        encode_metadata(md)


def test_encode_checks_properties_seen_before_again() -> None:
    """Tensor properties are checked once per distinct value: a value that only compares equal to one seen
    before (1 == True) is still refused, and a bad one is named by its path."""
    size = torch.Size([1])

    def md(props):
        return Metadata({"t": TensorStorageMetadata(props, size, [ChunkStorageMetadata(torch.Size([0]), size)])})

    encode_metadata(md(TensorProperties(requires_grad=True)))
    with pytest.raises(TypeError, match="requires_grad"):
        encode_metadata(md(TensorProperties(requires_grad=1)))
    with pytest.raises(TypeError, match=r"state_dict_metadata\['t'\]\.properties\.dtype: unsupported dtype"):
        encode_metadata(md(TensorProperties(dtype="float32")))


def test_encode_rejects_chunk_rank_mismatch() -> None:
    bad = TensorStorageMetadata(TensorProperties(), torch.Size([4, 4]), [ChunkStorageMetadata((0,), (4,))])
    with pytest.raises(ValueError, match="rank"):
        encode_metadata(Metadata({"t": bad}))


# --------------------------------------------------------------------------------------------------------
# strict decoding
# --------------------------------------------------------------------------------------------------------
def _good_encoded() -> dict:
    md = Metadata(
        {
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16, requires_grad=True),
                torch.Size([4, 2]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))],
            ),
            "b": BytesStorageMetadata(),
        },
        planner_data={"w": ("w",), "b": ("b",)},
        storage_data={MetadataIndex("w", (0, 0), 0): {"chunk": "abc"}, MetadataIndex("b"): ["x"]},
        storage_meta=StorageMeta(checkpoint_id=pathlib.Path("/c"), save_id="s", load_id="l", modules=["m"]),
        version="1.0.0",
    )
    # go through msgpack so the tree has exactly the shape a manifest reader would see
    return msgspec.msgpack.decode(msgspec.msgpack.encode(encode_metadata(md)))


def _mutations() -> list[tuple[str, object, str]]:
    """(description, mutator, substring expected in the error message: the bad field's path)."""

    def set_(path: list, value: object):
        def f(d: dict) -> None:
            for p in path[:-1]:
                d = d[p]
            d[path[-1]] = value

        return f

    def delete(path: list):
        def f(d: dict) -> None:
            for p in path[:-1]:
                d = d[p]
            del d[path[-1]]

        return f

    w = ["state_dict_metadata", "w"]
    wp = "$.state_dict_metadata['w'].properties"
    dup = {"fqn": "w", "offset": [0, 0], "index": 3}
    ext = msgspec.msgpack.Ext(1, b"x")
    return [
        ("unknown top-level field", set_(["extra"], 1), "extra"),
        ("unknown nested field", set_([*w, "properties", "device"], "cpu"), wp),
        ("unknown chunk field", set_([*w, "chunks", 0, "stride"], [1]), "$.state_dict_metadata['w'].chunks[0]"),
        ("unknown storage_meta field", set_(["storage_meta", "host"], "h"), "$.storage_meta"),
        ("unknown dtype", set_([*w, "properties", "dtype"], "float99"), f"{wp}.dtype"),
        ("torch-prefixed dtype", set_([*w, "properties", "dtype"], "torch.float32"), "properties.dtype"),
        ("unknown layout", set_([*w, "properties", "layout"], "weird"), "properties.layout"),
        ("unknown memory format", set_([*w, "properties", "memory_format"], "nhwc"), "properties.memory_format"),
        ("size as string", set_([*w, "size"], "4x2"), "$.state_dict_metadata['w'].size"),
        ("size element as str", set_([*w, "size", 0], "4"), "$.state_dict_metadata['w'].size[0]"),
        ("negative offset", set_([*w, "chunks", 0, "offsets", 1], -1), "chunks[0].offsets[1]"),
        ("requires_grad as int", set_([*w, "properties", "requires_grad"], 1), "properties.requires_grad"),
        ("missing field", delete([*w, "chunks"]), "chunks"),
        ("unknown union tag", set_([*w, "type"], "blob"), "$.state_dict_metadata['w'].type"),
        ("bytes record with payload", set_(["state_dict_metadata", "b", "data"], 1), "$.state_dict_metadata['b']"),
        ("wrong schema version", set_(["schema"], 2), "$.schema"),
        ("planner path with float", set_(["planner_data", "w"], ["w", 1.5]), "$.planner_data['w']"),
        ("planner_data not a dict", set_(["planner_data"], ["w"]), "$.planner_data"),
        ("index offset wrong type", set_(["storage_data", 0, "index", "offset"], "0,0"),
         "$.storage_data[0].index.offset"),
        ("unknown entry field", set_(["storage_data", 1, "note"], 1), "$.storage_data[1]"),
        ("checkpoint_id as int", set_(["storage_meta", "checkpoint_id"], 5), "$.storage_meta.checkpoint_id"),
        ("modules not a list", set_(["storage_meta", "modules"], "m"), "$.storage_meta.modules"),
        ("version as int", set_(["version"], 1), "$.version"),
        ("chunk rank mismatch", set_([*w, "chunks", 0, "offsets"], [0]), "$.state_dict_metadata['w'].chunks[0]"),
        ("path flag without id", set_(["storage_meta", "checkpoint_id"], None), "checkpoint_id_is_path"),
        ("duplicate storage_data entry", set_(["storage_data", 1, "index"], dup), "$.storage_data[1].index"),
        ("opaque object in value", set_(["storage_data", 0, "value"], {"k": _Opaque()}),
         "$.storage_data[0].value['k']"),
        ("ext type in value", set_(["storage_data", 0, "value"], ext), "$.storage_data[0].value"),
    ]  # fmt: skip


@pytest.mark.parametrize("desc,mutate,where", _mutations(), ids=[m[0] for m in _mutations()])
def test_strict_decode_errors(desc: str, mutate, where: str) -> None:
    enc = _good_encoded()
    decode_metadata(copy.deepcopy(enc))  # baseline is valid
    mutate(enc)
    with pytest.raises(ManifestFormatError) as info:
        decode_metadata(enc)
    assert where in str(info.value), str(info.value)
    assert isinstance(info.value, (DeltackptError, ValueError))
    # the same tree as a standalone msgpack blob is refused too (an opaque object cannot even be encoded)
    if desc != "opaque object in value":
        with pytest.raises(ManifestFormatError) as info2:
            metadata_from_bytes(msgspec.msgpack.encode(enc))
        assert where in str(info2.value), str(info2.value)


def test_decode_rejects_non_mapping_inputs() -> None:
    for obj in (None, 1, "x", b"\x80\x04", [1, 2], {"schema": 1}):
        with pytest.raises(ManifestFormatError):
            decode_metadata(obj)
    for blob in (b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode(_good_encoded()) + b"\x00"):
        with pytest.raises(ManifestFormatError):
            metadata_from_bytes(blob)


# --------------------------------------------------------------------------------------------------------
# pickle payloads are data, never code
# --------------------------------------------------------------------------------------------------------
class _Bomb:
    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payload_rejected_not_executed(tmp_path: pathlib.Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Bomb(marker), protocol=protocol)
    pickle.loads(payload)  # prove the payload really is live ...
    assert marker.exists()
    marker.rmdir()  # ... then make sure we never run it
    with pytest.raises(ManifestFormatError):
        metadata_from_bytes(payload)
    with pytest.raises(ManifestFormatError):
        decode_metadata(payload)
    wrapped = pickle.dumps({"schema": 1, "state_dict_metadata": {}, "x": _Bomb(marker)}, protocol=protocol)
    with pytest.raises(ManifestFormatError):
        metadata_from_bytes(wrapped)
    assert not marker.exists()


def test_real_dcp_pickled_metadata_file_rejected(tmp_path: pathlib.Path) -> None:
    _save_real_checkpoint(tmp_path / "ckpt")
    blob = (tmp_path / "ckpt" / ".metadata").read_bytes()
    assert blob[:1] == b"\x80"  # DCP's own format is a pickle
    with pytest.raises(ManifestFormatError):
        metadata_from_bytes(blob)


def test_pickle_bytes_inside_storage_data_stay_inert_bytes(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Bomb(marker))
    md = Metadata({}, storage_data={MetadataIndex("x"): {"blob": payload}})
    back = metadata_from_bytes(metadata_to_bytes(md))
    assert back.storage_data[MetadataIndex("x")]["blob"] == payload
    assert not marker.exists()

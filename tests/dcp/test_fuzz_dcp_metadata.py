"""Fuzzing the DCP metadata blobs a manifest carries: strict schema, never unpickled (the torch side of
tests/store/test_fuzz_parsers.py, which stays torch-free)."""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltackpt.errors import ManifestFormatError
from fuzz_helpers import FUZZ, attempt, mutate, mutations

pytestmark = pytest.mark.timeout(120)


class _Boom:
    """Unpickling this creates the marker file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# -- DCP metadata blobs --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_blob():
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from deltackpt.dcp.metadata_schema import metadata_from_bytes, metadata_to_bytes

    props = TensorProperties(dtype=torch.float32)
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(props, torch.Size([4, 3]), [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
                ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3]))]),
            "opt": BytesStorageMetadata(),
        },
        planner_data={"w": ("w",), "opt": ("opt", 0)},
        storage_data={MetadataIndex("w", torch.Size([0, 0]), 0): {"k": [1, b"x"]},
                      MetadataIndex("opt"): None},
        storage_meta=StorageMeta(checkpoint_id="ck", save_id="s", load_id=None, modules=["m"]),
        version="1",
    )
    blob = metadata_to_bytes(md)
    assert metadata_from_bytes(blob) == md
    return metadata_from_bytes, blob


@FUZZ
@given(data=st.binary(max_size=2000))
def test_dcp_metadata_random_bytes(dcp_blob, data):
    parse, _ = dcp_blob
    attempt(parse, data)


@FUZZ
@given(ops=mutations)
def test_dcp_metadata_mutations(dcp_blob, ops):
    parse, blob = dcp_blob
    attempt(parse, mutate(blob, ops))


@FUZZ
@given(tree=st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=6)
                         | st.binary(max_size=6),
                         lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                         max_leaves=20),
       field=st.sampled_from(["state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version",
                              "schema"]))
def test_dcp_metadata_field_replaced(dcp_blob, tree, field):
    parse, blob = dcp_blob
    d = msgspec.msgpack.decode(blob)
    d[field] = tree
    attempt(parse, msgspec.msgpack.encode(d))


def test_dcp_metadata_pickle_is_never_executed(dcp_blob, tmp_path):
    parse, _ = dcp_blob
    marker = str(tmp_path / "pwned")
    for data in (pickle.dumps(_Boom(marker)), pickle.dumps(_Boom(marker), protocol=0)):
        with pytest.raises(ManifestFormatError):
            parse(data)
    assert not os.path.exists(marker)


def test_dcp_metadata_deep_nesting_is_a_format_error(dcp_blob):
    parse, blob = dcp_blob
    d = msgspec.msgpack.decode(blob)
    d["storage_data"][1]["value"] = "DEEP"
    raw = msgspec.msgpack.encode(d)
    raw = raw.replace(b"\xa4DEEP", b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(ManifestFormatError):
        parse(raw)

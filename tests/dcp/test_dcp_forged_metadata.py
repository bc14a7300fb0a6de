"""A checkpoint whose DCP metadata was forged (an xxh3 envelope can be recomputed: valid manifest, valid
schema, wrong content) loads with a typed error, never an untyped one or a huge allocation, and a resume falls
back past it. The metadata is decoded and checked against the manifest's items in ``reset``, before any
collective: DCP replaces ``read_metadata``'s errors with its own."""

from __future__ import annotations

import pytest
import torch

import deltackpt
from deltackpt import CheckpointManager, TrainState
from deltackpt.dcp.metadata_schema import decode_metadata
from deltackpt.errors import DeltackptError, ManifestFormatError
from deltackpt.store import Store
from deltackpt.store.manifest import ChunkRef, decode_manifest, encode_manifest, manifest_key

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


def _sd(m):
    return m.layer_data["dcp"]["storage_data"]


def _item(m, key):
    return next(i for i in m.items if i.key == key)


def _truncate_bytes_item(m, empty):
    it = next(i for i in m.items if i.kind == "bytes")
    if empty:
        it.chunks, it.nbytes = [], 0
    else:
        r = it.chunks[0]
        it.chunks = [ChunkRef(r.id, r.length - 10, r.skip)] + it.chunks[1:]
        it.nbytes -= 10


CASES = {
    "bytes_value_empty": lambda m: _truncate_bytes_item(m, True),
    "bytes_value_truncated": lambda m: _truncate_bytes_item(m, False),
    "value_is_a_list": lambda m: _sd(m)[0].__setitem__("value", ["w@0"]),
    "value_names_no_item": lambda m: _sd(m)[0].__setitem__("value", "nope"),
    "entry_missing": lambda m: _sd(m).pop(0),
    "storage_data_null": lambda m: m.layer_data["dcp"].__setitem__("storage_data", None),
    "item_shape_forged": lambda m: setattr(_item(m, "w@0"), "shape", [2, 1 << 40]),
    "metadata_chunk_larger_than_item": lambda m: (
        m.layer_data["dcp"]["state_dict_metadata"]["w"].__setitem__("size", [32]),
        m.layer_data["dcp"]["state_dict_metadata"]["w"]["chunks"][0].__setitem__("sizes", [32])),
    "unknown_dtype": lambda m: m.layer_data["dcp"]["state_dict_metadata"]["w"]["properties"].__setitem__(
        "dtype", "float99"),
}


def _forge(path, name, case):
    store = Store.open(path)
    m = decode_manifest(store.backend.get(manifest_key(name)))
    CASES[case](m)
    raw = encode_manifest(m)
    decode_manifest(raw)  # still a valid manifest
    store.backend.put(manifest_key(name), raw)


@pytest.mark.parametrize("case", list(CASES))
def test_a_load_of_forged_dcp_metadata_is_a_typed_error(tmp_path, case):
    path = str(tmp_path / "s")
    store = Store.init(path)
    deltackpt.save({"w": torch.arange(16, dtype=torch.float32), "o": {"x": 3}}, store, "c1")
    _forge(path, "c1", case)
    target = {"w": torch.zeros(32 if "larger" in case else 16), "o": {"x": 0}}
    with pytest.raises(DeltackptError):
        deltackpt.load(target, Store.open(path), "c1")


def test_a_resume_falls_back_past_forged_dcp_metadata(tmp_path):
    path = str(tmp_path / "s")
    Store.init(path)
    with CheckpointManager(path, TrainState(model=torch.nn.Linear(4, 4))) as mgr:
        mgr.save(1)
        mgr.save(2)
    _forge(path, "step-00000002", "value_is_a_list")
    with CheckpointManager(path, TrainState(model=torch.nn.Linear(4, 4))) as mgr:
        assert mgr.restore_latest() == 1


@pytest.mark.parametrize("depth", [980, 5000])
def test_a_storage_data_value_nested_past_the_stack_is_refused(depth):
    value = 0
    for _ in range(depth):
        value = [value]
    obj = {"schema": 1, "state_dict_metadata": {}, "planner_data": None, "storage_meta": None, "version": "1",
           "storage_data": [{"index": {"fqn": "a", "offset": None, "index": None}, "value": value}]}
    with pytest.raises(ManifestFormatError):
        decode_metadata(obj)

"""A stock DCP directory -> import -> export (dcp, torch, safetensors) -> read back by torch's and safetensors'
own readers, bit-exact against the original; once in one process, once written and read back on 2 ranks with
a sharding whose boxes are not contiguous (a dim-1 shard) next to FSDP-style dim-0 shards."""

from __future__ import annotations


import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import deltackpt
from deltackpt.store import Store
from deltackpt.testing import SMALL_CONFIG
from dist import assert_tree_equal, full_tree, run_ranks

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(300, 40, generator=g), "b": torch.randn(40, generator=g).to(torch.bfloat16),
                  "scale": torch.tensor(2.5), "idx": torch.arange(17, dtype=torch.int64),
                  "empty": torch.zeros(0, 3)},
        "optim": {"step": 7, "lr": [0.1, 0.01], "name": "adam"},
    }


def _zeros_like(sd):
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    return sd


def _flat_tensors(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def test_dcp_dir_import_then_every_export_format_reads_back_bit_exact(tmp_path):
    sd = _state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "step-1"), no_dist=True)
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)

    report = deltackpt.import_checkpoint(store, tmp_path / "step-1")
    assert report.name == "step-1" and report.stored_bytes > 0 and report.source_bytes > 0
    native = _zeros_like(sd)
    deltackpt.load(native, store, "step-1")
    assert assert_tree_equal(native, sd) == 5

    # dcp: many small chunks of rows (slab_bytes), still one plain directory stock FileSystemReader loads
    deltackpt.export(store, "step-1", tmp_path / "out-dcp", format="dcp", slab_bytes=4000)
    back = _zeros_like(sd)
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "out-dcp"), no_dist=True)
    assert assert_tree_equal(back, sd) == 5

    # torch: the structure dcp_to_torch_save gives for the original directory, loadable with weights_only
    deltackpt.export(store, "step-1", tmp_path / "out.pt", format="torch")
    dcp_to_torch_save(tmp_path / "step-1", tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert assert_tree_equal(torch.load(tmp_path / "out.pt", weights_only=True), ref) == 5

    # safetensors: the tensors under their flattened keys; non-tensor values skipped with a note
    rep = deltackpt.export(store, "step-1", tmp_path / "out.safetensors", format="safetensors", slab_bytes=4000)
    assert sorted(rep.skipped) == ["optim.lr: not a tensor (safetensors holds tensors only)",
                                   "optim.name: not a tensor (safetensors holds tensors only)",
                                   "optim.step: not a tensor (safetensors holds tensors only)"]
    assert assert_tree_equal(load_file(tmp_path / "out.safetensors"), _flat_tensors(sd)) == 5
    with safe_open(tmp_path / "out.safetensors", framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        assert torch.equal(f.get_slice("model.w")[10:20], sd["model"]["w"][10:20])


def test_only_and_dtype_pick_a_subtree_and_cast_floats(tmp_path):
    sd = _state()
    sd["head"] = {"w": torch.randn(5, 5)}
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    deltackpt.save(sd, store, "c")
    rep = deltackpt.export(store, "c", tmp_path / "m.safetensors", format="safetensors", only=["model."],
                           dtype="bf16")
    got = load_file(tmp_path / "m.safetensors")
    assert sorted(got) == ["model.b", "model.empty", "model.idx", "model.scale", "model.w"]
    assert rep.converted == 3  # w, scale, empty (b is bf16 already; idx is an integer tensor)
    assert torch.equal(got["model.w"], sd["model"]["w"].to(torch.bfloat16))
    assert torch.equal(got["model.idx"], sd["model"]["idx"])

    deltackpt.export(store, "c", tmp_path / "m.pt", format="torch", only="model.", dtype="bf16")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(got) == ["model"] and torch.equal(got["model"]["w"], sd["model"]["w"].to(torch.bfloat16))

    deltackpt.export(store, "c", tmp_path / "m-dcp", format="dcp", only=["head.", "optim.step"], dtype="fp32")
    back = {"head": {"w": torch.zeros(5, 5)}, "optim": {"step": 0}}
    dcp.load(back, storage_reader=FileSystemReader(tmp_path / "m-dcp"), no_dist=True)
    assert torch.equal(back["head"]["w"], sd["head"]["w"]) and back["optim"]["step"] == 7


# -- 2 ranks ------------------------------------------------------------------------------------------------
def _dist_state(rank: int, world_size: int, seed: int):
    """Full reference tensors, and the rank's sharded view: ``rows`` sharded on dim 0 (contiguous boxes),
    ``cols`` on dim 1 (each box a strided region of the global tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    full = {"rows": torch.randn(301, 37, generator=g), "cols": torch.randn(23, 130, generator=g),
            "bias": torch.randn(7, generator=g)}
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
               "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]), "bias": full["bias"].clone()}
    return full, {"model": sharded, "step": 3}


def _save_stock(rank, world_size, path):
    _full, sd = _dist_state(rank, world_size, seed=1)
    dcp.save(sd, storage_writer=FileSystemWriter(path))


def _load_stock(rank, world_size, path):
    full, sd = _dist_state(rank, world_size, seed=99)  # other values: the load must replace them all
    dcp.load(sd, storage_reader=FileSystemReader(path))
    return full_tree(sd)


@pytest.mark.distributed
def test_two_rank_dcp_dir_import_export_reshards_bit_exact(tmp_path):
    run_ranks(_save_stock, 2, str(tmp_path / "src"), timeout=180)
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    deltackpt.import_checkpoint(store, tmp_path / "src", "two-ranks")
    ref = {"model": full_tree(_dist_ref()), "step": 3}

    one = {"model": {k: torch.zeros_like(v) for k, v in ref["model"].items()}, "step": 0}
    deltackpt.load(one, store, "two-ranks")  # resharded from 2 ranks to 1 by DeltaStorageReader
    assert assert_tree_equal(one, ref) == 3

    deltackpt.export(store, "two-ranks", tmp_path / "out", format="dcp", slab_bytes=5000)
    results = run_ranks(_load_stock, 2, str(tmp_path / "out"), timeout=180)
    for got in results:  # the consolidated export, loaded by stock DCP into a 2-rank sharding again
        assert assert_tree_equal(got, ref) == 3

    deltackpt.export(store, "two-ranks", tmp_path / "out.safetensors", format="safetensors", slab_bytes=5000)
    assert assert_tree_equal(load_file(tmp_path / "out.safetensors"), _flat_tensors({"model": ref["model"]})) == 3

    # The same values saved from one process: other shards, yet the diff finds exactly the one edit
    edited = {"model": {k: v.clone() for k, v in ref["model"].items()}, "step": 3}
    edited["model"]["cols"][4, 100] += 0.5
    deltackpt.save(edited, store, "one-rank")
    diff = deltackpt.diff(store, "two-ranks", "one-rank")
    changed = [i for i in diff.items if i.status != "unchanged"]
    assert [(i.name, i.changed_elements) for i in changed] == [("model.cols", 1)]
    assert changed[0].max_abs_diff == pytest.approx(0.5, abs=1e-6)


def _dist_ref():
    g = torch.Generator().manual_seed(1)
    return {"rows": torch.randn(301, 37, generator=g), "cols": torch.randn(23, 130, generator=g),
            "bias": torch.randn(7, generator=g)}

"""Import: the step directories of a real training run store incrementally and load bit-exact; torch.save
files load with weights_only only; bad input gets one line on stderr, exit 3, and writes nothing."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import deltackpt
from deltackpt.errors import CheckpointExistsError, SourceFormatError, UnsafeSourceError
from deltackpt.interop.importer import step_of
from deltackpt.store import Store
from deltackpt.testing import SMALL_CONFIG
from cli_fixtures import run
from dist import assert_tree_equal

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _train_run(root: Path, steps=(1, 2, 3, 10, 20)) -> dict[str, dict]:
    """Stock DCP checkpoints of a small MLP trained with Adam, saved at ``steps``; name -> state saved."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 8))
    model[2].requires_grad_(False)  # a frozen layer, as fine-tunes have
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    saved, step = {}, 0
    for target in steps:
        while step < target:
            model(torch.randn(16, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            step += 1
        sd = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "step": step}
        dcp.save(sd, storage_writer=FileSystemWriter(root / f"step-{step}"), no_dist=True)
        saved[f"step-{step}"] = sd
    return saved


def test_importing_the_step_dirs_of_a_run_stores_less_than_their_sum_and_loads_bit_exact(tmp_path):
    saved = _train_run(tmp_path / "run")
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    reports = deltackpt.import_all(store, tmp_path / "run")
    assert [r.name for r in reports] == ["step-1", "step-2", "step-3", "step-10", "step-20"]  # by step, not name
    source = sum(r.source_bytes for r in reports)
    stored = sum(r.stored_bytes for r in reports)
    assert source == sum(f.stat().st_size for f in (tmp_path / "run").rglob("*") if f.is_file())
    assert stored < 0.75 * source, (stored, source)
    assert reports[-1].stored_bytes < reports[0].stored_bytes  # later steps are deltas and frozen layers dedup
    for name, sd in saved.items():
        got = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
        deltackpt.load(got, store, name)
        assert assert_tree_equal(got, sd) == 6
        assert store.read_manifest(name).metadata["step"] == sd["step"]
    assert all(r.skipped for r in deltackpt.import_all(store, tmp_path / "run"))  # a rerun resumes: skips all


def test_step_numbers_come_from_the_last_number_in_a_name():
    assert [step_of(n) for n in ("step-100", "global_step20", "ckpt_3_of_9", "final")] == [100, 20, 9, None]


def test_a_torch_save_file_imports_through_weights_only_and_loads_like_a_native_save(tmp_path):
    sd = {"model": {"w": torch.randn(50, 20), "b": torch.zeros(20, dtype=torch.bfloat16)}, "epoch": 3,
          "names": ["a", "b"]}
    torch.save(sd, tmp_path / "model.pt")
    report = deltackpt.import_checkpoint(tmp_path / "store", tmp_path / "model.pt")
    assert report.name == "model" and report.source_bytes == (tmp_path / "model.pt").stat().st_size
    got = {"model": {"w": torch.zeros(50, 20), "b": torch.ones(20, dtype=torch.bfloat16)}, "epoch": 0,
           "names": None}
    deltackpt.load(got, tmp_path / "store", "model")
    assert assert_tree_equal(got, sd) == 2


def test_safetensors_files_import_by_their_layout_not_their_name(tmp_path):
    """A safetensors file (a Hugging Face base model) imports without any pickle; a torch.save file named
    .safetensors imports as what it is (torch.load alone would hand it to the safetensors reader)."""
    from safetensors.torch import save_file

    tensors = {"w": torch.randn(30, 20), "b": torch.arange(20, dtype=torch.int64)}
    save_file(tensors, tmp_path / "base.safetensors")
    torch.save({"w": torch.ones(3)}, tmp_path / "misnamed.safetensors")
    store = tmp_path / "store"
    assert deltackpt.import_checkpoint(store, tmp_path / "base.safetensors").name == "base"
    assert deltackpt.import_checkpoint(store, tmp_path / "misnamed.safetensors").name == "misnamed"
    got = {"w": torch.zeros(30, 20), "b": torch.zeros(20, dtype=torch.int64)}
    deltackpt.load(got, store, "base")
    assert assert_tree_equal(got, tensors) == 2
    got = {"w": torch.zeros(3)}
    deltackpt.load(got, store, "misnamed")
    assert torch.equal(got["w"], torch.ones(3))


def test_a_safetensors_files_header_metadata_survives_import_and_export(tmp_path):
    """A Hugging Face file's ``__metadata__`` (``format``, its own keys) was dropped on import, so the export
    of an unchanged model differed from the file it came from; it is now kept and written back."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({"w": torch.randn(4, 3)}, tmp_path / "base.safetensors", metadata={"format": "pt", "origin": "hf"})
    save_file({"w": torch.randn(4, 3)}, tmp_path / "bare.safetensors")
    store = tmp_path / "store"
    for name in ("base", "bare"):
        deltackpt.import_checkpoint(store, tmp_path / f"{name}.safetensors")
        deltackpt.export(store, name, tmp_path / f"{name}-out.safetensors", format="safetensors")
    with safe_open(tmp_path / "base-out.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "origin": "hf", "deltackpt_checkpoint": "base"}
    with safe_open(tmp_path / "bare-out.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "deltackpt_checkpoint": "bare"}
    assert Store.open(store).read_manifest("bare").metadata == {"imported_from": str(tmp_path / "bare.safetensors")}


class _Payload:
    """Pickles as a call that would create a marker file: proof of execution if it ever runs."""

    marker = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def _bad_sources(tmp_path: Path) -> dict[str, tuple[Path, type]]:
    good = tmp_path / "good"
    dcp.save({"w": torch.randn(64, 64), "n": 1}, storage_writer=FileSystemWriter(good), no_dist=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in good.iterdir():
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".distcp" else data)
    payload = _Payload()
    payload.marker = str(tmp_path / "EXECUTED")
    torch.save({"w": torch.zeros(3), "obj": payload}, tmp_path / "evil.pt")
    evil_md = tmp_path / "evil-metadata"
    evil_md.mkdir()
    with open(evil_md / ".metadata", "wb") as f:
        pickle.dump(payload, f)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    # A safetensors header lying about its offsets, whose length's low byte (0x80) looks like a pickle's start.
    import json
    import struct

    for pad in range(400):
        header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "x": "y" * pad}).encode()
        header += b" " * (-len(header) % 8)
        if len(header) % 256 == 0x80:
            break
    (tmp_path / "lying.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    torch.save({"model": {"emb": torch.eye(3).to_sparse()}}, tmp_path / "sparse.pt")
    torch.save({"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)}, tmp_path / "quant.pt")
    torch.save({"w.x": torch.ones(2), "w": {"x": torch.zeros(2)}}, tmp_path / "twice.pt")  # one DCP key twice
    return {"quantized tensor": (tmp_path / "quant.pt", SourceFormatError),
            "one key twice": (tmp_path / "twice.pt", SourceFormatError), "empty dir": (empty, SourceFormatError),
            "truncated .distcp": (truncated, SourceFormatError),
            "lying safetensors": (tmp_path / "lying.safetensors", SourceFormatError),
            "sparse tensor": (tmp_path / "sparse.pt", SourceFormatError),
            "pickle payload": (tmp_path / "evil.pt", UnsafeSourceError),
            "pickle in .metadata": (evil_md, UnsafeSourceError),
            "text file": (tmp_path / "notes.txt", SourceFormatError), "missing": (tmp_path / "nope", SourceFormatError)}


def _bad_tiling(src: Path, boxes) -> Path:
    """A DCP directory whose metadata says tensor ``w`` (4x4) is made of ``boxes`` ((offsets, sizes) each),
    each with a payload of its box's size (so only the tiling is wrong)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    parts = {f"p{i}": torch.full(tuple(s), float(i)) for i, (_o, s) in enumerate(boxes)}
    dcp.save(parts, storage_writer=FileSystemWriter(src), no_dist=True)
    md = FileSystemReader(src).read_metadata()
    props = md.state_dict_metadata["p0"].properties
    md.state_dict_metadata = {"w": TensorStorageMetadata(
        properties=props, size=torch.Size([4, 4]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes])}
    md.storage_data = {MetadataIndex("w", torch.Size(o)): md.storage_data[MetadataIndex(f"p{i}", torch.Size([0, 0]))]
                       for i, (o, _s) in enumerate(boxes)}
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return src


@pytest.mark.parametrize("name, boxes, needle", [
    ("overlap", [((0, 0), (3, 4)), ((1, 0), (1, 4))], "overlap"),  # sizes add up to 16: row 3 is a hole
    ("outside", [((0, 0), (3, 4)), ((3, 0), (2, 4))], "not inside"),
    ("short", [((0, 0), (3, 4))], "do not tile"),
])
def test_chunks_that_do_not_tile_their_tensor_are_refused(tmp_path, name, boxes, needle):
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    good = _bad_tiling(tmp_path / "good", [((0, 0), (3, 4)), ((3, 0), (1, 4))])  # the harness itself is sound
    deltackpt.import_checkpoint(store, good, "good")
    assert store.load("good")["w@0,0"].shape == (3, 4)
    with pytest.raises(SourceFormatError, match=needle):
        deltackpt.import_checkpoint(store, _bad_tiling(tmp_path / "src", boxes), "x")
    assert [i.name for i in store.list_checkpoints()] == ["good"]


def test_bad_sources_are_refused_with_one_line_and_write_nothing(tmp_path, capsys):
    sources = _bad_sources(tmp_path)
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    deltackpt.import_checkpoint(store, tmp_path / "good", "taken")
    before = _listing(tmp_path / "store" / "packs") + _listing(tmp_path / "store" / "manifests")
    for what, (src, error) in sources.items():
        with pytest.raises(error):
            deltackpt.import_checkpoint(store, src, "x")
        code, out, err = run(capsys, "import", tmp_path / "store", src, "--name", "x")
        assert code == 3 and out == "" and len(err.strip().splitlines()) == 1, (what, err)
        code, _out, err = run(capsys, "import", tmp_path / "fresh-store", src, "--name", "x")
        assert code == 3 and not (tmp_path / "fresh-store").exists(), what  # no store created for bad input
    assert not (tmp_path / "EXECUTED").exists()
    with pytest.raises(CheckpointExistsError):
        deltackpt.import_checkpoint(store, tmp_path / "good", "taken")
    code, _out, err = run(capsys, "import", tmp_path / "store", tmp_path / "good", "--name", "taken")
    assert code == 3 and "already exists" in err and len(err.strip().splitlines()) == 1
    assert "--name" in err and "overwrite" not in err  # import has no overwrite option to point to
    assert _listing(tmp_path / "store" / "packs") + _listing(tmp_path / "store" / "manifests") == before


def test_a_payload_found_bad_while_writing_leaves_no_packs(tmp_path):
    src = tmp_path / "src"
    dcp.save({"a": torch.randn(200, 50), "b": torch.randn(300, 50)}, storage_writer=FileSystemWriter(src),
             no_dist=True)
    data = bytearray((src / "__0_0.distcp").read_bytes())
    data[-200:] = b"\0" * 200  # the last tensor's zip is damaged; its size (what the metadata checks) is not
    (src / "__0_0.distcp").write_bytes(bytes(data))
    store = Store.init(tmp_path / "store", **SMALL_CONFIG)
    with pytest.raises(SourceFormatError, match="not a torch.save payload"):
        deltackpt.import_checkpoint(store, src, "x")
    assert _listing(tmp_path / "store" / "packs") == [] and store.list_checkpoints() == []


def test_cli_import_all_reports_source_new_bytes_and_ratio(tmp_path, capsys):
    _train_run(tmp_path / "run", steps=(1, 2, 3))
    code, out, _err = run(capsys, "import", tmp_path / "store", "--all", tmp_path / "run", "--json")
    import json

    data = json.loads(out)
    assert code == 0 and [r["name"] for r in data["imported"]] == ["step-1", "step-2", "step-3"]
    total = data["total"]
    assert total["source_bytes"] == sum(r["source_bytes"] for r in data["imported"])
    assert total["ratio"] == pytest.approx(total["source_bytes"] / total["stored_bytes"])
    code, out, _err = run(capsys, "import", tmp_path / "store", "--all", tmp_path / "run")
    assert code == 0 and out.count("exists, skipped") == 3
    code, _out, err = run(capsys, "import", tmp_path / "store")
    assert code == 2 and "SRC" in err
    assert os.path.isdir(tmp_path / "store" / "manifests")


def test_overlap_search_on_a_grid_and_on_edges_that_line_up_nowhere():
    from deltackpt.interop.dcpsource import _overlapping

    grid = [([i * 4, j * 4], [4, 4]) for i in range(30) for j in range(30)]  # 900 boxes tiling 120x120
    assert _overlapping(grid, 2) is None
    assert _overlapping(grid + [([50, 50], [3, 3])], 2) == ([48, 48], [50, 50])
    # 300 rows of staggered widths: edges line up nowhere, more cells than boxes allow: swept
    stagger = [([r, 0], [1, 7 + r]) for r in range(300)] + [([r, 7 + r], [1, 400 - 7 - r]) for r in range(300)]
    assert _overlapping(stagger, 2) is None
    assert _overlapping(stagger + [([150, 100], [1, 1])], 2) is not None


@pytest.mark.parametrize("forged", ["bytes at an offset", "tensor at no chunk's offset"])
def test_data_the_metadata_does_not_describe_is_refused(tmp_path, forged):
    """A slice the metadata has no chunk for (a value's bytes at a tensor's offset) would be one item read two
    ways: load took one, export the other."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex

    src = tmp_path / "step-1"
    dcp.save({"w": torch.ones(4), "extra": io.BytesIO(b"GOOD")}, storage_writer=FileSystemWriter(src), no_dist=True)
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)
    w = md.storage_data[MetadataIndex("w", torch.Size([0]))]
    key = MetadataIndex("extra", torch.Size([0])) if forged.startswith("bytes") else MetadataIndex("w", torch.Size([2]))
    md.storage_data[key] = w
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(SourceFormatError, match="which the metadata does not describe"):
        deltackpt.import_checkpoint(tmp_path / "store", src)

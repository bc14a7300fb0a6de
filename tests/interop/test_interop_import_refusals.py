"""Import refuses what it cannot store with a typed error naming the key (meta, sparse payloads, a state dict
that contains itself, damaged files), tells damage from danger, and imports a run's directory as a user
expects: links to a step directory and names no checkpoint can have are skipped with a note."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

import deltackpt
from deltackpt.errors import InvalidNameError, SourceFormatError, UnsafeSourceError
from deltackpt.interop.weightsonly import is_unsafe, refusal_reason
from deltackpt.store import Store
from cli_fixtures import run

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _with_payload(src: Path, payload: bytes) -> Path:
    """A stock DCP directory of ``w`` (4x4 float32) whose slice for ``w`` is ``payload`` instead."""
    dcp.save({"w": torch.randn(4, 4), "n": torch.ones(2)}, storage_writer=FileSystemWriter(src), no_dist=True)
    md = FileSystemReader(src).read_metadata()
    data = src / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload)
    md.storage_data[MetadataIndex("w", torch.Size([0, 0]))] = _StorageInfo("__0_0.distcp", offset, len(payload))
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return src


def _refused(capsys, tmp_path: Path, src: Path, error: type, *needles: str) -> str:
    """``src`` is refused with exactly ``error`` (API) and one line, exit 3 (CLI), and no store is left at a
    fresh path when the refusal came before anything was written; the message."""
    with pytest.raises(SourceFormatError) as info:
        deltackpt.import_checkpoint(tmp_path / "api-store", src, "x")
    assert type(info.value) is error, info.value
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, msg
    assert "\x1b" not in msg and "weights_only" not in msg and "\n" not in msg, msg
    code, out, err = run(capsys, "import", tmp_path / "cli-store", src, "--name", "x")
    assert code == 3 and out == "" and len(err.strip().splitlines()) == 1, err
    for store in ("api-store", "cli-store"):
        if (tmp_path / store).exists():
            assert Store.open(tmp_path / store).checkpoint_names() == []
    return msg


def test_meta_tensors_are_refused_naming_the_key_and_a_file_leaves_no_store(tmp_path, capsys):
    torch.save({"model": {"w": torch.empty(3, device="meta")}}, tmp_path / "meta.pt")
    _refused(capsys, tmp_path, tmp_path / "meta.pt", SourceFormatError, "model.w", "meta tensor")
    assert not (tmp_path / "api-store").exists() and not (tmp_path / "cli-store").exists()
    src = _with_payload(tmp_path / "src", _saved(torch.empty(4, 4, device="meta")))
    _refused(capsys, tmp_path, src, SourceFormatError, "w at offset [0, 0]", "meta tensor")


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_payload_in_a_dcp_dir_is_refused_naming_the_key(tmp_path, capsys, layout):
    dense = torch.randn(4, 4)
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    src = _with_payload(tmp_path / "src", _saved(sparse))
    _refused(capsys, tmp_path, src, SourceFormatError, "w at offset [0, 0]", f"sparse_{layout}", "to_dense")


def test_a_state_dict_that_contains_itself_or_nests_too_deep_is_refused(tmp_path, capsys):
    sd = {"w": torch.ones(2), "inner": {"x": torch.zeros(2)}}
    sd["inner"]["back"] = sd
    torch.save(sd, tmp_path / "cycle.pt")
    _refused(capsys, tmp_path, tmp_path / "cycle.pt", SourceFormatError, "'inner.back'", "contains itself")
    lst: list = [torch.ones(1)]
    lst.append(lst)
    torch.save({"l": lst}, tmp_path / "list.pt")
    _refused(capsys, tmp_path, tmp_path / "list.pt", SourceFormatError, "'l.1'", "contains itself")
    deep: object = torch.ones(1)
    for _ in range(300):  # torch.load builds it without recursion; DCP, walking it, could overflow the stack
        deep = [deep]
    torch.save({"deep": deep}, tmp_path / "deep.pt")
    _refused(capsys, tmp_path, tmp_path / "deep.pt", SourceFormatError, "nested more than 100")
    node: object = {"t": torch.ones(1)}
    for _ in range(60):  # 60 bytes of memo references naming 2**60 paths: DCP would walk them forever
        node = {"a": node, "b": node}
    torch.save({"dag": node}, tmp_path / "dag.pt")
    _refused(capsys, tmp_path, tmp_path / "dag.pt", SourceFormatError, "shared so often")


def test_a_value_shared_under_two_keys_is_no_cycle_and_imports(tmp_path):
    shared = {"x": torch.arange(3.0)}
    torch.save({"a": shared, "b": shared}, tmp_path / "shared.pt")
    deltackpt.import_checkpoint(tmp_path / "store", tmp_path / "shared.pt")
    got = {"a": {"x": torch.zeros(3)}, "b": {"x": torch.zeros(3)}}
    deltackpt.load(got, tmp_path / "store", "shared")
    assert torch.equal(got["a"]["x"], torch.arange(3.0)) and torch.equal(got["b"]["x"], torch.arange(3.0))


def test_truncated_legacy_files_and_payloads_are_damaged_sources(tmp_path, capsys):
    buf = io.BytesIO()
    torch.save({"w": torch.randn(100)}, buf, _use_new_zipfile_serialization=False)
    legacy = buf.getvalue()
    for cut in (30, 200, len(legacy) - 10):
        (tmp_path / "trunc.pt").write_bytes(legacy[:cut])
        _refused(capsys, tmp_path, tmp_path / "trunc.pt", SourceFormatError, "trunc.pt", "damaged or truncated")
    buf = io.BytesIO()
    torch.save(torch.randn(4, 4), buf, _use_new_zipfile_serialization=False)
    src = _with_payload(tmp_path / "src", buf.getvalue()[:30])
    _refused(capsys, tmp_path, src, SourceFormatError, "w at offset [0, 0]", "damaged")


def test_a_damaged_file_is_not_called_unsafe_and_a_hostile_one_still_is(tmp_path, capsys):
    (tmp_path / "garbage.pt").write_bytes(b"\x80\x02garbage")
    msg = _refused(capsys, tmp_path, tmp_path / "garbage.pt", SourceFormatError, "damaged", "Unsupported operand")
    assert "refused" not in msg and "unpickling beyond" not in msg
    src = _with_payload(tmp_path / "src", b"\x80\x02garbage")
    _refused(capsys, tmp_path, src, SourceFormatError, "w at offset [0, 0]", "damaged")
    torch.save({"w": torch.ones(2), "bio": io.BytesIO(b"x")}, tmp_path / "global.pt")
    msg = _refused(capsys, tmp_path, tmp_path / "global.pt", UnsafeSourceError, "unpickling beyond plain data",
                   "GLOBAL _io.BytesIO was not an allowed global")
    assert "add_safe_globals" not in msg  # (torch's advice on how to let it run anyway is left out)
    src = _with_payload(tmp_path / "src2", _saved({"t": io.BytesIO(b"x")}))
    _refused(capsys, tmp_path, src, UnsafeSourceError, "w at offset [0, 0]", "GLOBAL _io.BytesIO")


@pytest.mark.parametrize("message, reason, unsafe", [
    ("Weights only load failed. In PyTorch 2.6, `weights_only` ...\nPlease file an issue ... `weights_only=True` "
     "compatible with your use case: WeightsUnpickler error: \n\nUnsupported operand 103\n\nCheck the documentation "
     "of torch.load to learn more", "Unsupported operand 103", False),
    ("Weights only load failed. This file can still be loaded, \x1b[1mdo those steps only if you trust the source"
     "\x1b[0m. \n\t(1) `weights_only` ...\n\tWeightsUnpickler error: Unsupported global: GLOBAL os.system was not an "
     "allowed global by default. Please use `torch.serialization.add_safe_globals([os.system])` to allowlist.\n\n"
     "Check the documentation of torch.load", "Unsupported global: GLOBAL os.system was not an allowed global by "
     "default.", True),
    ("Weights only load failed. In PyTorch 2.6, `weights_only` ...\n\nTrying to load unsupported GLOBAL "
     "posix.system whose module posix is blocked.\n\nCheck the documentation of torch.load",
     "Trying to load unsupported GLOBAL posix.system whose module posix is blocked.", True),
    ("Weights only load failed. ``torch.distributed.tensor`` must be imported to load DTensors\n In PyTorch 2.6, "
     "`weights_only` ...\n\nCheck the documentation of torch.load",
     "``torch.distributed.tensor`` must be imported to load DTensors", True),
    ("Weights only load failed. ...`weights_only`...\nPlease file an issue `weights_only=True` WeightsUnpickler "
     "error: \n\nCan only append to lists, but got dict\n\nCheck the documentation", "Can only append to lists, but "
     "got dict", False),
])
def test_the_reason_of_a_weights_only_refusal_and_whether_it_is_about_safety(message, reason, unsafe):
    got = refusal_reason(pickle.UnpicklingError(message))
    assert got == reason and is_unsafe(got) is unsafe


def test_a_file_whose_name_cannot_name_a_checkpoint_points_to_name(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "model (1).pt")
    with pytest.raises(InvalidNameError, match=r"'model \(1\)'.*name="):
        deltackpt.import_checkpoint(tmp_path / "store", tmp_path / "model (1).pt")
    code, _out, err = run(capsys, "import", tmp_path / "store", tmp_path / "model (1).pt")
    assert code == 2 and "--name" in err and len(err.strip().splitlines()) == 1
    code, _out, _err = run(capsys, "import", tmp_path / "store", tmp_path / "model (1).pt", "--name", "model-1")
    assert code == 0 and Store.open(tmp_path / "store").checkpoint_names() == ["model-1"]


def test_import_all_skips_links_to_imported_dirs_and_names_no_checkpoint_can_have(tmp_path, capsys):
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    for d, value in ((runs / "step-100", 1.0), (runs / "step-200", 2.0), (runs / "old copy", 3.0),
                     (elsewhere / "x", 4.0)):
        dcp.save({"w": torch.full((4,), value)}, storage_writer=FileSystemWriter(d), no_dist=True)
    (runs / "latest").symlink_to("step-200")
    (runs / "step-200-again").symlink_to(runs / "step-200")
    (runs / "best").symlink_to(elsewhere / "x")  # a link to a directory not imported otherwise: imported
    reports = deltackpt.import_all(tmp_path / "store", runs)
    imported = [r.name for r in reports if not r.skipped]
    assert imported == ["step-100", "step-200", "best"]
    notes = {r.name: r.note for r in reports if r.skipped}
    assert notes.keys() == {"latest", "step-200-again", "old copy"}
    assert "a link to step-200" in notes["latest"] and "a link to step-200" in notes["step-200-again"]
    assert "invalid checkpoint name 'old copy'" in notes["old copy"] and "--name" in notes["old copy"]
    got = {"w": torch.zeros(4)}
    deltackpt.load(got, tmp_path / "store", "best")
    assert torch.equal(got["w"], torch.full((4,), 4.0))
    code, out, _err = run(capsys, "import", tmp_path / "store2", "--all", runs)
    assert code == 0 and "skipped " + str(runs / "old copy") in out and "a link to step-200" in out
    code, out, _err = run(capsys, "import", tmp_path / "store2", "--all", runs, "--json")
    data = json.loads(out)
    assert code == 0 and {r["name"]: r["note"] for r in data["imported"]}["step-100"] == "exists"


def test_import_all_of_only_unnamable_dirs_is_refused_naming_them(tmp_path):
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "runs" / "my run"), no_dist=True)
    with pytest.raises(SourceFormatError, match="my run"):
        deltackpt.import_all(tmp_path / "store", tmp_path / "runs")
    assert not (tmp_path / "store").exists()


def _empty_tensor_dir(src: Path, chunk_sizes: list[int]) -> Path:
    """A hand-made DCP directory: ``z`` of size [0, 4] described by one empty chunk of ``chunk_sizes``."""
    src.mkdir()
    buf = io.BytesIO()
    torch.save(torch.zeros(chunk_sizes), buf)
    (src / "__0_0.distcp").write_bytes(buf.getvalue())
    props = TensorProperties(dtype=torch.float32)
    md = Metadata(state_dict_metadata={"z": TensorStorageMetadata(props, torch.Size([0, 4]), [
                      ChunkStorageMetadata(torch.Size([0, 0]), torch.Size(chunk_sizes))])},
                  planner_data={"z": ("z",)},
                  storage_data={MetadataIndex("z", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, buf.tell())})
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return src


def test_the_chunks_of_an_empty_tensor_must_reach_its_size(tmp_path):
    with pytest.raises(SourceFormatError, match=r"chunks of z do not tile its size \[0, 4\] \(they reach \[0, 1\]\)"):
        deltackpt.import_checkpoint(tmp_path / "store", _empty_tensor_dir(tmp_path / "bad", [0, 1]))
    deltackpt.import_checkpoint(tmp_path / "store", _empty_tensor_dir(tmp_path / "good", [0, 4]))
    deltackpt.export(tmp_path / "store", "good", tmp_path / "good.safetensors", format="safetensors")
    from safetensors import safe_open

    with safe_open(tmp_path / "good.safetensors", "pt") as f:
        assert f.get_slice("z").get_shape() == [0, 4]


@pytest.mark.parametrize("field,value", [("length", None), ("offset", None), ("transform_descriptors", 7)])
def test_a_crafted_storage_entry_is_a_typed_error(tmp_path, field, value):
    """A _StorageInfo unpickled without its offset or length (None is not stored), or with transforms that are
    not a list, escaped as an AttributeError / TypeError instead of SourceFormatError."""
    from deltackpt.interop.dcpsource import read_dcp_dir

    dcp.save({"w": torch.randn(4, 3)}, storage_writer=FileSystemWriter(tmp_path / "d"), no_dist=True)
    md = pickle.loads((tmp_path / "d" / ".metadata").read_bytes())
    setattr(next(iter(md.storage_data.values())), field, value)
    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(SourceFormatError):
        read_dcp_dir(tmp_path / "d")

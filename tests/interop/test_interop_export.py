"""Export: memory stays near one tensor (measured), casts match torch's, existing targets and failures leave
the file system as it was, and the safetensors and diff paths never import torch."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.errors import TargetExistsError, UnsafeSourceError
from deltackpt.interop.layout import DCP_LAYER
from deltackpt.interop.numeric import cast
from deltackpt.store import Store
from cli_fixtures import REPO_ROOT, run

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
MiB = 1 << 20


def test_layer_key_matches_the_dcp_layer():
    from deltackpt.dcp import LAYER_KEY

    assert DCP_LAYER == LAYER_KEY


def test_bf16_cast_matches_torch_bit_for_bit_except_nan_payloads():
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 3.4e38, 1.00390625, 1.01171875,
                        65504.0, 1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)
    values = np.concatenate([special, rng.standard_normal(10_000).astype(np.float32) * 1e3,
                             rng.integers(0, 2**32, 10_000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    ours = cast(values.view(np.uint8), "float32", "bfloat16").view(np.uint16)
    ref = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)  # NaN payloads differ between torch's scalar and vector paths; NaN stays NaN
    assert np.array_equal(ours[~nan], ref[~nan]) and nan.sum() > 30
    assert (ours[nan] == 0x7FC0).all()
    back = cast(ours.view(np.uint8), "bfloat16", "float32").view(np.float32)
    assert np.array_equal(back, torch.from_numpy(ref.view(np.int16)).view(torch.bfloat16).float().numpy(),
                          equal_nan=True)


def test_a_float64_past_float32s_range_casts_to_inf_quietly_as_torch_does():
    import warnings

    values = np.array([1e300, -1e300, 1.5, 3.5e38], dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow RuntimeWarning reached the CLI's stderr
        for dst in ("float32", "bfloat16"):
            ours = cast(values.view(np.uint8), "float64", dst)
            ref = torch.from_numpy(values).to(getattr(torch, dst)).view(-1)
            assert ours.tobytes() == ref.view(torch.uint8).numpy().tobytes(), dst


def _peak_exporting(tmp_path: Path, fmt: str, n: int, mib: int = 8, dtype: str | None = None) -> int:
    """Peak traced bytes exporting ``n`` float32 tensors of ``mib`` MiB each (saved through DCP)."""
    root = tmp_path / f"{fmt}-{n}"
    deltackpt.save({f"layer{i}": torch.randn(mib * MiB // 4 // 256, 256) for i in range(n)}, root / "store", "big")
    store = Store.open(root / "store")
    tracemalloc.start()
    try:
        deltackpt.export(store, "big", root / "out", format=fmt, dtype=dtype)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_export_peak_memory_is_one_tensor_plus_the_readers_scratch(tmp_path, fmt):
    from deltackpt.store import default_read_threads

    peak = _peak_exporting(tmp_path, fmt, 8)
    print(f"{fmt}: peak traced {peak / MiB:.1f} MiB exporting 64 MiB (largest tensor 8 MiB)")
    # one 8 MiB slab, plus the stored-bytes and byte-plane scratch (a 4 MiB chunk each) of every thread that
    # decodes (the read pool and the caller): fixed, whatever the number of tensors
    assert peak < 8 * MiB + (default_read_threads() + 1) * 2 * 4 * MiB + 2 * MiB, peak


def test_a_safetensors_export_cast_to_bf16_holds_about_two_slabs(tmp_path):
    """The bf16 rounding worked on uint64 copies of the whole slab: 6.5x the slab at its peak."""
    from deltackpt.store import default_read_threads

    peak = _peak_exporting(tmp_path, "safetensors", 4, dtype="bf16")
    scratch = (default_read_threads() + 1) * 2 * 4 * MiB
    # the 8 MiB slab, one uint32 array as large, the bf16 result (half of it) and the NaN mask (a quarter)
    assert peak < 8 * MiB * 2 + 4 * MiB + 2 * MiB + scratch + 2 * MiB, peak


def test_an_existing_target_is_refused_and_left_alone(tmp_path, capsys):
    store = Store.init(tmp_path / "store")
    store.save("c", {"w": np.ones(10, np.float32)})
    (tmp_path / "taken.safetensors").write_text("mine")
    (tmp_path / "taken-dir").mkdir()
    for target, fmt in (("taken.safetensors", "safetensors"), ("taken-dir", "dcp")):
        with pytest.raises(TargetExistsError):
            deltackpt.export(store, "c", tmp_path / target, format=fmt)
        code, out, err = run(capsys, "export", tmp_path / "store", "c", tmp_path / target, "--format", fmt)
        assert code == 3 and out == "" and len(err.strip().splitlines()) == 1 and "already exists" in err
    assert (tmp_path / "taken.safetensors").read_text() == "mine" and not any((tmp_path / "taken-dir").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "taken-dir", "taken.safetensors"]


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "look-then-rename"])
@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_target_that_appears_while_the_export_is_written_is_kept(tmp_path, monkeypatch, fmt, fallback):
    """A target made while the export was written (an empty folder, or a file another export published) is
    refused and left as it was. With renameat2 this holds even when it appears after the last look (the look
    is blinded here), where a plain rename replaced it."""
    import deltackpt.interop.export as export_mod
    import deltackpt.interop.safetensors as st_mod
    import deltackpt.interop.torchexport as te_mod

    deltackpt.save({"w": torch.ones(10)}, tmp_path / "store", "c")
    store = Store.open(tmp_path / "store")
    out = tmp_path / ("x.safetensors" if fmt == "safetensors" else "x-dir")
    module, name = (st_mod, "write_safetensors") if fmt == "safetensors" else (te_mod, "write_dcp")
    original = getattr(module, name)

    def racing(*args, **kwargs):
        if fmt == "safetensors":
            out.write_text("theirs")
        else:
            out.mkdir()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, racing)
    if fallback:
        monkeypatch.setattr(export_mod, "_libc", lambda: None, raising=False)
    else:
        looks = []
        look = export_mod._check_target
        monkeypatch.setattr(export_mod, "_check_target", lambda o: looks.append(o) or len(looks) > 1 or look(o))
    with pytest.raises(TargetExistsError):
        deltackpt.export(store, "c", out, format=fmt)
    if fmt == "safetensors":
        assert out.read_text() == "theirs"
    else:
        assert out.is_dir() and not any(out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["store", out.name])


def test_a_target_inside_the_store_is_refused(tmp_path, capsys):
    """An export into the store's own folders (manifests/) made a damaged checkpoint that stopped gc; one at
    the store's top (``tags``, a folder made only when first needed) damaged it too: anywhere in the store's
    directory is refused, whatever the name."""
    store = Store.init(tmp_path / "store")
    store.save("c", {"w": np.ones(10, np.float32)})
    with pytest.raises(ValueError, match="inside the store"):
        deltackpt.export(store, "c", tmp_path / "store" / "manifests" / "evil", format="safetensors")
    code, _out, err = run(capsys, "export", tmp_path / "store", "c", tmp_path / "store" / "packs" / "x.safetensors",
                          "--format", "safetensors")
    assert code == 2 and "inside the store" in err
    (tmp_path / "link").symlink_to(tmp_path / "store")
    for target in ("tags", "top.safetensors", "config.tmp-x", "link/tags", "."):
        out = tmp_path / ("link" if target.startswith("link") else "store") / target.removeprefix("link/")
        with pytest.raises(ValueError, match="inside the store.*write the export outside it"):
            deltackpt.export(store, "c", out, format="safetensors")
        code, _out, err = run(capsys, "export", tmp_path / "store", "c", out, "--format", "safetensors")
        assert code == 2 and "inside the store" in err and len(err.strip().splitlines()) == 1, target
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["cache", "commits", "config", "locks",
                                                                       "manifests", "packs"]
    assert Store.open(tmp_path / "store").checkpoint_names() == ["c"]
    deltackpt.export(store, "c", tmp_path / "beside.safetensors", format="safetensors")


def test_dcp_export_into_the_stores_tags_folder_leaves_the_store_sound(tmp_path, capsys):
    deltackpt.save({"w": torch.ones(4)}, tmp_path / "store", "c")
    assert not (tmp_path / "store" / "tags").exists()
    code, _out, err = run(capsys, "export", tmp_path / "store", "c", tmp_path / "store" / "tags", "--format", "dcp")
    assert code == 2 and "inside the store" in err and not (tmp_path / "store" / "tags").exists()
    code, out, _err = run(capsys, "verify", tmp_path / "store")
    assert code == 0 and "no problems" in out


def test_a_refused_torch_export_names_the_key_and_type_in_one_plain_line(tmp_path, capsys):
    import io

    deltackpt.save({"w": torch.ones(2), "opt": {"bio": io.BytesIO(b"x")}}, tmp_path / "store", "c")
    with pytest.raises(UnsafeSourceError, match=r"opt\.bio \(_io\.BytesIO\); export it as dcp"):
        deltackpt.export(tmp_path / "store", "c", tmp_path / "out.pt", format="torch")
    code, out, err = run(capsys, "export", tmp_path / "store", "c", tmp_path / "out.pt", "--format", "torch")
    assert code == 3 and out == "" and len(err.strip().splitlines()) == 1 and "opt.bio" in err
    assert "\x1b" not in err and "weights_only=False" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    deltackpt.export(tmp_path / "store", "c", tmp_path / "w.pt", format="torch", only=["w"])
    assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["w"], torch.ones(2))


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
def test_a_store_save_checkpoint_is_pointed_to_safetensors(tmp_path, capsys, fmt):
    Store.init(tmp_path / "store").save("c", {"w": np.ones(3, np.float32)})
    code, _out, err = run(capsys, "export", tmp_path / "store", "c", tmp_path / "out", "--format", fmt)
    assert code == 3 and "export it as safetensors" in err and "Store.save" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


class Opaque:
    """A value torch.load(weights_only=True) refuses."""

    def __init__(self, x=1):
        self.x = x


RAN: list = []


def _side_effect():
    RAN.append(1)
    return 0


class Payload:
    """A value whose unpickling runs code (what a hostile checkpoint, imported or copied in, could hold)."""

    def __reduce__(self):
        return (_side_effect, ())


def test_export_to_torch_never_unpickles_code(tmp_path):
    deltackpt.save({"w": torch.ones(4), "p": Payload(), "plain": {"lr": 0.1, "steps": [1, 2]}}, tmp_path / "store",
                   "c")
    RAN.clear()
    with pytest.raises(UnsafeSourceError, match="'p' needs unpickling beyond plain data"):
        deltackpt.export(tmp_path / "store", "c", tmp_path / "out.pt", format="torch")
    assert RAN == [] and not (tmp_path / "out.pt").exists()
    deltackpt.export(tmp_path / "store", "c", tmp_path / "ok.pt", format="torch", only=["w", "plain"])
    out = torch.load(tmp_path / "ok.pt", weights_only=True)
    assert out["plain"] == {"lr": 0.1, "steps": [1, 2]} and torch.equal(out["w"], torch.ones(4)) and RAN == []


def test_a_failed_export_leaves_nothing(tmp_path, capsys):
    deltackpt.save({"w": torch.ones(4), "obj": Opaque()}, tmp_path / "store", "c")
    with pytest.raises(UnsafeSourceError, match="export it as dcp"):
        deltackpt.export(tmp_path / "store", "c", tmp_path / "out.pt", format="torch")
    code, _out, err = run(capsys, "export", tmp_path / "store", "c", tmp_path / "o.st", "--format", "safetensors",
                          "--only", "nothing.")
    assert code == 2 and "no key" in err
    code, _out, err = run(capsys, "export", tmp_path / "store", "nope", tmp_path / "o.st", "--format", "safetensors")
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no target, no temporary left behind
    deltackpt.export(tmp_path / "store", "c", tmp_path / "out", format="dcp")  # dcp keeps the value as saved


_TORCH_FREE = """
import sys, numpy as np
import deltackpt
from deltackpt.store import Store
s = Store.init(sys.argv[1])
rng = np.random.default_rng(0)
a = {"w": rng.standard_normal((64, 8)).astype(np.float32), "i": np.arange(5), "raw": b"xyz"}
s.save("a", a)
a["w"][3, 3] = 9
s.save("b", a)
r = deltackpt.diff(s, "a", "b")
rep = deltackpt.export(s, "b", sys.argv[1] + "-b.safetensors", format="safetensors", dtype="bf16")
print({"torch": "torch" in sys.modules, "changed": [i.name for i in r.items if i.status != "unchanged"],
       "skipped": rep.skipped, "converted": rep.converted})
"""


def test_safetensors_export_and_diff_never_import_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", _TORCH_FREE, str(tmp_path / "s")], capture_output=True, text=True,
                         cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    result = eval(out.stdout)  # a dict literal printed by the child
    assert result == {"torch": False, "changed": ["w"], "skipped": ["raw: not a tensor (safetensors holds tensors "
                                                                     "only)"], "converted": 1}
    from safetensors.torch import load_file

    got = load_file(tmp_path / "s-b.safetensors")
    assert sorted(got) == ["i", "w"] and got["w"].dtype == torch.bfloat16 and got["i"].dtype == torch.int64
    assert got["w"][3, 3].item() == 9


def test_cli_export_json(tmp_path, capsys):
    deltackpt.save({"m": {"w": torch.ones(3, 3)}, "step": 2}, tmp_path / "store", "c")
    code, out, _err = run(capsys, "export", tmp_path / "store", "latest", tmp_path / "c.pt", "--format", "torch",
                          "--dtype", "bf16", "--json")
    data = json.loads(out)
    assert code == 0 and (data["num_tensors"], data["num_values"], data["converted"]) == (1, 1, 1)
    got = torch.load(tmp_path / "c.pt", weights_only=True)
    assert got["step"] == 2 and got["m"]["w"].dtype == torch.bfloat16


def test_safetensors_export_writes_little_endian_values_and_skips_the_reserved_name(tmp_path):
    from safetensors.numpy import load_file

    store = Store.init(tmp_path / "store")
    big = np.array([0.0, 1.5, -2.25, 3e38], dtype=">f4")
    store.save("c", {"big": big, "c": np.array([1 + 2j], dtype=">c8"), "__metadata__": np.ones(3, np.float32)})
    report = deltackpt.export(store, "c", tmp_path / "o.safetensors", format="safetensors")
    assert any(s.startswith("__metadata__:") for s in report.skipped)
    got = load_file(tmp_path / "o.safetensors")
    assert sorted(got) == ["big", "c"]
    np.testing.assert_array_equal(got["big"], big.astype("<f4"))
    np.testing.assert_array_equal(got["c"], np.array([1 + 2j], dtype=np.complex64))


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_every_format_casts_the_same_tensors(tmp_path, fmt):
    # The torch format cast float8 too (torch's is_floating_point), the other formats left it as it was.
    deltackpt.save({"w": torch.ones(4), "q": torch.ones(4).to(torch.float8_e4m3fn), "i": torch.arange(4)},
                   tmp_path / "store", "c")
    out = tmp_path / ("c.pt" if fmt == "torch" else "c.safetensors" if fmt == "safetensors" else "c")
    report = deltackpt.export(tmp_path / "store", "c", out, format=fmt, dtype="bf16")
    assert report.converted == 1  # w only


def test_safetensors_export_keeps_every_float8_bit_for_bit(tmp_path):
    from safetensors.torch import load_file

    raw = torch.arange(256, dtype=torch.uint8)
    kinds = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
    state = {k: raw.view(getattr(torch, k)) for k in kinds}
    deltackpt.save(state, tmp_path / "store", "c")
    report = deltackpt.export(tmp_path / "store", "c", tmp_path / "c.safetensors", format="safetensors")
    assert report.skipped == [] and report.num_tensors == len(kinds)
    got = load_file(tmp_path / "c.safetensors")
    for k in kinds:
        assert got[k].dtype == getattr(torch, k) and torch.equal(got[k].view(torch.uint8), raw), k


def test_a_cast_export_writes_one_quiet_nan_in_every_format(tmp_path):
    """`--dtype fp32` of float16 NaNs with payloads: numpy's cast (safetensors) kept a payload (0x7f802000, a
    signalling NaN) where torch's (dcp, torch) wrote 0x7fffffff. Every format writes 0x7FC00000 now; the
    numbers are torch's cast in each."""
    from safetensors.torch import load_file

    from deltackpt.store import Store

    bits = np.array([0x7C01, 0xFE01, 0x3C00, 0xC000], dtype=np.uint16)
    x = torch.from_numpy(bits.view(np.float16).copy())
    store = Store.init(tmp_path / "s")
    deltackpt.save({"h": x}, store, "a")
    deltackpt.export(store, "a", tmp_path / "o.st", format="safetensors", dtype="fp32")
    deltackpt.export(store, "a", tmp_path / "o.pt", format="torch", dtype="fp32")
    want = [0x7FC00000, 0x7FC00000, 0x3F800000, 0xC0000000]
    for got in (load_file(tmp_path / "o.st")["h"], torch.load(tmp_path / "o.pt", weights_only=True)["h"]):
        assert [v & 0xFFFFFFFF for v in got.view(torch.int32).tolist()] == want


def test_a_target_name_near_the_file_systems_limit_is_exported(tmp_path):
    """The temporary name was the target's plus 18 bytes: a valid name of 238-255 bytes failed with "File name
    too long", naming the hidden temporary."""
    deltackpt.save({"w": torch.ones(4)}, tmp_path / "store", "c")
    out = tmp_path / ("m" * 240 + ".safetensors")
    deltackpt.export(tmp_path / "store", "c", out, format="safetensors")
    assert out.is_file() and sorted(p.name for p in tmp_path.iterdir()) == sorted(["store", out.name])


def test_a_torch_export_casts_the_tensors_of_a_tuple_value(tmp_path):
    """``--dtype`` walked dicts and lists only: the float tensors of a tuple (kept whole by DCP) stayed float32."""
    state = {"w": torch.randn(3), "pair": (torch.randn(2), torch.randn(2, dtype=torch.float64), torch.arange(2))}
    deltackpt.save(state, tmp_path / "store", "c")
    report = deltackpt.export(tmp_path / "store", "c", tmp_path / "o.pt", format="torch", dtype="bf16")
    got = torch.load(tmp_path / "o.pt", weights_only=True)
    assert isinstance(got["pair"], tuple) and [t.dtype for t in got["pair"]] == [torch.bfloat16, torch.bfloat16,
                                                                                 torch.int64]
    assert torch.equal(got["pair"][0], state["pair"][0].to(torch.bfloat16)) and report.converted == 3

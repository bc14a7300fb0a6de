"""Errors users can catch and read (engine side): a damaged newest manifest is named, not silently skipped;
arrays that are not plain data are refused; an existing checkpoint name says "Checkpoint already exists"; a
store shares its directory with foreign files and never touches them; nothing waits to refuse a non-race."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from deltackpt.cli import main
from deltackpt.errors import (
    CheckpointExistsError,
    CorruptManifestError,
    DeltackptError,
    ManifestFormatError,
    StoreExistsError,
)
from deltackpt.store import LATEST, LocalBackend, MemoryBackend, Store
from deltackpt.store.gc import plan_gc
from deltackpt.store.verify import verify_store

from store_helpers import SMALL, assert_items_equal, close_index, flip_bit, mutate_object, random_array


# -- a damaged newest manifest -----------------------------------------------------------------------------
def _two_checkpoints(store, rng):
    a = {"x": random_array(rng, "float32", (3000,))}
    b = {"x": random_array(rng, "float32", (3000,))}
    store.save("a", a)
    store.save("b", b)
    return a, b


DAMAGE = {
    "truncate": lambda data: data[: len(data) // 2],
    "garbage": lambda data: b"not a manifest at all",
    "flip": lambda data: data[:20] + bytes([data[20] ^ 0x40]) + data[21:],  # same size
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_latest_with_damaged_newest_manifest_raises_naming_it(store, rng, damage):
    a, _ = _two_checkpoints(store, rng)
    store.list_checkpoints()  # the summaries are cached: damage must still be noticed
    mutate_object(store.backend, "manifests/b", DAMAGE[damage])
    for call in (lambda: store.resolve(LATEST), lambda: store.load(), lambda: store.read_manifest(LATEST),
                 lambda: store.open_checkpoint(LATEST)):
        with pytest.raises(CorruptManifestError) as ei:
            call()
        assert ei.value.checkpoint == "b" and "'b'" in str(ei.value)
        # Old except clauses keep working.
        assert isinstance(ei.value, ManifestFormatError) and isinstance(ei.value, ValueError)
    # Asked for: fall back to the newest readable checkpoint.
    assert store.resolve(LATEST, fallback=True) == "a"
    assert_items_equal(a, store.load("a"))
    # By name, the damaged one says what is wrong with it.
    with pytest.raises(CorruptManifestError) as ei:
        store.read_manifest("b")
    assert ei.value.checkpoint == "b"


def test_ls_lists_damaged_manifest_in_time_order(local_store, rng):
    store = local_store
    _two_checkpoints(store, rng)
    store.save("c", {"x": b"c"})
    store.list_checkpoints()
    mutate_object(store.backend, "manifests/b", DAMAGE["flip"])
    # b was rewritten just now; put it back between a and c, where it was written.
    ts = {n: os.stat(store.backend.root / "manifests" / n).st_mtime for n in "ac"}
    mid = (ts["a"] + ts["c"]) / 2
    os.utime(store.backend.root / "manifests" / "b", (mid, mid))
    assert [i.name for i in store.list_checkpoints()] == ["a", "c"]  # callers that want intact ones only
    listed = store.list_checkpoints(include_damaged=True)
    assert [(i.name, i.damaged) for i in listed] == [("a", False), ("b", True), ("c", False)]
    assert "checksum mismatch" in listed[1].damage
    assert store.resolve(LATEST) == "c"  # the damaged one is not the newest: latest is unaffected


def test_cold_cache_sees_the_damage_too(local_store, rng):
    store = local_store
    _two_checkpoints(store, rng)
    flip_bit(store.backend, "manifests/b", 30)
    close_index(store)
    cold = Store.open(store.backend.root, cache_dir=store.backend.root / "other-cache")
    assert [(i.name, i.damaged) for i in cold.list_checkpoints(include_damaged=True)] == [("a", False),
                                                                                          ("b", True)]
    with pytest.raises(CorruptManifestError, match="'b'"):
        cold.resolve(LATEST)


def test_save_after_damaged_newest_manifest_still_works(store, rng):
    """A damaged manifest must not stop training from saving: the new save diffs against an intact one."""
    a, _ = _two_checkpoints(store, rng)
    mutate_object(store.backend, "manifests/b", DAMAGE["truncate"])
    m = store.save("c", a)
    assert m.parent == "a"
    assert store.resolve(LATEST) == "c"
    assert_items_equal(a, store.load("c"))


def test_cli_ls_marks_damaged_and_show_latest_fails(local_store, rng, capsys):
    store = local_store
    _two_checkpoints(store, rng)
    mutate_object(store.backend, "manifests/b", DAMAGE["truncate"])
    root = str(store.backend.root)
    assert main(["ls", root, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["a"]["damaged"] is False and rows["a"]["damage"] is None
    assert rows["b"]["damaged"] is True and "checksum" in rows["b"]["damage"]
    assert rows["b"]["logical_bytes"] is None  # unknown, not zero
    assert main(["ls", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "STATUS" in lines[0]
    assert [line.split()[0] for line in lines[1:] if line.rstrip().endswith("damaged")] == ["b"]
    assert main(["show", root, "latest"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'b'" in err and "damaged" in err


# -- arrays that are not plain data ------------------------------------------------------------------------
@pytest.mark.parametrize("value", [
    np.array([1, "two", None], dtype=object),
    np.array([(1, "x")], dtype=[("n", "i4"), ("o", "O")]),
    np.array([(1, 2.5)], dtype=[("n", "i4"), ("f", "f8")]),  # loads back as void bytes: fields lost
], ids=["object", "structured-with-object", "structured"])
def test_save_refuses_arrays_that_are_not_plain_data(store, value):
    store.save("before", {"x": b"1"})
    with pytest.raises(TypeError) as ei:
        store.save("bad", {"fine": np.arange(10), "obj": value})
    msg = str(ei.value)
    assert "'obj'" in msg and str(value.dtype) in msg
    assert not store.exists("bad")
    assert verify_store(store, level=2).ok
    assert store.resolve(LATEST) == "before"


@pytest.mark.parametrize("dtype", ["<M8[s]", "<U5", "|S3", ">i4", "c16", "|V4"])
def test_plain_dtypes_still_round_trip(store, dtype):
    x = np.zeros(7, dtype=dtype)
    x.view(np.uint8)[:] = np.arange(x.nbytes, dtype=np.uint8)
    store.save("ok", {"x": x})
    assert_items_equal({"x": x}, store.load("ok"))


# -- an existing name --------------------------------------------------------------------------------------
def test_existing_name_message_matches_dcp_wording(store):
    store.save("dup", {"x": b"1"})
    with pytest.raises(CheckpointExistsError) as ei:
        store.save("dup", {"x": b"2"})
    assert str(ei.value).startswith("Checkpoint already exists: dup")
    assert "overwrite=True" in str(ei.value) and ei.value.name == "dup"
    w = store.writer()
    w.add_bytes("k", b"v")
    s = w.finish()
    with pytest.raises(CheckpointExistsError, match="^Checkpoint already exists: dup"):
        store.commit("dup", s.items, entries=s.entries, packs=s.packs)


# -- a store beside foreign files --------------------------------------------------------------------------
FOREIGN = {
    "model.pt": b"torch.save output",
    "notes.txt": b"keep me",
    "x.tmp-abc": b"looks like a temp file",
    "config.txt": b"not the store's config",
    "data/train.bin": os.urandom(3000),
    "data/half.tmp-0123456789ab": b"a user's own temp file",
    "data/packs/p": b"a folder named like the store's, one level down",
    "runs/1/events.out": b"tensorboard",
}


def _snapshot(root) -> dict:
    out = {}
    for rel in FOREIGN:
        p = root / rel
        out[rel] = (p.read_bytes(), p.stat().st_mtime_ns) if p.exists() else None
    return out


def test_store_beside_foreign_files_never_touches_them(tmp_path, rng, capsys):
    root = tmp_path / "ckpt"
    for rel, data in FOREIGN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        old = time.time() - 7 * 86400  # old enough for any gc grace period
        os.utime(root / rel, (old, old))
    before = _snapshot(root)
    t0 = time.monotonic()
    store = Store.open_or_init(LocalBackend(root, fsync=False), **SMALL)
    assert time.monotonic() - t0 < 2.0  # no waiting: nothing here is a race
    items = {f"w{i}": random_array(rng, "float32", (2000 + i,)) for i in range(3)}
    for step in range(4):
        items["w0"] = items["w0"] + 1
        store.save(f"step-{step}", dict(items))
    # A temp file of the store's own (a crashed put) is removed by gc; foreign ones are not.
    own_temp = root / "manifests" / "step-9.tmp-deadbeef0000"
    own_temp.write_bytes(b"half")
    os.utime(own_temp, (time.time() - 7 * 86400,) * 2)
    assert store.forget(["step-0", "step-1"]) == ["step-0", "step-1"]
    plan = plan_gc(store, grace_s=0)
    assert plan.temp_files == [os.path.join("manifests", own_temp.name)]
    plan.execute()
    assert not own_temp.exists()
    assert verify_store(store, level=2).ok
    store.rebuild_index()
    for argv in (["ls", str(root)], ["show", str(root), "latest"], ["du", str(root)], ["verify", str(root)],
                 ["verify", str(root), "--level", "2"], ["forget", str(root), "--keep-last", "1"],
                 ["gc", str(root), "--grace", "0"], ["index", "rebuild", str(root)], ["init", str(root)]):
        main(argv)
    capsys.readouterr()
    assert Store.init(root, exist_ok=True).config == store.config
    assert _snapshot(root) == before
    assert_items_equal(items, Store.open(root).load(LATEST))
    with pytest.raises(ValueError, match="not a temp file of the store"):
        store.backend.delete_temp("x.tmp-abc")
    with pytest.raises(ValueError, match="not a temp file of the store"):
        store.backend.delete_temp(os.path.join("data", "half.tmp-0123456789ab"))
    assert _snapshot(root) == before


@pytest.mark.parametrize("leftover", ["packs/ab/abcdef", "manifests/step-1"])
@pytest.mark.parametrize("opener", ["init", "open_or_init"])
def test_store_objects_without_config_are_refused_at_once(tmp_path, leftover, opener):
    root = tmp_path / "damaged"
    (root / leftover).parent.mkdir(parents=True)
    (root / leftover).write_bytes(b"a store's object")
    t0 = time.monotonic()
    with pytest.raises(StoreExistsError) as ei:
        getattr(Store, opener)(root)
    assert time.monotonic() - t0 < 2.0
    assert "deltackpt repair" in str(ei.value) and "no config" in str(ei.value)
    assert not (root / "config").exists()
    # Same on a backend that is not a directory.
    mem = MemoryBackend()
    mem.put(leftover, b"x")
    with pytest.raises(StoreExistsError, match="deltackpt repair"):
        getattr(Store, opener)(mem, cache_dir=tmp_path / "cc")
    assert not mem.exists("config")


def test_racing_inits_in_a_shared_directory_agree(tmp_path):
    """A config temp file of a concurrent init is not a reason to refuse or wait: put_new settles the race."""
    root = tmp_path / "race"
    root.mkdir()
    (root / "config.tmp-0123456789ab").write_bytes(b"another init, mid-write")
    (root / "model.pt").write_bytes(b"x")
    first = Store.open_or_init(root)
    second = Store.open_or_init(root)
    third = Store.init(root, exist_ok=True)
    assert first.config == second.config == third.config
    with pytest.raises(StoreExistsError, match="already holds"):
        Store.init(root)
    assert isinstance(StoreExistsError("x"), DeltackptError)

"""Checkpoint names, listing, ``latest``, duplicates and overwrite."""

from __future__ import annotations

import random

import numpy as np
import pytest

from deltackpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptManifestError,
    DeltackptError,
    InvalidNameError,
)
from deltackpt.store import LATEST, Store, validate_name

from store_helpers import assert_items_equal, random_array

INVALID_NAMES = ["", "a/b", "../x", "..", ".", ".hidden", "-flag", "latest", "x" * 200, "x" * 129, "a b",
                 "a\nb", "tab\t", "ü", "a\\b", "name/", "/abs", "run.tmp-1"]
VALID_NAMES = ["a", "step-100", "step_100.final", "A+B=C@d", "_x", "0", "x" * 128, "v1.2.3-rc.1"]


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_invalid_names_are_rejected_everywhere(mem_store, name):
    with pytest.raises(InvalidNameError) as ei:
        validate_name(name)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, DeltackptError)
    with pytest.raises(InvalidNameError):
        mem_store.save(name, {"x": b"1"})
    w = mem_store.writer()
    s = w.finish()
    with pytest.raises(InvalidNameError):
        mem_store.commit(name, s.items)
    if name != LATEST:
        with pytest.raises(InvalidNameError):
            mem_store.load(name)
    assert mem_store.list_checkpoints() == []
    assert [i.key for i in mem_store.backend.list("manifests/")] == []


def test_non_string_name_rejected(mem_store):
    with pytest.raises(InvalidNameError):
        validate_name(5)


@pytest.mark.parametrize("name", VALID_NAMES)
def test_valid_names_work(mem_store, name):
    mem_store.save(name, {"x": b"payload"})
    assert mem_store.exists(name)
    assert mem_store.load(name) == {"x": b"payload"}
    assert [i.name for i in mem_store.list_checkpoints()] == [name]


def test_latest_and_listing(store, rng):
    assert store.list_checkpoints() == []
    with pytest.raises(CheckpointNotFoundError):
        store.resolve(LATEST)
    with pytest.raises(CheckpointNotFoundError):
        store.load()
    saved = {}
    for i, name in enumerate(["zeta", "alpha", "mid"]):
        items = {"w": random_array(rng, "float32", (1000 * (i + 1),)), "meta": f"step {i}".encode()}
        saved[name] = (items, store.save(name, items, metadata={"step": i}))
        assert store.resolve(LATEST) == name
        assert_items_equal(items, store.load(LATEST))
        assert_items_equal(items, store.load())
    infos = store.list_checkpoints()
    assert [i.name for i in infos] == ["zeta", "alpha", "mid"]  # creation order, not name order
    assert [i.parent for i in infos] == [None, "zeta", "alpha"]
    assert [i.created_ns for i in infos] == sorted(i.created_ns for i in infos)
    for info in infos:
        items, m = saved[info.name]
        assert info.logical_bytes == sum(len(v.tobytes() if hasattr(v, "tobytes") else v) for v in items.values())
        assert info.logical_bytes == m.stats.logical_bytes
        assert info.stored_bytes == m.stats.stored_bytes > 0
        assert info.num_items == 2
        assert info.num_chunks == m.stats.num_chunks
        assert info.metadata == {"step": ["zeta", "alpha", "mid"].index(info.name)}
        assert info.manifest_bytes == store.backend.size(f"manifests/{info.name}")
        assert info.added_bytes == info.stored_bytes + info.manifest_bytes
        assert info.dedup_ratio == info.logical_bytes / info.added_bytes
        assert store.summarize(m) == info
    assert sorted(store.checkpoint_names()) == ["alpha", "mid", "zeta"]
    assert store.open_checkpoint().name == "mid"
    # A fresh Store object (cold summary cache) lists the same thing.
    again = Store.open(store.backend, cache_dir=store.cache_dir)
    assert again.list_checkpoints() == infos
    assert again.resolve(LATEST) == "mid"


def test_listing_survives_summary_cache_loss(mem_store, rng, tmp_path):
    mem_store.save("a", {"x": b"1" * 5000})
    mem_store.save("b", {"x": b"2" * 5000})
    fresh = Store.open(mem_store.backend, cache_dir=tmp_path / "other-cache")
    assert [(i.name, i.parent) for i in fresh.list_checkpoints()] == [("a", None), ("b", "a")]


def test_unknown_name_lists_nearby_names(mem_store):
    for n in ["step-100", "step-200", "step-300", "other"]:
        mem_store.save(n, {"x": n.encode()})
    with pytest.raises(CheckpointNotFoundError) as ei:
        mem_store.load("step-10")
    err = ei.value
    assert isinstance(err, KeyError) and isinstance(err, DeltackptError)
    assert err.name == "step-10"
    assert "step-100" in err.nearby
    assert "step-100" in str(err) and "step-10" in str(err)
    with pytest.raises(CheckpointNotFoundError) as ei:
        mem_store.open_checkpoint("zzzzzz")
    assert ei.value.nearby  # no close match: still lists some names
    assert set(ei.value.nearby) <= {"step-100", "step-200", "step-300", "other"}


def test_with_no_close_name_the_newest_steps_are_listed_in_number_order(mem_store):
    """The fallback sorted names as text: with step-0 .. step-11 it listed step-5 .. step-9, not the newest."""
    for i in range(12):
        mem_store.save(f"step-{i}", {"x": str(i).encode()})
    with pytest.raises(CheckpointNotFoundError) as ei:
        mem_store.load("ckpt-final")
    assert ei.value.nearby == [f"step-{i}" for i in range(7, 12)]
    with pytest.raises(KeyError):
        mem_store.read_manifest("nope")
    assert not mem_store.exists("nope")


def test_duplicate_name_and_overwrite(store, rng):
    x1 = random_array(rng, "float32", (5000,))
    x2 = random_array(rng, "int64", (777,))
    store.save("dup", {"x": x1})
    before = store.backend.get("manifests/dup")
    with pytest.raises(CheckpointExistsError) as ei:
        store.save("dup", {"x": x2})
    assert isinstance(ei.value, DeltackptError) and isinstance(ei.value, FileExistsError)
    assert store.backend.get("manifests/dup") == before
    assert_items_equal({"x": x1}, store.load("dup"))
    # commit() refuses too
    w = store.writer()
    w.add_bytes("k", b"v")
    s = w.finish()
    with pytest.raises(CheckpointExistsError):
        store.commit("dup", s.items, entries=s.entries, packs=s.packs)
    assert_items_equal({"x": x1}, store.load("dup"))

    store.save("other", {"y": b"y"})
    store.save("dup", {"x": x2, "z": b"zz"}, overwrite=True)
    assert_items_equal({"x": x2, "z": b"zz"}, store.load("dup"))
    names = [i.name for i in store.list_checkpoints()]
    assert sorted(names) == ["dup", "other"]
    assert names[-1] == "dup" and store.resolve(LATEST) == "dup"
    info = {i.name: i for i in store.list_checkpoints()}["dup"]
    assert info.num_items == 2 and info.logical_bytes == x2.nbytes + 2


def test_commit_rejects_duplicate_item_keys(mem_store):
    w = mem_store.writer()
    w.add_bytes("k", b"one")
    w.add_bytes("k", b"two")
    s = w.finish()
    with pytest.raises(ValueError):
        mem_store.commit("dupkeys", s.items, entries=s.entries, packs=s.packs)
    assert not mem_store.exists("dupkeys")


def test_unreadable_manifest_is_skipped_by_listing_but_not_by_latest(local_store):
    local_store.save("good", {"x": b"1"})
    (local_store.backend.root / "manifests" / "junk.txt").write_bytes(b"not a manifest")
    assert [i.name for i in local_store.list_checkpoints()] == ["good"]
    listed = local_store.list_checkpoints(include_damaged=True)
    assert [(i.name, i.damaged) for i in listed] == [("good", False), ("junk.txt", True)]
    # The newest manifest is unreadable: latest says so instead of silently meaning an older checkpoint.
    with pytest.raises(CorruptManifestError, match="junk.txt") as ei:
        local_store.resolve(LATEST)
    assert ei.value.checkpoint == "junk.txt"
    assert local_store.resolve(LATEST, fallback=True) == "good"


def test_stray_invalid_name_in_manifests_dir_does_not_break_listing(local_store):
    """A stray file whose name is not a valid checkpoint name must not make ``ls`` unusable."""
    local_store.save("good", {"x": b"1"})
    (local_store.backend.root / "manifests" / ".DS_Store").write_bytes(b"junk")
    assert [i.name for i in local_store.list_checkpoints()] == ["good"]
    assert local_store.resolve(LATEST) == "good"


def test_metadata_roundtrip(mem_store):
    meta = {"step": 10, "loss": 0.25, "tags": ["a", "b"], "nested": {"k": None}}
    m = mem_store.save("m", {"x": b"1"}, metadata=meta)
    assert m.metadata == meta
    assert mem_store.read_manifest("m").metadata == meta
    assert mem_store.list_checkpoints()[0].metadata == meta
    assert np.isclose(mem_store.read_manifest("m").metadata["loss"], 0.25)


def test_a_manifest_rewritten_within_a_second_is_summarized_again(tmp_path, rng):
    """S3's modification times are whole seconds: a checkpoint replaced (same name, same manifest size) within
    one must not be listed with the summary of the one it replaced; the object's version (ETag) tells."""
    import hashlib

    from deltackpt.store import MemoryBackend
    from deltackpt.store.backend import ObjectInfo

    class SecondsBackend(MemoryBackend):  # what S3 lists: whole-second times, a version per write
        content_versions = True

        def list(self, prefix=""):
            return iter([ObjectInfo(i.key, i.size_bytes, float(int(i.mtime_s)),
                                    hashlib.md5(self.get(i.key)).hexdigest()) for i in super().list(prefix)])

    store = Store.init(SecondsBackend(), cache_dir=tmp_path / "cache")
    x = random_array(rng, "float32", (1000,))
    # The manifest is compressed: a pad of incompressible text makes its size grow by about a byte a character,
    # so some pad length gives the replacement the same size whatever x's chunks compress to.
    noise = "".join(chr(0x21 + n % 94) for n in random.Random(7).choices(range(256), k=256))
    store.save("c", {"x": x}, metadata={"run": "a", "pad": noise[:96]})
    assert store.list_checkpoints()[0].metadata["run"] == "a"
    size = store.backend.size("manifests/c")
    other = Store.open(store.backend, cache_dir=tmp_path / "other")  # another host replaces it
    for pad in range(256):  # with a manifest of the same size
        other.save("c", {"x": x + 1}, metadata={"run": "b", "pad": noise[:pad]}, overwrite=True)
        if store.backend.size("manifests/c") == size:
            break
    assert store.backend.size("manifests/c") == size
    assert [i.metadata["run"] for i in store.list_checkpoints()] == ["b"]


def test_metadata_that_compresses_a_thousandfold_reads_back(tmp_path):
    """A save whose metadata compressed more than 1024:1 (a million equal flags) committed, and every reader
    then refused its manifest as implausible: load, show and verify called the checkpoint damaged. Such a
    frame is now decoded a piece at a time; one whose header claims more than it holds is still damage."""
    import zstandard

    from deltackpt.errors import CorruptManifestError
    from deltackpt.store.manifest import manifest_body

    store = Store.init(tmp_path / "s")
    w = np.arange(3000, dtype=np.float32)
    store.save("c", {"w": w}, metadata={"step": 100, "seen": [False] * 1_500_000})
    fresh = Store.open(tmp_path / "s", cache_dir=tmp_path / "other-cache")
    np.testing.assert_array_equal(fresh.load("c")["w"], w)
    assert fresh.read_manifest("c").metadata["seen"] == [False] * 1_500_000
    assert [i.name for i in fresh.list_checkpoints(include_damaged=True) if i.damage is None] == ["c"]
    data = (tmp_path / "s" / "manifests" / "c").read_bytes()
    frame = data[5:-8]
    assert zstandard.frame_content_size(frame) > 1024 * len(frame) + (1 << 20)  # the case at hand
    # The same frame cut short (its checksum made good again): it holds less than its header says.
    import struct
    import xxhash

    forged = data[:5] + frame[:-3]
    forged += struct.pack("<Q", xxhash.xxh3_64_intdigest(forged))
    with pytest.raises(CorruptManifestError):
        manifest_body(forged)

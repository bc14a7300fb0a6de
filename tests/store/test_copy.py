"""Copies between stores: only what the destination lacks, manifests last, resumable, bit-exact."""

from __future__ import annotations

import numpy as np
import pytest

from deltackpt.errors import CheckpointExistsError
from deltackpt.store import Store
from deltackpt.store.copy import copy
from deltackpt.store.verify import verify_store

from store_helpers import SMALL, assert_items_equal


def _history(store: Store, rng, n: int = 6) -> dict[str, dict]:
    """n checkpoints of a slowly changing state: a frozen table, a trained matrix, a byte item."""
    frozen = rng.standard_normal(20_000).astype(np.float32)
    w = rng.standard_normal(30_000).astype(np.float32)
    saved = {}
    for step in range(n):
        w = w.copy()
        w[rng.integers(0, w.size, 500)] += np.float32(0.01)
        items = {"frozen": frozen, "w": w, "meta": f'{{"step": {step}}}'.encode()}
        name = f"step-{step}"
        store.save(name, items, metadata={"step": step})
        saved[name] = items
    return saved


def _physical(store: Store) -> int:
    return store.usage().pack_bytes


@pytest.fixture
def src(tmp_path, rng):
    store = Store.init(tmp_path / "src", **SMALL)
    return store, _history(store, rng)


def test_copy_all_sends_the_physical_bytes_and_loads_bit_exact(src, tmp_path):
    store, saved = src
    report = copy(store, tmp_path / "dst")
    dst = Store.open(tmp_path / "dst")
    assert report.copied == list(saved) and report.skipped == []
    assert [i.name for i in dst.list_checkpoints()] == list(saved)
    # Everything is needed: whole packs go as they are, and what is sent is the source's pack bytes.
    assert report.packs_repacked == 0
    assert _physical(dst) == _physical(store)
    manifests = sum(i.size_bytes for i in dst.backend.list("manifests/"))
    assert report.bytes_sent == _physical(store) + manifests
    for name, items in saved.items():
        assert_items_equal(items, dst.load(name))
    assert verify_store(dst, level=2).ok
    assert dst.config.store_id != store.config.store_id
    assert dst.config.chunk_size_bytes == store.config.chunk_size_bytes
    # Same times and order as the source.
    assert [i.created_ns for i in dst.list_checkpoints()] == [i.created_ns for i in store.list_checkpoints()]


def test_copy_again_sends_nothing(src, tmp_path):
    store, saved = src
    copy(store, tmp_path / "dst")
    again = copy(store, tmp_path / "dst")
    assert again.copied == [] and again.skipped == list(saved)
    assert again.bytes_sent == 0 and again.chunks_sent == 0


def test_copy_one_checkpoint_of_a_long_history_repacks_only_what_it_needs(src, tmp_path):
    store, saved = src
    report = copy(store, tmp_path / "dst", ["step-3"], verify=True)
    dst = Store.open(tmp_path / "dst")
    assert report.copied == ["step-3"] and report.verified and report.problems == []
    assert [i.name for i in dst.list_checkpoints()] == ["step-3"]
    assert_items_equal(saved["step-3"], dst.load("step-3"))
    needed = set()
    for it in dst.read_manifest("step-3").items:
        needed |= {r.id for r in it.chunks}
    indexed = {e.chunk_id for e in dst.index.iter_entries()}
    bases = {e.base_id for e in dst.index.iter_entries() if e.base_id is not None}
    assert indexed == needed | bases, "no unrelated chunk was sent"
    assert _physical(dst) < _physical(store)


def test_incremental_copy_after_more_saves_sends_only_new_chunks(src, tmp_path, rng):
    store, saved = src
    copy(store, tmp_path / "dst")
    before = _physical(Store.open(tmp_path / "dst"))
    w = saved["step-5"]["w"].copy()
    w[:10] += 1
    store.save("step-6", {**saved["step-5"], "w": w})
    report = copy(store, tmp_path / "dst")
    assert report.copied == ["step-6"]
    new_in_src = store.list_checkpoints()[-1].stored_bytes  # the packs step-6 added (the manifest apart)
    manifest = Store.open(tmp_path / "dst").backend.size("manifests/step-6")
    assert report.bytes_sent <= new_in_src + manifest
    assert 0 < _physical(Store.open(tmp_path / "dst")) - before <= new_in_src
    np.testing.assert_array_equal(Store.open(tmp_path / "dst").load("step-6")["w"], w)


def test_interrupted_copy_resumes_without_sending_twice(src, tmp_path, monkeypatch):
    store, saved = src
    from deltackpt.store import copy as copy_mod

    real = copy_mod._copy_one
    calls = []

    def dies_on_third(src_, dst_, name, *a, **k):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(src_, dst_, name, *a, **k)

    monkeypatch.setattr(copy_mod, "_copy_one", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        copy(store, tmp_path / "dst")
    monkeypatch.undo()
    dst = Store.open(tmp_path / "dst")
    assert [i.name for i in dst.list_checkpoints()] == ["step-0", "step-1"]
    report = copy(store, tmp_path / "dst")
    assert report.skipped == ["step-0", "step-1"] and report.copied == list(saved)[2:]
    for name, items in saved.items():
        assert_items_equal(items, Store.open(tmp_path / "dst").load(name))


def test_a_different_checkpoint_of_the_same_name_is_refused(src, tmp_path):
    store, _ = src
    dst = Store.init(tmp_path / "dst", **SMALL)
    dst.save("step-2", {"x": np.arange(5.0)})
    with pytest.raises(CheckpointExistsError, match="Checkpoint already exists"):
        copy(store, dst)
    np.testing.assert_array_equal(dst.load("step-2")["x"], np.arange(5.0))


def test_copy_to_and_from_s3(src, tmp_path, s3_server, s3_url):
    store, saved = src
    opts = s3_server.storage_options
    up = copy(store, s3_url, dst_storage_options=opts)
    remote = Store.open(s3_url, storage_options=opts)
    assert _physical(remote) == _physical(store)
    assert up.bytes_sent - sum(i.size_bytes for i in remote.backend.list("manifests/")) == _physical(store)
    down = copy(s3_url, tmp_path / "back", ["latest"], src_storage_options=opts, verify=True)
    assert down.copied == ["step-5"] and down.problems == []
    assert_items_equal(saved["step-5"], Store.open(tmp_path / "back").load("step-5"))


class _OnFirstPhase:
    """A progress sink that runs ``action`` when the copy starts sending its first checkpoint's chunks."""

    def __init__(self, action) -> None:
        self.action, self.fired = action, False

    def start(self, *args) -> None:
        if not self.fired:
            self.fired = True
            self.action()

    def advance(self, n=1) -> None:
        pass

    def done(self) -> None:
        pass


def test_a_checkpoint_committed_into_the_destination_during_the_copy_is_not_replaced(tmp_path):
    src = Store.init(tmp_path / "src", **SMALL)
    src.save("step-5", {"w": np.arange(4096, dtype=np.float32)})
    dst = Store.init(tmp_path / "dst", **SMALL)
    theirs = np.full(4096, 7.0, np.float32)
    other = _OnFirstPhase(lambda: Store.open(tmp_path / "dst").save("step-5", {"w": theirs}))
    with pytest.raises(CheckpointExistsError, match="step-5 in the destination, with other data") as err:
        copy(src, dst, ["step-5"], progress=other)
    assert other.fired and err.value.name == "step-5"
    np.testing.assert_array_equal(Store.open(tmp_path / "dst").load("step-5")["w"], theirs)
    # the same checkpoint committed meanwhile (another copy of it) is reported as skipped, not refused
    dst2 = Store.init(tmp_path / "dst2", **SMALL)
    report = copy(src, dst2, ["step-5"], progress=_OnFirstPhase(lambda: copy(src, tmp_path / "dst2")))
    assert report.skipped == ["step-5"] and report.copied == []
    np.testing.assert_array_equal(dst2.load("step-5")["w"], np.arange(4096, dtype=np.float32))


def test_a_gc_of_the_source_during_the_copy_is_followed(tmp_path, rng):
    from deltackpt.store.gc import plan_gc

    src = Store.init(tmp_path / "src", **SMALL)
    a = rng.standard_normal(8192).astype(np.float32)
    src.save("s1", {"a": a, "b": rng.standard_normal(8192).astype(np.float32)})
    b2 = rng.standard_normal(8192).astype(np.float32)
    src.save("s2", {"a": a, "b": b2})  # a's chunks stay in s1's pack, whose b chunks die below
    src.forget(["s1"])
    dst = Store.init(tmp_path / "dst", **SMALL)
    results = []
    gc = _OnFirstPhase(lambda: results.append(plan_gc(Store.open(tmp_path / "src"), grace_s=0).execute()))
    report = copy(src, dst, ["s2"], progress=gc)
    assert results and results[0].repacked_packs >= 1  # the pack the copy had located is gone
    assert report.copied == ["s2"]
    assert_items_equal({"a": a, "b": b2}, Store.open(tmp_path / "dst").load("s2"))
    assert verify_store(Store.open(tmp_path / "dst"), level=2).ok


def test_a_delta_on_a_base_the_destination_codes_as_a_delta_fits_its_chain_limit(tmp_path, rng):
    # Two stores without delta chains (max_chain 1) that coded chunk B differently: dst as a delta on C,
    # src as a keyframe with X a delta on it. X copied onto dst's B is a chain of two.
    cfg = {**SMALL, "max_chain": 1}
    c = rng.standard_normal(SMALL["chunk_size_bytes"] // 4).astype(np.float32)
    b = c.copy()
    b[:16] += np.float32(1e-3)
    x = b.copy()
    x[16:32] += np.float32(1e-3)
    src, dst = Store.init(tmp_path / "src", **cfg), Store.init(tmp_path / "dst", **cfg)
    dst.save("d1", {"w": c})
    dst.save("d2", {"w": b})
    src.save("s1", {"w": b})
    src.save("s2", {"w": x})
    assert "delta-chains" not in dst.config.features
    copy(src, dst)
    reopened = Store.open(tmp_path / "dst")
    # The source's keyframe of B went along, and the index locates it: X's chain is one delta, as the
    # destination's readers (and older releases) follow; no feature was needed.
    assert "delta-chains" not in reopened.config.features
    x_id = reopened.read_manifest("s2").items[0].chunks[0].id
    located = reopened.index.lookup(x_id)
    assert located.base_id is not None and reopened.index.lookup(located.base_id).base_id is None
    rebuilt = Store.open(tmp_path / "dst", cache_dir=tmp_path / "fresh-cache")  # an index built from the packs
    for store in (reopened, rebuilt):
        for name, want in (("d1", c), ("d2", b), ("s1", b), ("s2", x)):
            np.testing.assert_array_equal(store.load(name)["w"], want)
        assert verify_store(store, level=2).ok


def test_tags_travel_with_the_copy(src, tmp_path):
    from deltackpt.store.retention import read_tags, set_tags

    store, _ = src
    set_tags(store, "step-1", ["best"])
    dst = Store.init(tmp_path / "dst", **SMALL)
    copy(store, dst, ["step-1"])
    assert read_tags(dst, "step-1") == ["best"]
    set_tags(dst, "step-1", ["paper"])
    set_tags(store, "step-1", ["best", "final"])
    assert copy(store, dst, ["step-1"]).skipped == ["step-1"]  # already there: its tags are added all the same
    assert read_tags(dst, "step-1") == ["best", "final", "paper"]


def test_a_damaged_manifest_is_an_error_when_named_and_reported_when_copying_all(src, tmp_path):
    from deltackpt.errors import CorruptManifestError

    store, saved = src
    path = store.backend.root / "manifests" / "step-1"
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(CorruptManifestError, match="step-1"):
        copy(store, tmp_path / "dst", ["step-1"])
    report = copy(store, tmp_path / "dst2")
    assert report.damaged == ["step-1"]
    assert report.copied == [n for n in saved if n != "step-1"]
    dst = Store.open(tmp_path / "dst2")
    for name in report.copied:
        assert_items_equal(saved[name], dst.load(name))


def test_a_chunk_the_destination_found_damaged_is_sent_from_the_source(tmp_path, rng):
    from deltackpt.errors import CorruptChunkError
    from deltackpt.store.pack import HEADER_SIZE, pack_key
    from store_helpers import flip_bit

    shared = rng.standard_normal(SMALL["chunk_size_bytes"] // 4).astype(np.float32)
    dst = Store.init(tmp_path / "dst", **SMALL)
    dst.save("old", {"w": shared})
    e = dst.index.lookup(dst.read_manifest("old").items[0].chunks[0].id)
    flip_bit(dst.backend, pack_key(e.pack), e.offset + HEADER_SIZE + e.stored_len // 2, 3)
    with pytest.raises(CorruptChunkError):
        dst.load("old")  # marks the pack
    src = Store.init(tmp_path / "src", **SMALL)
    src.save("new", {"w": shared, "v": np.ones(10, np.float32)})
    report = copy(src, dst, ["new"])
    assert report.chunks_skipped == 0  # the destination's copy was not taken for one
    np.testing.assert_array_equal(Store.open(tmp_path / "dst").load("new")["w"], shared)
    np.testing.assert_array_equal(Store.open(tmp_path / "dst").load("old")["w"], shared)  # healed too


@pytest.mark.parametrize("delta", [False, True])
def test_a_damaged_chunk_of_a_pack_copied_in_part_is_refused(tmp_path, rng, delta):
    """A pack sent whole is checked by its name; a chunk sent without the rest of its pack (repacked) is
    decoded and hashed as a load would: a damaged one fails the copy, which commits nothing."""
    from deltackpt.errors import CorruptChunkError
    from deltackpt.store.pack import HEADER_SIZE, pack_key

    src = Store.init(tmp_path / "src", chunk_size_bytes=4096, pack_target_bytes=1 << 20, delta=delta)
    state = {k: rng.standard_normal(8192).astype(np.float32) for k in ("frozen", "w", "other")}
    src.save("c1", state)  # one pack
    state["w"] = state["w"] + np.float32(1e-3)  # with deltas: coded against c1's w, which is needed too
    state["other"] = rng.standard_normal(8192).astype(np.float32)
    src.save("c2", state)  # needs c1's pack but its first "other": sent in part
    clean = copy(src, tmp_path / "clean", ["c2"])
    assert clean.packs_repacked and clean.copied == ["c2"]  # the partial path
    assert_items_equal(state, Store.open(tmp_path / "clean").load("c2"))
    manifest = src.read_manifest("c2")
    frozen = next(i for i in manifest.items if i.key == "frozen").chunks[0].id
    e = src.index.lookup(frozen)
    path = tmp_path / "src" / pack_key(e.pack)
    data = bytearray(path.read_bytes())
    data[e.offset + HEADER_SIZE + e.stored_len // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError) as ei:
        copy(src, tmp_path / "dst", ["c2"])
    assert ei.value.pack == e.pack and ei.value.checkpoint == "c2"
    assert not Store.open(tmp_path / "dst").exists("c2")


class _ForgetDuring:
    """A progress sink that forgets checkpoint ``name`` in the source and gc's it (another process's
    retention) when the copy starts sending that checkpoint's chunks."""

    def __init__(self, path, name: str) -> None:
        self.path, self.name, self.gc = path, name, None

    def start(self, label: str, total: int, unit: str) -> None:
        from deltackpt.store.gc import plan_gc

        if label == f"copy {self.name}" and self.gc is None:
            other = Store.open(self.path)
            other.forget([self.name])
            self.gc = plan_gc(other, grace_s=0).execute()

    def advance(self, n=1) -> None:
        pass

    def done(self) -> None:
        pass


def test_a_checkpoint_forgotten_in_the_source_during_copy_all_is_left_out_not_damage(tmp_path, rng):
    # It aborted the whole copy with a MissingChunkError that read like damage of the source.
    src = Store.init(tmp_path / "src", **SMALL)
    saved = _history(src, rng, n=4)
    dst = Store.init(tmp_path / "dst", **SMALL)
    hook = _ForgetDuring(tmp_path / "src", "step-2")
    report = copy(src, dst, None, progress=hook)
    assert hook.gc is not None and hook.gc.deleted_packs + hook.gc.repacked_packs >= 1  # its chunks went
    assert report.forgotten == ["step-2"] and report.damaged == []
    assert report.copied == ["step-0", "step-1", "step-3"]
    again = Store.open(tmp_path / "dst")
    for name in report.copied:
        assert_items_equal(saved[name], again.load(name))
    assert verify_store(again, level=2).ok


def test_a_named_checkpoint_forgotten_in_the_source_during_its_copy_is_not_found(tmp_path, rng):
    from deltackpt.errors import CheckpointNotFoundError

    src = Store.init(tmp_path / "src", **SMALL)
    _history(src, rng, n=4)
    dst = Store.init(tmp_path / "dst", **SMALL)
    with pytest.raises(CheckpointNotFoundError, match="forgotten in the source during the copy"):
        copy(src, dst, ["step-1", "step-2"], progress=_ForgetDuring(tmp_path / "src", "step-2"))
    assert [i.name for i in Store.open(tmp_path / "dst").list_checkpoints()] == ["step-1"]


def _copied_one(tmp_path):
    src = Store.init(tmp_path / "src", **SMALL)
    w = np.random.default_rng(0).standard_normal(20000).astype(np.float32)
    src.save("c", {"w": w})
    copy(src, tmp_path / "dst", ["c"])
    dst = Store.open(tmp_path / "dst")
    return src, dst, w, dst.index.lookup(dst.read_manifest("c").items[0].chunks[0].id)


def test_a_copy_sends_again_what_the_destination_holds_damaged(tmp_path):
    """The destination's manifest listed the same chunks, so the checkpoint was skipped as there, also with
    --overwrite: a damaged destination stayed unloadable with its source intact."""
    from deltackpt.store.pack import HEADER_SIZE, pack_key
    from store_helpers import flip_bit

    src, dst, w, entry = _copied_one(tmp_path)
    flip_bit(dst.backend, pack_key(entry.pack), entry.offset + HEADER_SIZE + entry.stored_len // 2, 3)
    assert copy(src, tmp_path / "dst", ["c"], verify=True).problems  # found, and the pack marked damaged
    report = copy(src, tmp_path / "dst", ["c"], verify=True)
    assert report.copied == ["c"] and not report.problems
    np.testing.assert_array_equal(Store.open(tmp_path / "dst").load("c")["w"], w)


def test_a_copy_sends_again_a_pack_the_destination_lost(tmp_path):
    from deltackpt.store.pack import pack_key

    src, dst, w, entry = _copied_one(tmp_path)
    (tmp_path / "dst" / pack_key(entry.pack)).unlink()
    copy(src, tmp_path / "dst", ["c"], verify=True)
    copy(src, tmp_path / "dst", ["c"], verify=True)
    np.testing.assert_array_equal(Store.open(tmp_path / "dst").load("c")["w"], w)


def test_a_damaged_destination_manifest_is_replaced_with_overwrite_and_named_without(tmp_path):
    src = Store.init(tmp_path / "src", **SMALL)
    rng = np.random.default_rng(0)
    for s in range(3):
        src.save(f"s{s}", {"w": rng.standard_normal(5000).astype(np.float32)})
    copy(src, tmp_path / "dst", ["s0", "s1"])
    path = tmp_path / "dst" / "manifests" / "s0"
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(CheckpointExistsError, match="--overwrite"):
        copy(src, tmp_path / "dst", None)
    copy(src, tmp_path / "dst", None, overwrite=True, verify=True)
    assert_items_equal(Store.open(tmp_path / "dst").load("s0"), src.load("s0"))
    assert Store.open(tmp_path / "dst").exists("s2")


def test_an_upload_replaces_a_remote_checkpoint_whose_manifest_is_damaged(tmp_path):
    """Uploader.replace_damaged promised a later local save of that name replaces it; the upload failed on
    reading the damaged manifest instead (and the error reached the training loop)."""
    from deltackpt.store import Uploader

    local = Store.init(tmp_path / "local")
    up = Uploader(local, str(tmp_path / "remote"))
    local.save("step-2", {"w": np.ones(1000, np.float32)})
    up.submit("step-2")
    up.wait()
    path = tmp_path / "remote" / "manifests" / "step-2"
    path.write_bytes(path.read_bytes()[:50])
    up.replace_damaged("step-2")  # what CheckpointManager does when its fetch meets the damage
    local.forget(["step-2"])
    local.save("step-2", {"w": np.full(1000, 2, np.float32)})
    up.submit("step-2")
    up.wait()
    up.close()
    np.testing.assert_array_equal(Store.open(tmp_path / "remote").load("step-2")["w"], np.full(1000, 2, np.float32))


def test_a_copy_makes_no_chain_longer_than_either_stores_max_chain(tmp_path):
    """The destination held the sent delta's base as a depth-2 delta of its own, the source as a keyframe: the
    copy left a depth-3 chain in stores of max_chain 2, instead of sending the source's keyframe along (as
    decisions.md says it does)."""
    from deltackpt.store import codec

    rng = np.random.default_rng(1)
    w = (rng.standard_normal(16384) * 0.05).astype(np.float32)
    states = [w.copy()]
    for _ in range(3):
        w.view(np.uint32)[rng.integers(0, 16384, 40)] += np.uint32(1)
        states.append(w.copy())
    a = Store.init(tmp_path / "a", chunk_size_bytes=16384, max_chain=2)
    b = Store.init(tmp_path / "b", chunk_size_bytes=16384, max_chain=2)
    for i, state in enumerate(states[:3]):
        b.save(f"b{i}", {"w": state})
    a.save("a0", {"w": states[2]})
    a.save("a1", {"w": states[3]})

    def depth(store, name):
        d, e = 0, store.index.lookup(store.read_manifest(name).items[0].chunks[0].id)
        while codec.is_delta(e.codec):
            d, e = d + 1, store.index.lookup(e.base_id)
        return d

    assert depth(b, "b2") == 2
    copy(a, tmp_path / "b", ["a1"])
    b = Store.open(tmp_path / "b")
    assert depth(b, "a1") <= 2
    np.testing.assert_array_equal(b.load("a1")["w"], states[3])


def test_a_copy_that_fails_part_way_is_retried_without_sending_its_packs_again(src, tmp_path):
    """The packs a failed copy did put were indexed only at its commit: the retry (an Uploader's, on the same
    destination Store) put every one of them again, so each failure on a flaky link restarted from zero."""
    store, saved = src
    dst = Store.init(tmp_path / "dst", **SMALL)
    real_put, puts = dst.backend.put, []

    def flaky(key, data):
        if key.startswith("packs/"):
            puts.append(key)
            if len(puts) == 3:
                raise OSError("connection reset")
        return real_put(key, data)

    dst.backend.put = flaky
    with pytest.raises(OSError):
        copy(store, dst, ["step-3"])
    assert len(puts) == 3
    copy(store, dst, ["step-3"])
    assert len(puts) == len(set(puts)) + 1  # only the failed pack was put twice
    assert_items_equal(saved["step-3"], Store.open(tmp_path / "dst").load("step-3"))


def test_a_pack_removed_from_the_destination_behind_its_index_is_sent_again(src, tmp_path):
    """A pack of the destination deleted outside deltackpt (a bucket lifecycle rule) while its Store object
    still located chunks there: the next copy deduplicated against it and failed at commit with a missing
    chunk, permanently for an Uploader. It now sends what the pack held and commits."""
    from deltackpt.store.pack import pack_key

    store, saved = src
    dst = Store.init(tmp_path / "dst", **SMALL)
    copy(store, dst, ["step-2"])
    frozen = store.read_manifest("step-2").items[0].chunks[0].id
    lost = dst.index.lookup(frozen).pack
    dst.backend.delete(pack_key(lost))
    report = copy(store, dst, ["step-3"])
    assert report.copied == ["step-3"]
    assert_items_equal(saved["step-3"], Store.open(tmp_path / "dst").load("step-3"))

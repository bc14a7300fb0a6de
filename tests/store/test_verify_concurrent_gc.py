"""verify while a gc runs on the same store (verify takes no lock): what the gc moved or dropped is no damage.

Each test runs a real ``forget`` + ``gc`` on a second Store object, on the same directory, at one exact point
inside verify (a verify function wrapped by monkeypatch), never by timing. The store: ``a`` = {w, junk},
``b`` = {w drifted}, stored as deltas against a's keyframes; forgetting ``a`` leaves a's packs partly dead
(junk) while the bases of b's deltas stay live, so gc copies those bases into a new pack and deletes a's packs.
The verifier's index cache is either the store's own (``shared``, as a second process on this host uses it)
or one of its own (``own``, as on another host): only then does it still locate the bases in a deleted pack.
"""

from __future__ import annotations

import json
from contextlib import ExitStack

import numpy as np
import pytest

from deltackpt.cli import main
from deltackpt.errors import MissingChunkError
from deltackpt.store import Store, codec
from deltackpt.store import verify as verify_mod
from deltackpt.store.gc import plan_gc
from deltackpt.store.lock import EXCLUSIVE
from deltackpt.store.pack import HEADER_SIZE, pack_key
from deltackpt.store.source import ChunkSource
from deltackpt.store.verify import ProblemKind, verify_store

from store_helpers import SMALL, close_index, mutate_object, pack_names


def _layout(root, with_c: bool = False) -> dict:
    """Save a and b (and with ``with_c`` an unrelated c, one pack of keyframes); returns what the tests need."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal(8192).astype(np.float32)
    w2 = w.copy()
    w2[::50] += 1.0  # a few changed elements: b's chunks are small deltas against a's
    store = Store.init(root, **SMALL)
    store.save("a", {"w": w, "junk": rng.standard_normal(3 * 8192).astype(np.float32)})
    store.save("b", {"w": w2})
    c = rng.standard_normal(2048).astype(np.float32)
    if with_c:
        store.save("c", {"only_in_c": c})
    deltas = [store.index.lookup(r.id) for r in store.read_manifest("b").item_map()["w"].chunks]
    assert deltas and all(codec.is_delta(e.codec) for e in deltas), "b must be stored as deltas against a"
    out = {"w2": w2, "c": c, "delta_packs": {e.pack for e in deltas},
           "base_packs": {store.index.lookup(e.base_id).pack for e in deltas}}
    assert not out["delta_packs"] & out["base_packs"]
    if with_c:
        out["c_entry"] = store.index.lookup(store.read_manifest("c").items[0].chunks[0].id)
        assert out["c_entry"].pack not in out["delta_packs"] | out["base_packs"]
    close_index(store)
    return out


def _forget_and_gc(root, cache_dir) -> None:
    """Another Store on the same directory (``cache_dir`` None: the store's own cache) forgets a and runs gc,
    which moves the bases of b's deltas to a new pack and deletes a's packs."""
    other = Store.open(root, cache_dir=cache_dir)
    before = pack_names(other)
    other.forget(["a"])
    result = plan_gc(other, grace_s=0, max_unused=0.0).execute()
    assert result.repacked_packs >= 1 and result.moved_chunks >= 1 and result.new_packs >= 1
    assert before - pack_names(other), "gc deleted no pack"


def _verifier(root, tmp_path, cache: str) -> Store:
    return Store.open(root) if cache == "shared" else Store.open(root, cache_dir=tmp_path / "verify-cache")


def _gc_cache(tmp_path, cache: str):
    return None if cache == "shared" else tmp_path / "gc-cache"


def _gc_before(monkeypatch, name: str, root, cache_dir, when=lambda *a, **k: True) -> list:
    """Wrap verify's function ``name``: the first call for which ``when(*args)`` holds runs the gc first."""
    real, ran = getattr(verify_mod, name), []

    def wrapped(*args, **kwargs):
        if not ran and when(*args, **kwargs):
            _forget_and_gc(root, cache_dir)
            ran.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_mod, name, wrapped)
    return ran


def _assert_honest(report) -> None:
    """Never clean and complete with skipped work; whatever was skipped is said to be a gc's doing."""
    skipped = report.packs_skipped + report.chunks_skipped
    assert report.complete == (skipped == 0), report.as_dict()
    if not report.complete:
        assert report.skipped_by == "concurrent-gc" and not report.clean


def _read_last(store: Store, packs: set[str]) -> None:
    """Order verify's pack pass (packs verified longest ago go first): ``packs`` last, every other one before."""
    for p in pack_names(store):
        store.index.mark_verified(p, when=2.0 if p in packs else 1.0)


# -- a delta whose base gc moved ------------------------------------------------------------------------------


def test_a_delta_whose_base_gc_moved_mid_verify_is_no_damage_and_marks_nothing(tmp_path, monkeypatch):
    """Every other pack is read, then gc moves the bases of b's deltas and deletes their old pack, then the
    deltas are decoded: a cache of its own still locates their bases in the deleted pack ("base unreadable").
    Checked again against the refreshed index, they decode: no problem, no pack marked damaged, and the report
    is complete (every pack listed was read)."""
    root = tmp_path / "s"
    lay = _layout(root)
    verifier = _verifier(root, tmp_path, "own")
    _read_last(verifier, lay["delta_packs"])
    ran = _gc_before(monkeypatch, "_decode_chunks", root, _gc_cache(tmp_path, "own"),
                     when=lambda _source, table, *a, **k: table.name in lay["delta_packs"])
    report = verify_store(verifier, level=2)
    assert ran
    assert [p.as_dict() for p in report.problems] == []
    assert verifier.index.damaged_packs(refresh=True) == frozenset()
    _assert_honest(report)
    assert report.clean and report.packs_checked == report.num_packs
    np.testing.assert_array_equal(Store.open(root).load("b")["w"], lay["w2"])


def test_a_gc_still_running_when_verify_checks_again_rechecks_against_a_fresh_listing(tmp_path, monkeypatch):
    """When no window free of gc comes (a gc holds the exclusive lock while verify checks again), the findings are
    checked against a fresh listing all the same: the deltas decode through the bases' new pack, so nothing is
    damage, nothing is marked, and every chunk counts as checked."""
    root = tmp_path / "s"
    lay = _layout(root)
    verifier = _verifier(root, tmp_path, "own")
    _read_last(verifier, lay["delta_packs"])
    monkeypatch.setattr(verify_mod, "_SETTLE_WAIT_S", 0.0)
    real, locked = verify_mod._decode_chunks, []
    with ExitStack() as stack:
        def gc_then_hold(source, table, *a, **k):
            if table.name in lay["delta_packs"] and not locked:
                _forget_and_gc(root, tmp_path / "gc-cache")
                gc = Store.open(root, cache_dir=tmp_path / "gc-cache")
                locked.append(stack.enter_context(gc.lock(EXCLUSIVE, wait_s=0)))  # held until verify returns
            return real(source, table, *a, **k)

        monkeypatch.setattr(verify_mod, "_decode_chunks", gc_then_hold)
        report = verify_store(verifier, level=2)
    assert locked, "the gc did not run"
    assert [p.as_dict() for p in report.problems] == []
    assert verifier.index.damaged_packs(refresh=True) == frozenset()
    _assert_honest(report)
    assert report.complete and report.ok


def test_a_pack_lost_while_a_gc_holds_the_lock_is_reported(tmp_path, monkeypatch, capsys):
    """A pack deleted by hand (no gc's doing) while another process holds the exclusive lock from start to end:
    the chunk is in no pack of a fresh listing, which no gc causes (it publishes what it moves before it
    deletes), so verify reports it and exits 1 (it said "partial ... no problems found" before)."""
    root = tmp_path / "s"
    store = Store.init(root, **SMALL)
    store.save("c", {"x": np.random.default_rng(1).standard_normal(4096).astype(np.float32)})
    packs = {store.index.lookup(r.id).pack for it in store.read_manifest("c").items for r in it.chunks}
    close_index(store)
    for p in packs:
        (root / pack_key(p)).unlink()
    monkeypatch.setattr(verify_mod, "_SETTLE_WAIT_S", 0.0)
    holder = Store.open(root, cache_dir=tmp_path / "other")
    with holder.lock(EXCLUSIVE, wait_s=0):  # a gc in its delete phase on another host, say
        code = main(["verify", str(root), "--level", "0"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "missing" in out and "c" in out, out


# -- a checkpoint forgotten and gc'd during verify ------------------------------------------------------------

# (verify's function the gc runs before, level, index cache): every case reported damage before the fix.
FORGOTTEN = [("_refresh_cache", level, cache) for level in (0, 1, 2) for cache in ("shared", "own")] + [
    ("check_structure", 0, "shared"),  # b's bases moved after the cache was read: "base chunk is missing"
    ("_needed_chunks", 2, "own"),  # a listed, then forgotten before its manifest was read
]


@pytest.mark.parametrize("hook,level,cache", FORGOTTEN, ids=[f"{h}-L{lv}-{c}" for h, lv, c in FORGOTTEN])
def test_a_checkpoint_forgotten_and_gcd_mid_verify_has_no_missing_chunks(tmp_path, monkeypatch, hook, level,
                                                                       cache):
    root = tmp_path / "s"
    lay = _layout(root)
    verifier = _verifier(root, tmp_path, cache)
    ran = _gc_before(monkeypatch, hook, root, _gc_cache(tmp_path, cache))
    report = verify_store(verifier, level=level)
    assert ran
    assert [p.as_dict() for p in report.problems] == []
    assert report.ok and report.damaged_checkpoints == []
    assert verifier.index.damaged_packs(refresh=True) == frozenset()
    _assert_honest(report)
    np.testing.assert_array_equal(Store.open(root).load("b")["w"], lay["w2"])


def test_cli_verify_during_forget_and_gc_exits_0(tmp_path, monkeypatch, capsys):
    """`deltackpt verify` (the store's own cache): exit 0, no problem, and the report says what it did."""
    root, original = tmp_path / "s", verify_mod._refresh_cache
    _layout(root)
    ran = _gc_before(monkeypatch, "_refresh_cache", root, None)
    code = main(["verify", str(root), "--level", "2", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert ran and code == 0, rep
    assert rep["ok"] is True and rep["problems"] == [] and rep["damaged_checkpoints"] == []
    assert rep["complete"] or rep["skipped_by"] == "concurrent-gc"
    assert rep["clean"] == (rep["complete"] and rep["packs_skipped"] == rep["chunks_skipped"] == 0)
    monkeypatch.setattr(verify_mod, "_refresh_cache", original)  # a second store, a text run
    _layout(tmp_path / "t")
    ran = _gc_before(monkeypatch, "_refresh_cache", tmp_path / "t", None)
    assert main(["verify", str(tmp_path / "t"), "--level", "2"]) == 0
    out = capsys.readouterr().out
    assert ran
    assert "no problems found" in out and "missing" not in out


def test_cli_verify_says_incomplete_when_reads_keep_failing_while_a_gc_runs(tmp_path, monkeypatch, capsys):
    """`deltackpt verify` with an index cache of its own (another host's) while a gc moves the bases of b's deltas
    and then still holds its lock, and reads of the deltas keep failing (as reads of a pack being deleted do):
    exit 0, the deltas not checked, "run verify again"; no damage, none marked."""
    root = tmp_path / "s"
    lay = _layout(root)
    deltas = {r.id for r in Store.open(root).read_manifest("b").item_map()["w"].chunks}
    monkeypatch.setenv("DELTACKPT_CACHE_DIR", str(tmp_path / "cli-cache"))
    _read_last(Store.open(root), lay["delta_packs"])
    close_index(Store.open(root))
    monkeypatch.setattr(verify_mod, "_SETTLE_WAIT_S", 0.0)
    real, locked = verify_mod._decode_chunks, []
    real_decode = ChunkSource.decode_entry

    def failing(self, entry, *a, **k):
        if locked and entry.chunk_id in deltas:
            raise MissingChunkError(entry.chunk_id.hex())
        return real_decode(self, entry, *a, **k)

    monkeypatch.setattr(ChunkSource, "decode_entry", failing)
    with ExitStack() as stack:
        def gc_then_hold(source, table, *a, **k):
            if table.name in lay["delta_packs"] and not locked:
                _forget_and_gc(root, tmp_path / "gc-cache")
                gc = Store.open(root, cache_dir=tmp_path / "gc-cache")
                locked.append(stack.enter_context(gc.lock(EXCLUSIVE, wait_s=0)))
            return real(source, table, *a, **k)

        monkeypatch.setattr(verify_mod, "_decode_chunks", gc_then_hold)
        code = main(["verify", str(root), "--level", "2"])
    out = capsys.readouterr().out
    assert locked and code == 0, out
    assert "(partial)" in out and "a gc that moved them meanwhile (run verify again)" in out, out
    assert "no problems found in what was checked" in out and "bad-chunk" not in out, out
    assert Store.open(root).index.damaged_packs(refresh=True) == frozenset()


# -- real damage is still reported and marked ---------------------------------------------------------------


def _damage_c(root, entry) -> None:
    def flip(data: bytes) -> bytes:
        data = bytearray(data)
        data[entry.offset + HEADER_SIZE + 10] ^= 0xFF
        return bytes(data)

    mutate_object(Store.open(root).backend, pack_key(entry.pack), flip)


def test_control_real_damage_without_gc_is_reported_and_marked(tmp_path):
    root = tmp_path / "s"
    lay = _layout(root, with_c=True)
    _damage_c(root, lay["c_entry"])
    verifier = _verifier(root, tmp_path, "own")
    report = verify_store(verifier, level=2)
    kinds = {(p.kind, p.pack) for p in report.problems}
    assert kinds == {(ProblemKind.PACK_HASH, lay["c_entry"].pack), (ProblemKind.BAD_CHUNK, lay["c_entry"].pack)}
    assert report.damaged_checkpoints == ["c"] and not report.ok
    assert verifier.index.damaged_packs(refresh=True) == {lay["c_entry"].pack}


def test_real_damage_found_while_a_gc_ran_is_still_reported_and_marked(tmp_path, monkeypatch):
    """A gc during verify: the damage in c's pack holds when checked again, and only it is reported and marked
    (not b's deltas, whose bases the gc moved)."""
    root = tmp_path / "s"
    lay = _layout(root, with_c=True)
    _damage_c(root, lay["c_entry"])
    verifier = _verifier(root, tmp_path, "own")
    _read_last(verifier, lay["delta_packs"])
    ran = _gc_before(monkeypatch, "_decode_chunks", root, _gc_cache(tmp_path, "own"),
                     when=lambda _source, table, *a, **k: table.name in lay["delta_packs"])
    report = verify_store(verifier, level=2)
    assert ran
    kinds = {(p.kind, p.pack) for p in report.problems}
    assert kinds == {(ProblemKind.PACK_HASH, lay["c_entry"].pack), (ProblemKind.BAD_CHUNK, lay["c_entry"].pack)}
    assert report.damaged_checkpoints == ["c"]
    assert verifier.index.damaged_packs(refresh=True) == {lay["c_entry"].pack}
    _assert_honest(report)

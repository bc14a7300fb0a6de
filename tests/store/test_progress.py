"""Progress: the long engine operations (verify, gc, index rebuild, repair, copy) report each phase to the
object they are handed, with totals that match the work they then do, and close every phase they open."""

from __future__ import annotations

import pytest

from deltackpt.store.copy import copy_checkpoints
from deltackpt.store.gc import plan_gc
from deltackpt.store.progress import NULL_PROGRESS, NullProgress, Progress, phase
from deltackpt.store.repair import repair_store
from deltackpt.store.verify import verify_store

from store_helpers import pack_names, random_array


class Recording:
    """A Progress that records every phase: label, total, unit, units advanced, whether it was done."""

    def __init__(self) -> None:
        self.phases: list[dict] = []

    def start(self, label: str, total: int, unit: str) -> None:
        assert not self.phases or self.phases[-1]["done"], f"{label!r} started inside {self.phases[-1]['label']!r}"
        assert total >= 0
        self.phases.append({"label": label, "total": total, "unit": unit, "advanced": 0, "done": False})

    def advance(self, n: int = 1) -> None:
        current = self.phases[-1]
        assert not current["done"] and n >= 0
        current["advanced"] += n

    def done(self) -> None:
        self.phases[-1]["done"] = True

    def labels(self) -> list[str]:
        return [p["label"] for p in self.phases]

    def one(self, label: str) -> dict:
        (found,) = [p for p in self.phases if p["label"] == label]
        return found

    def all_done_and_full(self) -> bool:
        return all(p["done"] and p["advanced"] == p["total"] for p in self.phases)


def _history(store, rng, n: int = 3) -> list[str]:
    """``n`` checkpoints with one shared item and one of their own (several packs)."""
    shared = random_array(rng, "float32", (6000,))
    for i in range(n):
        store.save(f"c{i}", {"shared": shared, "own": random_array(rng, "float32", (12000,))})
    return [f"c{i}" for i in range(n)]


def test_null_progress_is_a_progress():
    assert isinstance(NULL_PROGRESS, Progress) and isinstance(Recording(), Progress)


def test_phase_is_done_when_its_block_fails():
    rec = Recording()
    with pytest.raises(RuntimeError):
        with phase(rec, "work", 3, "pack") as bar:
            bar.advance(1)
            raise RuntimeError("boom")
    assert rec.phases == [{"label": "work", "total": 3, "unit": "pack", "advanced": 1, "done": True}]
    with phase(None, "nobody listens", 1, "pack") as bar:  # None: no one listens
        assert isinstance(bar, NullProgress)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_verify_reports_manifests_chunks_and_pack_bytes(store, rng, level):
    names = _history(store, rng)
    rec = Recording()
    report = verify_store(store, level=level, progress=rec)
    assert report.clean
    expected = ["verify manifests", "verify structure"]
    if level >= 1:
        expected = ["verify manifests", "index check", "verify structure", f"verify level {level}"]
    assert rec.labels() == expected
    assert rec.all_done_and_full()
    assert rec.one("verify manifests")["total"] == len(names)
    referenced = {ref.id for n in names for it in store.read_manifest(n).items for ref in it.chunks}
    assert rec.one("verify structure") == {"label": "verify structure", "total": len(referenced),
                                           "unit": "chunk", "advanced": len(referenced), "done": True}
    if level >= 1:
        assert rec.one("index check")["total"] == len(pack_names(store)) == report.num_packs
        packs = rec.one(f"verify level {level}")
        assert packs["unit"] == "B" and packs["total"] == report.bytes_checked > 0


def test_partial_verify_totals_what_it_means_to_read_and_closes_the_phase(store, rng):
    _history(store, rng, n=4)
    rec = Recording()
    report = verify_store(store, level=1, sample=0.5, progress=rec)
    packs = rec.one("verify level 1")
    assert report.packs_skipped > 0 and packs["total"] == packs["advanced"] == report.bytes_checked
    rec = Recording()
    report = verify_store(store, level=1, max_duration_s=0, progress=rec)
    packs = rec.one("verify level 1")  # stopped by the time limit: the phase ends short of its total
    assert not report.complete and packs["done"] and packs["advanced"] == 0 < packs["total"]


def test_gc_reports_tables_read_then_packs_deleted_and_repacked(store, rng):
    p = random_array(rng, "float32", (4096,))
    store.save("a", {"p": p, "q": random_array(rng, "float32", (8192,))})  # one pack, p live after forget
    store.save("b", {"p": p, "r": random_array(rng, "float32", (2048,))})
    store.save("c", {"z": random_array(rng, "float32", (3000,))})  # its own pack, dead after forget
    store.forget(["a", "c"])
    listed = len(pack_names(store))
    rec = Recording()
    plan = plan_gc(store, grace_s=0, progress=rec)
    assert rec.phases == [{"label": "gc plan", "total": listed, "unit": "pack", "advanced": listed, "done": True}]
    rec = Recording()
    result = plan.execute(progress=rec)
    assert result.deleted_packs > 0 and result.repacked_packs > 0
    assert rec.labels() == ["gc"] and rec.all_done_and_full()
    assert rec.one("gc")["total"] == result.deleted_packs + result.repacked_packs


def test_index_rebuild_reports_each_pack(store, rng):
    _history(store, rng)
    rec = Recording()
    indexed, _ = store.rebuild_index(progress=rec)
    assert rec.phases == [{"label": "index rebuild", "total": indexed, "unit": "pack", "advanced": indexed,
                           "done": True}]
    assert indexed == len(pack_names(store))


def test_repair_reports_pack_tables_then_index_rebuild(local_store, rng):
    _history(local_store, rng)
    n = len(pack_names(local_store))
    rec = Recording()
    report = repair_store(local_store.backend, progress=rec)
    assert report.ok and rec.labels() == ["repair packs", "index rebuild"] and rec.all_done_and_full()
    assert rec.one("repair packs")["total"] == rec.one("index rebuild")["total"] == n


def test_copy_reports_each_checkpoint_in_the_bytes_it_sends(make_store, rng):
    src = make_store("memory", "src")
    names = _history(src, rng)
    dst = make_store("memory", "dst")
    rec = Recording()
    report = copy_checkpoints(src, dst, progress=rec)
    assert report.copied == names
    assert rec.labels() == [f"copy {n}" for n in names] and rec.all_done_and_full()
    assert all(p["unit"] == "B" for p in rec.phases)
    # The first checkpoint sends every chunk it reads; the later ones only their own item.
    first = src.index.lookup_many({ref.id for it in src.read_manifest("c0").items for ref in it.chunks})
    assert rec.one("copy c0")["total"] == sum(e.span for e in first.values())
    assert 0 < rec.one("copy c1")["total"] < rec.one("copy c0")["total"]
    rec = Recording()
    again = copy_checkpoints(src, dst, progress=rec)  # all there already: nothing to send, no phase
    assert again.skipped == names and rec.phases == []

"""paused_gc: the collector is off inside, back on after the last of nested or concurrent pauses, and left
off if the caller had turned it off."""

from __future__ import annotations

import gc
import threading

import pytest

from deltackpt.store.pausegc import paused_gc


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_pause_disables_then_restores():
    gc.enable()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the outer pause is still active"
    assert gc.isenabled()


def test_pause_restores_after_an_exception():
    gc.enable()
    with pytest.raises(RuntimeError):
        with paused_gc():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_pause_leaves_a_disabled_collector_disabled():
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_in_threads_resume_after_the_last():
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def worker():
        with paused_gc():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    with paused_gc():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled(), "the worker's pause outlives the main thread's"
    release.set()
    t.join(10)
    assert gc.isenabled()


def _cyclic_garbage_of(fn) -> list:
    """The objects ``fn()`` made and left in reference cycles (found by a full collection). Objects made before
    it do not count: an earlier test's S3 client, released by fsspec's event-loop thread meanwhile, would."""
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fn()
        gc.collect()
        found = [o for o in gc.garbage if id(o) not in before]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


@pytest.mark.parametrize("kind", ["local", "memory"])  # memory: no local path, packs go through the upload pool
def test_save_and_load_leave_no_items_in_cycles(make_store, kind):
    # The pause's premise: nothing per item lands in a cycle (the writer's pack sink held the writer, and so
    # the parent's items, until a collection: 0.41 s at 100k items, as the save's pause ended).
    import numpy as np

    from deltackpt.store.manifest import Item

    rng = np.random.default_rng(3)
    items = {f"p{i:03d}": (rng.standard_normal(1024) * 0.02).astype(np.float32) for i in range(300)}
    store = make_store(kind, chunk_size_bytes=8192)
    store.save("a", items)
    store.load("a")  # what a first load sets up once (imports, caches) is not per item
    changed = {k: v + np.float32(1e-3) if i % 100 == 0 else v for i, (k, v) in enumerate(items.items())}
    for op in (lambda: store.save("b", changed), lambda: store.load("b")):
        garbage = _cyclic_garbage_of(op)
        assert not [o for o in garbage if isinstance(o, Item)], len(garbage)
        assert len(garbage) < 100, sorted({type(o).__name__ for o in garbage})

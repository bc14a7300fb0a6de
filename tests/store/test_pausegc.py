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

"""CheckpointManager raises the typed deltackpt error (never DCP's CheckpointException, a BaseException that
``except Exception`` misses) from a blocking save, a background save and a restore."""

from __future__ import annotations

import os

import pytest

from deltackpt import CheckpointManager, CorruptChunkError, CorruptManifestError, DeltackptError, TrainState
from deltackpt.dcp.writer import DeltaStorageWriter
from deltackpt.store import Store
from train_helpers import make_model, make_optim

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _state(seed=0):
    model = make_model(seed)
    return TrainState(model=model, optimizer=make_optim(model))


def _failing_finish(self, metadata, results):
    raise CorruptChunkError("injected damage", chunk_id="cd" * 16)


@pytest.mark.parametrize("async_mode", [None, "thread"])
def test_save_failure_is_the_typed_error(tmp_path, monkeypatch, async_mode):
    path = str(tmp_path / "store")
    monkeypatch.setattr(DeltaStorageWriter, "finish", _failing_finish)
    mgr = CheckpointManager(path, _state(), async_mode=async_mode)
    try:
        mgr.save(1)
        mgr.wait()
    except Exception as e:  # a plain `except Exception` catches it
        err = e
    else:
        pytest.fail("the injected failure was not raised")
    assert isinstance(err, CorruptChunkError) and err.chunk_id == "cd" * 16
    assert set(err.rank_errors) == {0}
    if async_mode:
        assert any("step-00000001" in n and "background" in n for n in err.__notes__)
    monkeypatch.undo()
    mgr.close()
    assert Store.open(path).list_checkpoints() == []


def test_restore_of_damaged_manifest_names_it(tmp_path):
    path = str(tmp_path / "store")
    with CheckpointManager(path, _state()) as mgr:
        name = mgr.save(1)
    f = os.path.join(path, "manifests", name)
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x5A
    open(f, "wb").write(bytes(data))
    with CheckpointManager(path, _state(seed=1)) as mgr:
        with pytest.raises(CorruptManifestError) as ei:
            mgr.restore(name)
        assert ei.value.checkpoint == name
        with pytest.raises(DeltackptError, match="no intact checkpoint"):
            mgr.restore_latest()


def test_close_raises_the_failed_save_not_a_later_upload_error_and_still_cleans_up(tmp_path, monkeypatch, caplog):
    """An async save fails, and at close the uploads fail too: the save's error is what close raises (it was
    the upload's, with the save's only as its context), the upload's is logged, and the manager's own process
    group is still destroyed."""
    from deltackpt.store.tier import Uploader

    monkeypatch.setattr(DeltaStorageWriter, "finish", _failing_finish)
    mgr = CheckpointManager(str(tmp_path / "store"), _state(), async_mode="thread", remote=str(tmp_path / "cold"))
    destroyed = []
    monkeypatch.setattr(mgr, "_destroy_own_group", lambda: destroyed.append(True))
    monkeypatch.setattr(Uploader, "close", lambda self: (_ for _ in ()).throw(OSError("remote gone")))
    mgr.save(1)
    with pytest.raises(CorruptChunkError):
        mgr.close()
    assert destroyed == [True] and "remote gone" in caplog.text


class _InterruptedOnce:
    """The pending save's future, whose first ``result()`` is cut short by a KeyboardInterrupt (a Ctrl-C, a
    SIGTERM handler's sys.exit) while the save goes on: a real signal reaches whichever thread the kernel picks."""

    def __init__(self, fut) -> None:
        self._fut, self._first = fut, True

    def result(self, *args, **kwargs):
        if self._first:
            self._first = False
            raise KeyboardInterrupt
        return self._fut.result(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fut, name)


def _interrupt_close_during(mgr) -> None:
    """close() the manager while its wait for the pending save is interrupted: the KeyboardInterrupt
    propagates."""
    fut, *rest = mgr._pending
    mgr._pending = (_InterruptedOnce(fut), *rest)
    with pytest.raises(KeyboardInterrupt):
        mgr.close()


def test_an_interrupted_close_still_reports_the_pending_saves_error(tmp_path, monkeypatch, caplog):
    import logging
    import time

    def slow_failing_commit(self, *args, **kwargs):
        time.sleep(1.0)
        raise OSError("disk went away (test)")

    mgr = CheckpointManager(str(tmp_path / "s"), _state(), async_mode="thread")
    monkeypatch.setattr(Store, "commit", slow_failing_commit)
    mgr.save(1)
    with caplog.at_level(logging.ERROR, logger="deltackpt.train"):
        _interrupt_close_during(mgr)
    assert mgr._pending is None and "disk went away (test)" in caplog.text


def test_an_interrupted_close_still_uploads_the_pending_save(tmp_path, monkeypatch):
    import time

    real_commit = Store.commit

    def slow_commit(self, *args, **kwargs):
        time.sleep(1.0)
        return real_commit(self, *args, **kwargs)

    mgr = CheckpointManager(str(tmp_path / "local"), _state(), async_mode="thread", remote=str(tmp_path / "remote"))
    monkeypatch.setattr(Store, "commit", slow_commit)
    mgr.save(1)
    _interrupt_close_during(mgr)
    assert Store.open(tmp_path / "remote").checkpoint_names() == ["step-00000001"]

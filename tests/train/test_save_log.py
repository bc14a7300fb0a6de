"""CheckpointManager logs one line per save (logger "deltackpt.train", INFO): name, seconds, and the bytes the
save added / its logical bytes, as the committed manifest records them; an async save's line comes as it
completes."""

from __future__ import annotations

import logging
import re

import pytest

from deltackpt import CheckpointManager, TrainState
from deltackpt.store import Store
from train_helpers import make_model, make_optim

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

LINE = re.compile(r"saved checkpoint '(?P<name>[^']+)' in (?P<s>\d+\.\d\d) s: (?P<new>[\d,]+) bytes new / "
                  r"(?P<logical>[\d,]+) logical")


def _saves(caplog) -> list[dict]:
    out = []
    for r in caplog.records:
        m = LINE.fullmatch(r.getMessage()) if r.name == "deltackpt.train" else None
        if m:
            assert r.levelno == logging.INFO
            out.append({"name": m["name"], "s": float(m["s"]), "new": int(m["new"].replace(",", "")),
                        "logical": int(m["logical"].replace(",", ""))})
    return out


@pytest.mark.parametrize("async_mode", [None, "thread"])
def test_each_save_logs_name_seconds_and_bytes_new_of_logical(tmp_path, caplog, async_mode):
    caplog.set_level(logging.INFO, logger="deltackpt.train")
    model = make_model(0)
    state = TrainState(model=model, optimizer=make_optim(model))
    with CheckpointManager(str(tmp_path / "store"), state, every_n_steps=1, async_mode=async_mode) as mgr:
        mgr.save(1)
        mgr.wait()
        assert [s["name"] for s in _saves(caplog)] == ["step-00000001"]  # logged by the time wait() returns
        mgr.save(2)  # the same weights again: deduplicated, little new
    saves = _saves(caplog)
    assert [s["name"] for s in saves] == ["step-00000001", "step-00000002"]
    store = Store.open(str(tmp_path / "store"))
    for s in saves:
        stats = store.read_manifest(s["name"]).stats
        assert (s["new"], s["logical"]) == (stats.stored_bytes, stats.logical_bytes)
        assert s["s"] >= 0
    assert saves[0]["logical"] > 0 and saves[1]["new"] < saves[0]["new"]

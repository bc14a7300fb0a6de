"""Single-process saves and loads through deltackpt's wrappers and the manager print no warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import deltackpt
from deltackpt import CheckpointManager, TrainState

pytestmark = pytest.mark.timeout(120)


def test_single_process_save_load_and_manager_warn_nothing(tmp_path):
    sd = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    model = torch.nn.Linear(4, 4)
    state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deltackpt.save(sd, str(tmp_path / "a"), "one")
        deltackpt.load(sd, str(tmp_path / "a"))
        deltackpt.async_save(sd, str(tmp_path / "a"), "two").result()
        with CheckpointManager(str(tmp_path / "m"), state, every_n_steps=1) as mgr:
            mgr.save(1)
            mgr.restore_latest()
    assert [str(w.message) for w in caught] == []


def test_dcp_warning_is_still_shown_for_plain_dcp_calls(tmp_path):
    import torch.distributed.checkpoint as dcp
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.zeros(3)}, storage_writer=deltackpt.DeltaStorageWriter(str(tmp_path / "s"), "x"))

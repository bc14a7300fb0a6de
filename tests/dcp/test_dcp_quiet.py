"""Single-process saves and loads through deltackpt's wrappers and the manager print no warning (each run in
a fresh interpreter, with every warning shown)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = r"""
import sys, warnings
import torch
import deltackpt
from deltackpt import CheckpointManager, TrainState
path = sys.argv[1]
sd = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
model = torch.nn.Linear(4, 4)
state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
deltackpt.save(sd, path + "/a", "one")
deltackpt.load(sd, path + "/a")
deltackpt.async_save(sd, path + "/a", "two").result()
with CheckpointManager(path + "/m", state, every_n_steps=1, async_mode="thread") as mgr:
    mgr.save(1)
    mgr.save(2)
    mgr.restore_latest()
print("done")
"""


def test_single_process_save_load_and_manager_warn_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-W", "always", "-c", SCRIPT, str(tmp_path)], capture_output=True,
                       text=True, timeout=150)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done"
    assert "Warning" not in r.stderr, r.stderr

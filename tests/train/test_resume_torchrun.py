"""Bit-exact auto-resume of ``examples/train_fsdp.py`` under torchrun restarts.

Run A trains 20 steps uninterrupted; run B is the same job whose rank 1 dies (``os._exit``) after step 12 in
the first attempt. torchrun (``--max-restarts 1``) restarts both ranks, which resume from the step-10
checkpoint and finish. Every logged loss of B (float hex, including the first attempt's and the steps replayed
after the resume, across the epoch boundary at step 16/17) and the final model + optimizer state must equal
A's bit for bit.

torchrun's agent shares one TCPStore with the workers across restart rounds, and a restarted worker's plain
``init_process_group`` reads the dead attempt's gloo addresses (keys ``default_pg/0//cpu//0/<rank>`` survive
in that store): the restart then fails with ``Gloo connectFullMesh failed ... Connection refused`` or hangs,
about half the time. The example joins through a per-attempt ``PrefixStore``, so the test runs torchrun
exactly as a user would, without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from dist import assert_tree_equal
from train_helpers import torchrun_example

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS = 20
STEPS_PER_EPOCH = 8  # 64 samples / batch 8


def _torchrun(cwd: Path, *args: str, max_restarts: int = 0, timeout: float = 240) -> subprocess.CompletedProcess:
    return torchrun_example(cwd, *args, max_restarts=max_restarts, timeout=timeout)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_restart_resumes_bit_exact(tmp_path):
    common = ["--steps", str(STEPS), "--save-every", "5"]
    a = _torchrun(tmp_path, *common, "--store", "storeA", "--loss-log", "A.jsonl", "--dump-final", "A.pt")
    assert a.returncode == 0, a.stdout[-6000:]
    assert "resumed at step" not in a.stdout

    b = _torchrun(tmp_path, *common, "--store", "storeB", "--loss-log", "B.jsonl", "--dump-final", "B.pt",
                  "--fail-at-step", "12", max_restarts=1)
    assert b.returncode == 0, b.stdout[-6000:]
    assert "exitcode: 17" in b.stdout, "rank 1 did not crash in the first attempt"
    assert "resumed at step 10 (epoch 1, attempt 1)" in b.stdout, b.stdout[-6000:]

    log_a, log_b = _log(tmp_path / "A.jsonl"), _log(tmp_path / "B.jsonl")
    assert [r["step"] for r in log_a] == list(range(1, STEPS + 1))
    # The first attempt logged steps 1..12, the second replays 11..20 after resuming from step 10.
    assert [r["step"] for r in log_b] == list(range(1, 13)) + list(range(11, STEPS + 1))
    ref = {r["step"]: r for r in log_a}
    assert [ref[s]["epoch"] for s in (8, 9, 16, 17)] == [0, 1, 1, 2]
    mismatches = [(r["step"], r["epoch"], float.fromhex(r["loss"]), float.fromhex(ref[r["step"]]["loss"]))
                  for r in log_b if (r["loss"], r["epoch"]) != (ref[r["step"]]["loss"], ref[r["step"]]["epoch"])]
    assert not mismatches, f"(step, epoch, loss B, loss A) differing: {mismatches}"
    last_b = {r["step"]: r["loss"] for r in log_b}  # last value per step
    assert last_b == {s: r["loss"] for s, r in ref.items()}

    final_a = torch.load(tmp_path / "A.pt", weights_only=True)
    final_b = torch.load(tmp_path / "B.pt", weights_only=True)
    assert set(final_a) == {"model", "optim"}
    assert assert_tree_equal(final_b, final_a) > 30
    assert int(final_b["optim"]["state"]["head.weight"]["step"]) == STEPS

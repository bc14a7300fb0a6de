"""The migration the project exists for: a job trains on 2 ranks, its store is copied to object storage
(`deltackpt copy`), and on a "new cluster" (a fresh directory, 3 ranks) the same example resumes from the
remote store with a bit-exact model and optimizer state. S3 is moto's server on 127.0.0.1; every process
reaches it through the standard AWS environment only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from deltackpt.store import Store
from dist import assert_tree_equal
from train_helpers import run_job, torchrun_example

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

def _run(cwd: Path, env: dict, cmd: list[str]) -> str:
    r = run_job(cmd, cwd, env)
    assert r.returncode == 0, r.stdout[-6000:]
    return r.stdout


def _torchrun(cwd, env, nproc: int, *args: str) -> str:
    r = torchrun_example(cwd, *args, nproc=nproc, env=env)
    assert r.returncode == 0, r.stdout[-6000:]
    return r.stdout


def test_train_on_2_ranks_copy_to_s3_resume_on_3_ranks_elsewhere(tmp_path, s3_server, s3_url):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env, HOME=str(tmp_path), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    site_a, site_b = tmp_path / "cluster-a", tmp_path / "cluster-b"
    site_a.mkdir()
    site_b.mkdir()
    _torchrun(site_a, env, 2, "--store", "ckpts", "--steps", "10", "--save-every", "5", "--dump-final", "final.pt")

    out = _run(site_a, env, [sys.executable, "-m", "deltackpt", "copy", "ckpts", s3_url, "--all", "--verify"])
    assert "copied 2 checkpoint(s)" in out, out
    local = Store.open(site_a / "ckpts")
    remote = Store.open(s3_url, storage_options=s3_server.storage_options)
    # What is sent is the store's physical bytes (less chunks that two ranks wrote twice), not the logical ones.
    assert 0.95 * local.usage().pack_bytes <= remote.usage().pack_bytes <= local.usage().pack_bytes

    out = _torchrun(site_b, env, 3, "--store", "ckpts", "--remote", s3_url, "--steps", "10", "--save-every", "5",
                    "--dump-final", "resumed.pt")
    assert "resumed at step 10" in out, out[-4000:]
    ref = torch.load(site_a / "final.pt", weights_only=False)
    got = torch.load(site_b / "resumed.pt", weights_only=False)
    assert assert_tree_equal(got, ref) > 10
    # The new cluster fetched only the newest checkpoint, not the history.
    assert [i.name for i in Store.open(site_b / "ckpts").list_checkpoints()] == ["step-00000010"]

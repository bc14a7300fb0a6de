"""Self-test of the multi-process harness in tests/dist.py."""

from __future__ import annotations

import time

import pytest

from dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _allreduce_rank(rank, world_size, base):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + base)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t.item(), "pg_rank": dist.get_rank(),
            "omp": __import__("os").environ.get("OMP_NUM_THREADS"), "tensor": torch.arange(3) * rank}


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from the harness self-test")
    return rank


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def _env_value(rank, world_size, name):
    import os

    return os.environ.get(name)


def test_results_come_back_by_rank():
    out = run_ranks(_allreduce_rank, 2, 10, timeout=60)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 and o["sum"] == 21.0 for o in out)
    assert [o["pg_rank"] for o in out] == [0, 1]
    assert all(o["omp"] == "1" for o in out)
    assert out[1]["tensor"].tolist() == [0, 1, 2]


def test_env_is_passed():
    assert run_ranks(_env_value, 1, "DELTACKPT_HARNESS_X", env={"DELTACKPT_HARNESS_X": "yes"}) == ["yes"]


def test_failing_rank_traceback_is_reraised():
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:
        run_ranks(_fail_on_rank_1, 2, timeout=60)
    msg = str(ei.value)
    assert "rank 1" in msg
    assert "ValueError: boom from the harness self-test" in msg
    assert "_fail_on_rank_1" in msg  # the traceback, not just the message
    assert "rank 0:" not in msg  # rank 0 succeeded
    assert time.monotonic() - t0 < 50


def test_hanging_rank_is_killed_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        run_ranks(_hang_on_rank_1, 2, timeout=8)
    elapsed = time.monotonic() - t0
    assert "[1]" in str(ei.value) and "hung" in str(ei.value)
    assert elapsed < 8 + 15, elapsed

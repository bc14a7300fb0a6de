"""Silent-data-corruption check: replicas of the same tensor must agree across ranks before a save commits."""

from __future__ import annotations

import pytest
import torch

from dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _replica_worker(rank, world, store_dir, perturb_rank, mode):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from deltackpt import DeltaSavePlanner, DeltaStorageWriter, SilentDataCorruptionError
    from deltackpt.store import Store

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sd = {"model": ddp.module.state_dict()}
    dcp.save(sd, storage_writer=DeltaStorageWriter(store_dir, "good"), planner=DeltaSavePlanner())
    if rank == perturb_rank:
        with torch.no_grad():
            model[1].weight[0, 0] += 1e-6  # a single flipped value in one replica
    writer = DeltaStorageWriter(store_dir, "bad", replica_check=mode)
    try:
        dcp.save({"model": ddp.module.state_dict()}, storage_writer=writer, planner=DeltaSavePlanner())
        outcome = "saved"
    except CheckpointException as e:
        errors = [err[0] if isinstance(err, tuple) else err for err in e.failures.values()]
        sdc = [err for err in errors if isinstance(err, SilentDataCorruptionError)]
        outcome = str(sdc[0]) if sdc else f"other: {errors}"
    names = [i.name for i in Store.open(store_dir).list_checkpoints()]
    return outcome, names


def test_perturbed_replica_is_detected_and_nothing_committed(tmp_path):
    results = run_ranks(_replica_worker, 2, str(tmp_path / "s"), 1, "raise", timeout=180)
    for outcome, names in results:
        assert "'model.1.weight'" in outcome and "ranks [0, 1] disagree with each other" in outcome, outcome
        assert names == ["good"]


def test_check_replicas_names_the_minority():
    from deltackpt import SilentDataCorruptionError
    from deltackpt.dcp.writer import check_replicas

    good = {"w@0,0": "aa", "b@0": "bb"}
    check_replicas([good, dict(good), dict(good)], "raise")
    with pytest.raises(SilentDataCorruptionError, match=r"'w'.*ranks \[1\] disagree with ranks \[0, 2\]"):
        check_replicas([good, {"w@0,0": "xx", "b@0": "bb"}, dict(good)], "raise")
    check_replicas([good, {"w@0,0": "xx", "b@0": "bb"}], "warn")  # logs, does not raise


def test_perturbed_replica_warn_mode_saves(tmp_path):
    results = run_ranks(_replica_worker, 2, str(tmp_path / "s"), 1, "warn", timeout=180)
    for outcome, names in results:
        assert outcome == "saved"
        assert names == ["good", "bad"]


def test_identical_replicas_pass(tmp_path):
    results = run_ranks(_replica_worker, 2, str(tmp_path / "s"), -1, "raise", timeout=180)
    for outcome, names in results:
        assert outcome == "saved" and names == ["good", "bad"]


def _digest_count_worker(rank, world, store_dir, mode):
    import deltackpt
    from deltackpt.dcp import planner as planner_mod

    calls = []
    real = planner_mod.xxhash.xxh3_128_hexdigest

    class Counting:  # the planner's xxhash, counting its digests
        @staticmethod
        def xxh3_128_hexdigest(data):
            calls.append(1)
            return real(data)

    planner_mod.xxhash = Counting
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16)).module
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1.0  # replicas differ: "off" must save anyway
    deltackpt.save({"model": model.state_dict()}, store_dir, f"c-{mode}", replica_check=mode)
    return len(calls)


@pytest.mark.parametrize("mode", ["off", "warn"])
def test_replica_check_off_hashes_no_replica(tmp_path, mode):
    counts = run_ranks(_digest_count_worker, 2, str(tmp_path / "s"), mode, timeout=180)
    assert (counts == [0, 0]) == (mode == "off"), counts

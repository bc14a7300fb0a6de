"""FSDP2 with a bf16 compute policy: the checkpoint holds the FP32 master weights and optimizer state (not
the bf16 compute copies), and a resume continues bit-exactly."""

from __future__ import annotations

import warnings

import pytest
import torch

from dist import assert_tree_equal, run_ranks
from train_helpers import dataset, full_state, make_model, make_optim, make_sched, shard, train_step

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _batch(rank, step):
    data = torch.stack(dataset(rank))
    return data[(4 * step) % 20:(4 * step) % 20 + 4]


def _build(world_size, seed):
    model = shard(make_model(seed), world_size, _policy())
    optim = make_optim(model)
    return model, optim, make_sched(optim)


def _train_save_continue(rank, world_size, path):
    from deltackpt import CheckpointManager, TrainState

    warnings.filterwarnings("ignore")
    model, optim, sched = _build(world_size, 0)
    torch.manual_seed(7 + rank)
    state = TrainState(model=model, optimizer=optim, scheduler=sched)
    with CheckpointManager(path, state, every_n_steps=2) as mgr:
        for step in (1, 2):
            loss = train_step(model, optim, sched, _batch(rank, step))
            assert loss.dtype == torch.bfloat16  # computed in bf16
            state.step = step
            mgr.maybe_save(step)
    saved = full_state(model, optim)
    later = [train_step(model, optim, sched, _batch(rank, s)) for s in (3, 4)]
    final = full_state(model, optim)

    # Resume into a differently initialized model and continue the same way.
    model2, optim2, sched2 = _build(world_size, 1)
    state2 = TrainState(model=model2, optimizer=optim2, scheduler=sched2)
    with CheckpointManager(path, state2) as mgr:
        assert mgr.restore_latest() == 2
    restored = full_state(model2, optim2)
    later2 = [train_step(model2, optim2, sched2, _batch(rank, s)) for s in (3, 4)]
    final2 = full_state(model2, optim2)
    for a, b in zip(later, later2):
        assert torch.equal(a, b), f"rank {rank}: loss {b} != {a} after resume"
    if rank == 0:
        assert all(v.dtype == torch.float32 for v in saved["model"].values())
        assert assert_tree_equal(restored, saved) >= 12
        assert assert_tree_equal(final2, final) >= 12
    return True


def test_bf16_policy_saves_fp32_and_resumes_bit_exact(tmp_path):
    from deltackpt import DeltaStorageReader
    from deltackpt.store import Store

    path = str(tmp_path / "store")
    Store.init(path)
    assert run_ranks(_train_save_continue, 2, path, timeout=240) == [True, True]

    name = "step-00000002"
    manifest = Store.open(path).read_manifest(name)
    model_items = [i for i in manifest.items if i.key.startswith("train.model.fc")]
    assert {i.key.split("@")[0] for i in model_items} == {f"train.model.fc{k}.{p}" for k in (1, 2, 3)
                                                          for p in ("weight", "bias")}
    assert len(model_items) == 12  # 6 tensors x 2 shards
    assert {i.dtype for i in model_items} == {"float32"}
    md = DeltaStorageReader(path, name).read_metadata().state_dict_metadata
    tensor_keys = [k for k in md if k.startswith("train.model.") and hasattr(md[k], "properties")]
    model_keys = [k for k in tensor_keys if not k.startswith("train.model.optim.")]
    optim_keys = [k for k in tensor_keys if k.startswith("train.model.optim.state.") and not k.endswith(".step")]
    assert len(model_keys) == 6 and len(optim_keys) == 12, (model_keys, optim_keys)
    assert {md[k].properties.dtype for k in model_keys + optim_keys} == {torch.float32}

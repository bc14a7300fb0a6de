"""BatchNorm's running stats are each rank's own under DDP (buffers are broadcast at the start of forward,
then updated from the local batch): a CheckpointManager save must not take them for corrupted replicas, while
a parameter that differs across ranks still stops the save."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _ddp_bn_save(rank, world_size, path, corrupt):
    import torch.distributed as dist

    from deltackpt import CheckpointManager, TrainState
    from deltackpt.errors import SilentDataCorruptionError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # each rank its own batch
    ddp(torch.randn(16, 4)).sum().backward()
    opt.step()
    mean = model[1].running_mean.clone()
    gathered = [torch.zeros_like(mean) for _ in range(world_size)]
    dist.all_gather(gathered, mean)
    assert not torch.equal(gathered[0], gathered[1])  # the premise: the ranks' stats differ
    if corrupt and rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0  # a flipped bit in one replica of a parameter
    state = TrainState(model=ddp, optimizer=opt)
    try:
        with CheckpointManager(path, state, every_n_steps=1) as mgr:
            mgr.save(1)
    except SilentDataCorruptionError as e:
        return str(e)
    import deltackpt

    deltackpt.save({"train": state}, path, "direct")  # a TrainState through the plain API: the same rule
    return "saved"


def test_buffers_differ_across_ranks_without_stopping_the_save(tmp_path):
    from deltackpt.store import Store

    assert run_ranks(_ddp_bn_save, 2, str(tmp_path / "ok"), False, timeout=240) == ["saved", "saved"]
    assert [i.name for i in Store.open(tmp_path / "ok").list_checkpoints()] == ["step-00000001", "direct"]
    out = run_ranks(_ddp_bn_save, 2, str(tmp_path / "bad"), True, timeout=240)
    assert all("0.weight" in o and "running" not in o for o in out), out


def test_buffer_keys_are_found_by_name_through_wrappers_and_never_name_a_parameter():
    from deltackpt import TrainState

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.bn = nn.BatchNorm1d(3)
            self.register_buffer("w_t", self.lin.weight.detach())  # shares the parameter's memory
            self.again = self.bn  # one module under two names: the state dict has both

    state = TrainState(model={"net": torch.compile(Net(), backend="eager")})  # keys without "_orig_mod."
    keys = state.buffer_keys()
    stats = {"running_mean", "running_var", "num_batches_tracked"}
    assert keys == {"net.w_t"} | {f"net.{m}.{s}" for m in ("bn", "again") for s in stats}
    assert set(state.state_dict()["net"]) >= {k.split(".", 1)[1] for k in keys}  # the keys the state dict has


def test_the_fallback_for_torch_without_get_fqns_names_buffers_as_torch_does():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import _get_fqns

    from deltackpt.train.state import _unwrapped_name

    class Holder(nn.Module):  # a user's attribute named like DDP's wrapped module: kept in the keys
        def __init__(self):
            super().__init__()
            self.module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
            self._orig_mod = nn.BatchNorm1d(2)

    models = [Holder(), torch.compile(Holder(), backend="eager"),
              nn.Sequential(checkpoint_wrapper(nn.BatchNorm1d(3)), nn.Linear(3, 3))]
    for model in models:
        names = [name for name, _ in model.named_buffers(remove_duplicate=False)]
        assert names and all(_unwrapped_name(model, n) == set(_get_fqns(model, n)) for n in names), names


def _bn_resume(rank, world_size, path, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from deltackpt import CheckpointManager, TrainState

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        model = (nn.parallel.DistributedDataParallel(net) if mode == "ddp"
                 else fully_shard(net, mesh=init_device_mesh("cpu", (world_size,))))
        return net, model, torch.optim.SGD(model.parameters(), lr=0.1)

    net, model, opt = build()
    torch.manual_seed(100 + rank)  # each rank its own batches: its own running stats
    with CheckpointManager(path, TrainState(model=model, optimizer=opt), every_n_steps=1) as mgr:
        for step in (1, 2):
            model(torch.randn(16, 4) + rank).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.maybe_save(step)
    saved = {k: v.clone() for k, v in net[1].named_buffers()}
    net, model, opt = build()
    with CheckpointManager(path, TrainState(model=model, optimizer=opt)) as mgr:
        assert mgr.restore_latest() == 2
    return all(torch.equal(saved[k], v) for k, v in net[1].named_buffers()), {k: v.tolist() for k, v in saved.items()}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_each_rank_resumes_with_its_own_running_stats(tmp_path, mode):
    # The checkpoint held one rank's copy under the model's keys: every rank resumed with it.
    results = run_ranks(_bn_resume, 2, str(tmp_path / "s"), mode, timeout=240)
    assert [ok for ok, _ in results] == [True, True]
    # On one process (2 -> 1), rank 0 gets its own too, not the copy DCP chose to write under the model's keys.
    from deltackpt import CheckpointManager, TrainState

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    state = TrainState(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with CheckpointManager(tmp_path / "s", state) as mgr:
        assert mgr.restore_latest() == 2
    assert {k: v.tolist() for k, v in net[1].named_buffers()} == results[0][1]


def test_non_persistent_buffers_are_no_state():
    from deltackpt import TrainState

    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    net[0].register_buffer("cache", torch.zeros(8), persistent=False)  # a RoPE table, a mask: rebuilt, not saved
    assert TrainState(model=net).buffer_keys() == {f"model.1.{s}" for s in
                                                   ("running_mean", "running_var", "num_batches_tracked")}

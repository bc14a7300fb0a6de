"""A fine-tune's checkpoints on top of a base model saved once: the base is saved on 1 process under its plain
names; the fine-tune wraps it (a ``model.`` prefix, LoRA modules that rename ``up.weight`` to
``up.base_layer.weight``), shards it with FSDP2 on 2 ranks (shard edges inside chunks) and trains only the
adapters. Its first checkpoint (and the next) must store next to nothing of the frozen base again, and load
back bit-exact."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from dist import assert_tree_equal, full_tree, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CHUNK = 65536
VOCAB = 300


class Net(nn.Module):
    """The base model: tensors of 2-520 KiB whose 2-rank shard edges fall inside 64 KiB chunks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 256)  # 300 KiB, split at 150 KiB
        self.up = nn.Linear(256, 520)
        self.norm = nn.LayerNorm(520)
        self.down = nn.Linear(520, 256)  # 520 KiB, split at 260 KiB
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.down(torch.relu(self.norm(self.up(h)))))


class LoRA(nn.Module):
    """PEFT's naming: the wrapped layer is ``base_layer``; ``lora_b`` starts at zero."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))


class FineTune(nn.Module):
    def __init__(self, base: Net):
        super().__init__()
        base.up, base.down = LoRA(base.up), LoRA(base.down)
        self.model = base

    def forward(self, x):
        return self.model(x)


def _base() -> Net:
    torch.manual_seed(0)
    return Net()


def _fine_tune(rank, world_size, path):
    import deltackpt
    from deltackpt.store import Store
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = FineTune(_base())
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    mesh = init_device_mesh("cpu", (world_size,))
    for mod in (model.model.up, model.model.down):
        fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    out = []
    for name in ("ft-1", "ft-2"):
        model(torch.randint(0, VOCAB, (4, 8), generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.save(state, storage_writer=deltackpt.DeltaStorageWriter(path, name), planner=deltackpt.DeltaSavePlanner())
        out.append((name, full_tree(state), Store.open(path).usage().physical_bytes))
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fine_tune_on_2_ranks_stores_little_of_a_base_saved_on_1(tmp_path):
    import deltackpt
    from deltackpt.store import Store

    path = str(tmp_path / "store")
    Store.init(path, chunk_size_bytes=CHUNK)
    base = _base()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": base.state_dict()}, storage_writer=deltackpt.DeltaStorageWriter(path, "base"))
    base_bytes = Store.open(path).usage().physical_bytes
    frozen_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    assert base_bytes > 0.8 * frozen_bytes  # random weights: the base really is stored

    saves = run_ranks(_fine_tune, 2, path, timeout=240)[0]
    trained = {k: v for k, v in saves[0][1]["model"].items() if "lora_" in k}
    adapter_bytes = sum(t.numel() * t.element_size() for t in trained.values()) * 3  # + exp_avg, exp_avg_sq
    added, prev = [], base_bytes
    for _name, _state, total in saves:
        added.append(total - prev)
        prev = total
    # Each checkpoint adds about its adapters and their optimizer state (plus its manifest), not the base.
    assert all(a < adapter_bytes + 0.02 * frozen_bytes for a in added), (added, adapter_bytes, frozen_bytes)

    for name, ref, _total in saves:  # loads on 1 process, bit-exact
        model = FineTune(Net())
        opt = torch.optim.AdamW([p for n, p in model.named_parameters() if "lora_" in n], lr=1e-2)
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.zeros_like(p)
        opt.step()  # the optimizer state exists, so DCP loads into it
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=deltackpt.DeltaStorageReader(path, name))
        assert assert_tree_equal(full_tree(state), ref) > 10

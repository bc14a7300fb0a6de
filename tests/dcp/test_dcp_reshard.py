"""Resharded loads: an FSDP2 checkpoint saved on 2 ranks loads on 1, 3 and 4 ranks bit-exact, and saving it
again unchanged on 3 ranks (shard boundaries no longer on chunk boundaries) stores almost nothing new."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dist import assert_tree_equal, full_tree, run_ranks, tree_nbytes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CHUNK = 65536
VOCAB = 300


class ReshardNet(nn.Module):
    """Tensors larger than a 64 KiB chunk (the 256-wide weights, 300-600 KiB) and smaller ones (biases,
    norms: 1-2 KiB); dims not divisible by 3 so 3-rank shards are uneven and start mid-chunk."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 256)  # 300 KiB
        self.up = nn.Linear(256, 512)  # 512 KiB + 2 KiB
        self.norm = nn.LayerNorm(512)
        self.down = nn.Linear(512, 256)  # 512 KiB + 1 KiB
        self.head = nn.Linear(256, 10)  # 10 KiB

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.down(torch.relu(self.norm(self.up(h)))))


def _shard(model, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for mod in (model.up, model.down):
        fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _new(seed):
    torch.manual_seed(seed)
    model = ReshardNet()
    return model


def _state(model, opt, options=None):
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": msd, "optim": osd}


def _load(model, opt, path, name):
    import deltackpt

    sd = _state(model, opt)
    dcp.load(sd, storage_reader=deltackpt.DeltaStorageReader(path, name))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _save_at_2(rank, world_size, path, ref_file):
    import deltackpt

    model = _shard(_new(seed=0), world_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randint(0, VOCAB, (4, 8), generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref = full_tree(_state(model, opt))
    dcp.save(_state(model, opt), storage_writer=deltackpt.DeltaStorageWriter(path, "saved-at-2"))
    if rank == 0:
        torch.save(ref, ref_file)
    return True


def _load_at_n(rank, world_size, path, ref_file, resave):
    import deltackpt

    warnings.filterwarnings("ignore")
    ref = torch.load(ref_file, weights_only=False)
    model = _shard(_new(seed=1000 + world_size), world_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(AssertionError):
        assert_tree_equal(full_tree(_state(model, opt))["model"], ref["model"])
    _load(model, opt, path, "saved-at-2")
    assert assert_tree_equal(full_tree(_state(model, opt)), ref) >= 30
    if resave:
        name = f"resaved-at-{world_size}"
        dcp.save(_state(model, opt), storage_writer=deltackpt.DeltaStorageWriter(path, name))
        # ... and that one loads back too.
        _load(model, opt, path, name)
        assert_tree_equal(full_tree(_state(model, opt)), ref)
    return True


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    """An FSDP2 model + Adam checkpoint saved on 2 ranks; the gathered full state is in ``ref_file``."""
    from deltackpt.store import Store

    tmp = tmp_path_factory.mktemp("reshard")
    path, ref_file = str(tmp / "store"), str(tmp / "ref.pt")
    Store.init(path, chunk_size_bytes=CHUNK)
    assert run_ranks(_save_at_2, 2, path, ref_file, timeout=150) == [True, True]
    ref = torch.load(ref_file, weights_only=False)
    assert tree_nbytes(ref) > 3 * 1024 * 1024
    return path, ref_file


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_reshard_2_to_1_plain_module(saved_at_2):
    import deltackpt

    path, ref_file = saved_at_2
    ref = torch.load(ref_file, weights_only=False)
    # 1 rank, no process group: a plain module, full state dicts.
    model = _new(seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _load(model, opt, path, "saved-at-2")
    assert assert_tree_equal(full_tree(_state(model, opt)), ref) >= 30
    assert deltackpt.load(_state(model, opt), path, "saved-at-2") == "saved-at-2"


def test_reshard_2_to_3_and_unchanged_resave_stores_little(saved_at_2):
    from deltackpt.store import Store

    path, ref_file = saved_at_2
    assert run_ranks(_load_at_n, 3, path, ref_file, True, timeout=180) == [True] * 3
    store = Store.open(path)
    stats = store.read_manifest("resaved-at-3").stats
    first = store.read_manifest("saved-at-2").stats
    assert stats.logical_bytes == first.logical_bytes, (stats, first)
    # 3-rank shards start mid-chunk; unchanged bytes must still not be stored again.
    assert stats.stored_bytes < 0.05 * stats.logical_bytes, stats


def test_reshard_2_to_4(saved_at_2):
    path, ref_file = saved_at_2
    assert run_ranks(_load_at_n, 4, path, ref_file, False, timeout=180) == [True] * 4

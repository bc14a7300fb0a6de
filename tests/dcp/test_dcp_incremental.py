"""Repeated DCP saves into one store: unchanged bytes are not stored again (single process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import deltackpt
from deltackpt.store import Store, codec
from dist import assert_tree_equal, full_tree, tree_nbytes

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CHUNK = 65536


class PartlyFrozen(nn.Module):
    """A big frozen embedding + encoder (several 64 KiB chunks each) under a small trainable head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(400, 128)  # 200 KiB
        self.encoder = nn.Linear(128, 256)  # 128 KiB + 1 KiB bias
        self.head = nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 64))  # ~66 KiB, trainable
        for mod in (self.emb, self.encoder):
            mod.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(self.emb(x))))


def _setup():
    torch.manual_seed(0)
    model = PartlyFrozen()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _train(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 400, (16, 4), generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(model, opt):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def test_repeated_saves_store_only_changes(tmp_path):
    path = tmp_path / "store"
    Store.init(path, chunk_size_bytes=CHUNK)
    model, opt = _setup()
    _train(model, opt, seed=1)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert frozen_bytes > 4 * CHUNK

    ref_a = full_tree(_state(model, opt))
    dcp.save(_state(model, opt), storage_writer=deltackpt.DeltaStorageWriter(path, "a"))
    # Same state again: (almost) nothing new.
    dcp.save(_state(model, opt), storage_writer=deltackpt.DeltaStorageWriter(path, "b"))
    store = Store.open(path)
    a, b = store.read_manifest("a"), store.read_manifest("b")
    assert a.stats.logical_bytes == b.stats.logical_bytes >= tree_nbytes(ref_a)
    assert a.stats.stored_bytes > 0.5 * frozen_bytes
    assert b.stats.stored_bytes < 0.01 * b.stats.logical_bytes, b.stats
    assert b.stats.new_chunks == 0, b.stats

    # One step: the trainable part and Adam's state change, the frozen params do not.
    _train(model, opt, seed=2)
    ref_c = full_tree(_state(model, opt))
    assert_tree_equal(ref_c["model"]["emb.weight"], ref_a["model"]["emb.weight"])
    dcp.save(_state(model, opt), storage_writer=deltackpt.DeltaStorageWriter(path, "c"))
    c = Store.open(path).read_manifest("c")
    assert c.stats.stored_bytes > 0
    assert c.stats.stored_bytes < c.stats.logical_bytes - frozen_bytes, (c.stats, frozen_bytes)

    # The frozen params' chunks in "c" are exactly the ones "a" stored.
    def frozen_chunk_ids(m):
        return {r.id for it in m.items if it.key.split("@")[0].endswith(("emb.weight", "encoder.weight",
                                                                           "encoder.bias")) for r in it.chunks}

    fa, fc = frozen_chunk_ids(a), frozen_chunk_ids(c)
    assert fa, f"no item for the frozen params among {[it.key for it in a.items]}"
    assert fa == fc

    # Every checkpoint still loads bit-exact.
    for name, ref in [("a", ref_a), ("b", ref_a), ("c", ref_c)]:
        m2, o2 = _setup()
        sd = _state(m2, o2)
        dcp.load(sd, storage_reader=deltackpt.DeltaStorageReader(path, name))
        set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        assert_tree_equal(full_tree(_state(m2, o2)), ref)


def test_single_process_dcp_keeps_keyframes_from_its_second_save(tmp_path, monkeypatch):
    """A one-off single-process dcp.save holds no extra memory; from the second save through the same Store
    on (a training loop) the keyframes are kept, so the next save's deltas read no bases back from the store."""
    from deltackpt.store import basecache, source

    monkeypatch.delenv("DELTACKPT_BASE_CACHE_BYTES", raising=False)
    store = Store.open_or_init(str(tmp_path / "s"))
    cache = store.base_cache
    deltackpt.save({"w": torch.randn(256, 256)}, store, "a")  # 256 KiB
    assert cache.cap_bytes == 0 and cache.size_bytes == 0
    w = torch.randn(256, 256)  # all new: keyframes
    deltackpt.save({"w": w}, store, "b")
    assert cache.cap_bytes == basecache.AUTO_CAP_BYTES
    ids = {r.id for it in store.read_manifest("b").items for r in it.chunks if it.key.startswith("w@")}
    assert ids and ids <= set(cache._data)
    fetched = []
    real_get = source.ChunkSource.get
    monkeypatch.setattr(source.ChunkSource, "get", lambda self, cid, **kw: fetched.append(cid) or
                        real_get(self, cid, **kw))
    w.add_(torch.randn_like(w) * 1e-6)
    deltackpt.save({"w": w}, store, "c")
    assert not fetched
    kinds = {store.index.lookup(r.id).codec for it in store.read_manifest("c").items for r in it.chunks
             if it.key.startswith("w@")}
    assert kinds and all(codec.is_delta(k) for k in kinds)

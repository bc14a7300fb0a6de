"""Train a small transformer with FSDP2 on CPU ranks and checkpoint it into a deltackpt store.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --store demo-store --steps 40 --save-every 10

Resumes from the newest checkpoint in the store when there is one.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from deltackpt import DeltaStorageReader, DeltaStorageWriter
from deltackpt.store import Store


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(step: int, rank: int, vocab: int = 512, size: int = 8, seq: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(0, vocab, (size, seq + 1), generator=g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="demo-store")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=10)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = 0
    if os.path.exists(os.path.join(args.store, "config")) and Store.open(args.store).list_checkpoints():
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "step": 0}
        reader = DeltaStorageReader(args.store, "latest")
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {reader.checkpoint_id} at step {start}")

    for step in range(start + 1, args.steps + 1):
        tokens = batch(step, rank)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % args.save_every == 0:
            msd, osd = get_state_dict(model, optim)
            writer = DeltaStorageWriter(args.store, f"step-{step}", metadata={"step": step})
            dcp.save({"model": msd, "optim": osd, "step": step}, storage_writer=writer)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, saved step-{step}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

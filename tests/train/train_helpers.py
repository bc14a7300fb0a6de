"""Shared pieces of the tests/train suite: a small model, data, and state-gathering helpers."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.nn as nn

IN, HID, OUT = 48, 64, 10


class MLP(nn.Module):
    """Linear layers 48 -> 64 -> 96 -> 10: dim-0 sizes 64/96/10 split unevenly over 3 ranks."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, 96)
        self.fc3 = nn.Linear(96, OUT)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def shard(model: nn.Module, world_size: int, mp_policy=None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    kw = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def dataset(rank: int, n: int = 20) -> list[torch.Tensor]:
    """Per-rank samples: IN features followed by a class label (as a float)."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, IN, generator=g)
    y = torch.randint(0, OUT, (n, 1), generator=g).float()
    return list(torch.cat([x, y], dim=1))


def make_loader(rank: int, batch_size: int = 4):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset(rank), batch_size=batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(77 + rank))


def train_step(model, optim, sched, batch: torch.Tensor) -> torch.Tensor:
    """One step with dropout-like randomness drawn from the global torch generator (so RNG state matters)."""
    x, y = batch[:, :IN], batch[:, IN].long()
    noise = torch.rand(x.shape) * 0.01
    loss = nn.functional.cross_entropy(model(x + noise), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    if sched is not None:
        sched.step()
    return loss.detach()


def make_optim(model, kind: str = "adamw"):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def make_sched(optim):
    return torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))


def full_state(model, optim) -> dict:
    """The full (unsharded) model + optimizer state on CPU. Collective for sharded models; only rank 0 (or
    the single process) gets the values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": _plain(msd), "optim": _plain(osd)}


def _plain(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_plain(v) for v in tree)
    return tree


def hash_tree(root: str | os.PathLike, exclude: tuple[str, ...] = ("cache",)) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> digest), skipping the top-level ``exclude`` dirs."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in exclude or not p.is_file():
            continue
        out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py"


def run_job(cmd: list[str], cwd, env: dict | None = None, timeout: float = 240):
    """Run ``cmd`` in its own session (a hung job, ranks and agent, is killed as a whole); fail the test on a
    timeout. Returns the CompletedProcess with stdout and stderr together in ``stdout``."""
    import signal
    import subprocess

    import pytest

    env = dict(env if env is not None else os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {timeout} s; output tail:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def torchrun_example(cwd, *args: str, nproc: int = 2, max_restarts: int = 0, env: dict | None = None,
                     timeout: float = 240):
    """``torchrun --standalone`` of examples/train_fsdp.py with ``args``."""
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), str(EXAMPLE), *args]
    return run_job(cmd, cwd, env, timeout)

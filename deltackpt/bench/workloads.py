"""Benchmark workloads: real (small) training runs with fixed seeds that yield checkpoints as DCP state dicts.

A workload's :meth:`Workload.checkpoints` trains and yields a :class:`Checkpoint` every ``interval`` steps;
its ``state`` is ``{"model": ..., "optim": ...}`` as ``get_state_dict(model, optimizers)`` returns it and
aliases the live training state, so a consumer must save (or copy) it before asking for the next one.
``Workload.info`` collects what the report needs about the run (parameter counts, losses, and per workload:
the ideal adapter-only size for ``frozen``, the touched-row fractions for ``sparse``).

A workload may also have a *base* (:meth:`Workload.base_state`): a state dict each system saves first, as
checkpoint ``base``, before the workload's checkpoints (``frozen-base``: the pretrained model the LoRA
fine-tune starts from, under its plain un-wrapped names); its stored bytes are then reported apart.

Sizes: ``tiny`` (unit tests, seconds), ``quick`` (``deltackpt bench --quick``), ``full`` (``make bench``).
The ``reshard`` workload runs on several processes; it lives in :mod:`deltackpt.bench.reshard`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

from .models import ClickData, MarkovTokens, RecModel, gpt_from, lm_loss

GPT_SIZES = {
    "tiny": {"vocab": 256, "dim": 32, "layers": 1, "heads": 2, "seq": 16, "batch": 2},
    "quick": {"vocab": 2048, "dim": 128, "layers": 4, "heads": 4, "seq": 64, "batch": 4},
    "full": {"vocab": 8192, "dim": 384, "layers": 8, "heads": 6, "seq": 64, "batch": 4},
}
REC_SIZES = {
    "tiny": {"rows": 8192, "dim": 8, "fields": 4, "batch": 4, "hidden": 32},
    "quick": {"rows": 200_000, "dim": 16, "fields": 8, "batch": 64, "hidden": 128},
    "full": {"rows": 1_000_000, "dim": 16, "fields": 8, "batch": 256, "hidden": 256},
}


def workload_config(name: str, size: str, num_checkpoints: int | None = None) -> dict:
    """The configuration of workload ``name`` at ``size`` (tiny, quick, full); ``num_checkpoints`` replaces
    the size's count (4 tiny, else 10)."""
    n_ckpt = num_checkpoints or {"tiny": 4, "quick": 10, "full": 10}[size]
    every = {"tiny": 2, "quick": 10, "full": 10}[size]
    gpt = dict(GPT_SIZES[size])
    if name == "dense":
        return {"model": gpt, "lr": 1e-3, "num_checkpoints": n_ckpt, "interval": every, "seed": 0}
    if name == "dense100":
        return {"model": gpt, "lr": 1e-3, "num_checkpoints": n_ckpt, "interval": 10 * every, "seed": 0}
    if name in ("frozen", "frozen-base"):
        return {"model": gpt, "lr": 1e-3, "lora_rank": {"tiny": 2, "quick": 4, "full": 8}[size],
                "num_checkpoints": n_ckpt, "interval": every, "seed": 1, "base_first": name == "frozen-base"}
    if name == "sparse":
        return {"model": dict(REC_SIZES[size]), "lr": 1e-3, "num_checkpoints": n_ckpt, "interval": every,
                "seed": 2, "max_touched_fraction": 0.03}
    if name == "bf16":
        return {"model": gpt, "lr": 1e-5, "num_checkpoints": n_ckpt, "interval": every, "seed": 3}
    if name == "reshard":
        small = dict(GPT_SIZES["tiny" if size == "tiny" else "quick"])
        if size == "full":
            small.update(dim=256, layers=6, heads=4)
        return {"model": small, "lr": 1e-3, "ranks_before": 2, "ranks_after": 3,
                "checkpoints_before": max(2, n_ckpt // 2), "checkpoints_after": max(2, n_ckpt // 2),
                "interval": every, "seed": 4}
    raise ValueError(f"unknown workload {name!r}")


@dataclasses.dataclass
class Checkpoint:
    name: str
    step: int
    state: dict
    info: dict


def tensor_nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_nbytes(v) for v in obj)
    return 0


class Workload:
    """Base: ``checkpoints()`` trains and yields; ``info`` describes the run; ``dtype`` is the dominant one."""

    name = ""
    dtype = "float32"
    distributed = False

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.info: dict[str, Any] = {"config": cfg, "losses": []}

    def checkpoints(self) -> Iterator[Checkpoint]:
        raise NotImplementedError

    def base_state(self) -> dict | None:
        """The state dict to save as checkpoint ``base`` before the first checkpoint, or None."""
        return None

    def _snapshot(self, step: int, model, optims, loss: float) -> Checkpoint:
        msd, osd = get_state_dict(model, optims)
        state = {"model": msd, "optim": osd}
        self.info["losses"].append(round(loss, 5))
        self.info.setdefault("state_bytes", tensor_nbytes(state))
        return Checkpoint(f"step-{step:06d}", step, state, {"loss": loss})


class DenseLM(Workload):
    """GPT-style LM, fp32 params + AdamW state (10-step linear warmup), every parameter trained, on a
    Zipf-skewed Markov token stream."""

    name = "dense"

    def _build(self):
        torch.manual_seed(self.cfg["seed"])
        return gpt_from(self.cfg["model"], self.cfg.get("lora_rank", 0))

    def _trainable(self, model):
        return list(model.parameters())

    def checkpoints(self) -> Iterator[Checkpoint]:
        cfg, mc = self.cfg, self.cfg["model"]
        model = self._build()
        params = self._trainable(model)
        opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.01)
        warmup = cfg.get("warmup_steps", 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        data = MarkovTokens(mc["vocab"], cfg["seed"] + 100, zipf=1.0)
        total = sum(p.numel() for p in model.parameters())
        self.info.update(num_params=total, trainable_params=sum(p.numel() for p in params))
        for step in range(1, cfg["num_checkpoints"] * cfg["interval"] + 1):
            x, y = data.batch(mc["batch"], mc["seq"])
            loss = lm_loss(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % cfg["interval"] == 0:
                opt.zero_grad(set_to_none=True)
                yield self._snapshot(step, model, opt, loss.item())


class FrozenLoRA(DenseLM):
    """The same LM with its base weights frozen and LoRA adapters on every linear layer trained."""

    name = "frozen"

    def _trainable(self, model):
        params = []
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
            if p.requires_grad:
                params.append(p)
        total = sum(p.numel() for p in model.parameters())
        frozen = 1 - sum(p.numel() for p in params) / total
        assert frozen >= 0.9, f"only {frozen:.1%} of the parameters are frozen"
        self.info["frozen_fraction"] = round(frozen, 5)
        return params

    def base_state(self) -> dict | None:
        """With ``base_first``: the pretrained weights the run starts from (and keeps frozen), without adapters
        and under the plain model's names (``blocks.0.qkv.weight``, not ``blocks.0.qkv.base.weight``)."""
        if not self.cfg.get("base_first"):
            return None
        model = self._build()
        return {"model": {k.replace(".base.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}}

    def _snapshot(self, step, model, optims, loss):
        ck = super()._snapshot(step, model, optims, loss)
        if "adapter_only_bytes_per_checkpoint" not in self.info:
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            params = sum(tensor_nbytes(v) for k, v in ck.state["model"].items() if k in trainable)
            self.info["adapter_only_bytes_per_checkpoint"] = params + tensor_nbytes(ck.state["optim"]["state"])
        return ck


class SparseRec(Workload):
    """Recommendation model: a large sparse embedding table (SparseAdam) plus small dense MLPs (Adam)."""

    name = "sparse"

    def checkpoints(self) -> Iterator[Checkpoint]:
        cfg, mc = self.cfg, self.cfg["model"]
        torch.manual_seed(cfg["seed"])
        model = RecModel(mc["rows"], mc["dim"], mc["fields"], hidden=mc["hidden"])
        sparse_opt = torch.optim.SparseAdam([model.emb.weight], lr=cfg["lr"])
        dense_opt = torch.optim.Adam([p for n, p in model.named_parameters() if n != "emb.weight"], lr=cfg["lr"])
        data = ClickData(mc["rows"], mc["fields"], cfg["seed"] + 100)
        self.info.update(num_params=sum(p.numel() for p in model.parameters()), embedding_rows=mc["rows"],
                         touched_ids_fraction=[], changed_rows_fraction=[])
        prev = model.emb.weight.detach().clone()
        seen: list[torch.Tensor] = []
        for step in range(1, cfg["num_checkpoints"] * cfg["interval"] + 1):
            ids, dense, labels = data.batch(mc["batch"])
            seen.append(ids.flatten())
            loss = F.binary_cross_entropy_with_logits(model(ids, dense), labels)
            sparse_opt.zero_grad(set_to_none=True)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            if step % cfg["interval"] == 0:
                # Verify: rows whose weights changed since the last checkpoint vs ids looked up.
                w = model.emb.weight.detach()
                changed = int((w != prev).any(dim=1).sum())
                touched = int(torch.unique(torch.cat(seen)).numel())
                self.info["touched_ids_fraction"].append(round(touched / mc["rows"], 6))
                self.info["changed_rows_fraction"].append(round(changed / mc["rows"], 6))
                prev.copy_(w)
                seen.clear()
                yield self._snapshot(step, model, [sparse_opt, dense_opt], loss.item())
        fr = self.info["touched_ids_fraction"]
        self.info["max_touched_fraction"] = max(fr) if fr else 0.0
        self.info["touched_fraction_ok"] = bool(fr) and max(fr) <= cfg["max_touched_fraction"]


class Bf16FineTune(DenseLM):
    """The LM in bf16 (weights and AdamW state), fine-tuned at lr 1e-5: most weights do not move at all."""

    name = "bf16"
    dtype = "bfloat16"

    def _build(self):
        return super()._build().to(torch.bfloat16)

    def _snapshot(self, step, model, optims, loss):
        ck = super()._snapshot(step, model, optims, loss)
        # Fraction of weights whose bf16 value changed since the previous checkpoint.
        cur = {k: v.detach().clone() for k, v in ck.state["model"].items()}
        prev = getattr(self, "_prev", None)
        if prev is not None:
            changed = sum(int((cur[k] != prev[k]).sum()) for k in cur)
            total = sum(v.numel() for v in cur.values())
            self.info.setdefault("changed_weights_fraction", []).append(round(changed / total, 6))
        self._prev = cur
        return ck


WORKLOADS = {"dense": DenseLM, "dense100": DenseLM, "frozen": FrozenLoRA, "frozen-base": FrozenLoRA,
             "sparse": SparseRec, "bf16": Bf16FineTune, "reshard": None}
QUICK_WORKLOADS = ("dense", "frozen", "sparse")
FULL_WORKLOADS = ("dense", "dense100", "frozen", "sparse", "bf16", "reshard")


def make_workload(name: str, size: str, num_checkpoints: int | None = None) -> Workload:
    cls = WORKLOADS.get(name)
    if cls is None:
        raise ValueError(f"no single-process workload {name!r}")
    wl = cls(workload_config(name, size, num_checkpoints))
    wl.name = name
    return wl

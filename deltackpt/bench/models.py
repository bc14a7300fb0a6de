"""The models and data the benchmark workloads train: a GPT-style language model (optionally with LoRA
adapters) on a seeded Markov-chain token stream, and a DLRM-style recommendation model on seeded
power-law categorical features. Everything is deterministic given the seeds.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with a frozen-able base and a low-rank trainable update (B starts at 0)."""

    def __init__(self, fin: int, fout: int, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = nn.Linear(fin, fout)
        self.lora_a = nn.Parameter(torch.randn(rank, fin) / math.sqrt(fin))
        self.lora_b = nn.Parameter(torch.zeros(fout, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def _linear(fin: int, fout: int, lora_rank: int) -> nn.Module:
    return LoRALinear(fin, fout, lora_rank) if lora_rank else nn.Linear(fin, fout)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, lora_rank: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = _linear(dim, 3 * dim, lora_rank)
        self.proj = _linear(dim, dim, lora_rank)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = _linear(dim, 4 * dim, lora_rank)
        self.out = _linear(4 * dim, dim, lora_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, pre-norm blocks, untied LM head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, lora_rank: int = 0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, lora_rank) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():
            if "lora" in name:
                continue
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt_from(cfg: dict, lora_rank: int = 0) -> GPT:
    return GPT(cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["seq"], lora_rank)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


class MarkovTokens:
    """A seeded token stream: each token has ``branch`` possible successors, so a model can learn it.

    With ``zipf`` > 0 the successors are drawn from a Zipf(``zipf``) distribution over the vocabulary, so
    token frequencies are skewed as in text and a model's loss drops within a few dozen steps.
    """

    def __init__(self, vocab: int, seed: int, branch: int = 4, zipf: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.branch = vocab, branch
        if zipf > 0:
            weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-zipf)
            self.succ = torch.multinomial(weights, vocab * branch, replacement=True, generator=g).view(vocab, branch)
        else:
            self.succ = torch.randint(vocab, (vocab, branch), generator=g)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        cur = torch.randint(self.vocab, (batch,), generator=self.gen)
        picks = torch.randint(self.branch, (batch, seq), generator=self.gen)
        out = [cur]
        for i in range(seq):
            cur = self.succ[cur, picks[:, i]]
            out.append(cur)
        toks = torch.stack(out, 1)
        return toks[:, :-1], toks[:, 1:]


# -- recommendation ----------------------------------------------------------------------------------------
def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class RecModel(nn.Module):
    """DLRM-style: one large embedding table shared by ``fields`` hashed categorical features (sparse
    gradients), a bottom MLP for dense features, a top MLP over the concatenation."""

    def __init__(self, rows: int, dim: int, fields: int, dense_in: int = 13, hidden: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=True)
        nn.init.normal_(self.emb.weight, std=0.05)
        self.bottom = _mlp([dense_in, hidden, dim])
        self.top = _mlp([(fields + 1) * dim, hidden, hidden // 2, 1])

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids).flatten(1)
        return self.top(torch.cat([e, self.bottom(dense)], 1)).squeeze(1)


class ClickData:
    """Seeded click logs: per field a power-law id (few ids are popular), hashed onto the shared table's rows
    (so popular rows are spread over the whole table, as with real hashed features); labels from a hidden
    per-row score plus a dense term."""

    PRIME = 2_654_435_761

    def __init__(self, rows: int, fields: int, seed: int, skew: float = 3.0, dense_in: int = 13) -> None:
        self.rows, self.fields, self.skew, self.dense_in = rows, fields, skew, dense_in
        self.gen = torch.Generator().manual_seed(seed)
        self.w_dense = torch.randn(dense_in, generator=torch.Generator().manual_seed(seed + 1))

    def batch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u = torch.rand(batch, self.fields, generator=self.gen, dtype=torch.float64)
        raw = (u.pow(self.skew) * self.rows).long()
        field = torch.arange(self.fields).unsqueeze(0)
        ids = (raw * self.PRIME + field * 1_000_003) % self.rows
        dense = torch.randn(batch, self.dense_in, generator=self.gen)
        score = ((ids * 40503) % 1000).float().div(1000).sub(0.5).sum(1) + dense @ self.w_dense * 0.3
        labels = (torch.rand(batch, generator=self.gen) < torch.sigmoid(score)).float()
        return ids, dense, labels

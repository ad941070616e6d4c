"""The model `meshplan calibrate` trains for a few steps to measure compute in a run.

A small pre-LayerNorm transformer of its own shape (no example model uses it), so
that the in-run factor it yields (planner/app/calibrate_run.py) is not fitted to any
model it is later checked on. Only torch is imported: the generated rank scripts
load this file by path.

Shapes: idx (B, T) int64 -> logits (B, T, VOCAB) float32, T = SEQ.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 384, 48, 96, 3, 3


class _Block(nn.Module):
    def __init__(self, c: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.act, self.out = nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C); q, k, v: (B, H, T, C / H)
        qkv = self.qkv(self.ln1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class ProbeTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(_Block(HIDDEN, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build() -> ProbeTransformer:
    """The factory its model ref names (planner/app/probe_model.py:build)."""
    return ProbeTransformer()


def example_inputs(batch_size: int = 2, device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
    """Forward's inputs for capture: (idx,), idx (batch_size, SEQ) int64."""
    if torch.device(device).type == "meta":
        return (torch.empty(batch_size, SEQ, dtype=torch.long, device="meta"),)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(0)).to(device),)


def example_batch(batch_size: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((idx,), next-token targets), both (batch_size, SEQ) int64, a pure function of `seed`."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return (seq[:, :-1].contiguous(),), seq[:, 1:].contiguous()

"""The smallest complete model file: what meshplan needs from a model, by example.

    meshplan optimize examples/models/minimal.py:build --cluster local --devices 2 --batch 8 -o plan.json
    meshplan codegen examples/models/minimal.py:build --plan plan.json -o build
    meshplan run build --steps 3 --verify

A model file defines three functions. Every `--arg KEY=VALUE` of the command line reaches all
three as a keyword argument, so each takes the model's keywords (here vocab, width, heads, layers,
seq_len, dropout), even those it does not use.

build(**kwargs) -> torch.nn.Module
    The model. meshplan calls it under `with torch.device("meta"):` to capture it (so create
    tensors without naming a device: they land on meta there, costing nothing), and on the CPU
    after torch.manual_seed(seed) in every rank and in the single-process reference (so the
    weights are a function of the seed).
example_inputs(batch_size, device, **kwargs)
    forward()'s inputs for `batch_size` samples on `device` ("meta" when capturing): one tensor, a
    tuple of positional tensors, or a dict of keyword tensors, samples on dim 0. Only shapes and
    dtypes matter.
example_batch(batch_size, seed, **kwargs) -> (inputs, targets)
    One training batch on the CPU, a pure function of `seed` (step s reads seed data_seed + s;
    --data-ref names another function of this form, --dataset a torch Dataset instead): inputs in
    example_inputs' form, targets for the loss (cross_entropy: class ids, (B,) for logits (B, C)
    or (B, T) for logits (B, T, C)).

The model is torch's own nn.TransformerEncoder between an embedding and a linear head, predicting
the next token of sequences that count up modulo the vocabulary. Its dropout is 0 by default:
with dropout every rank draws its own masks, and `meshplan run --verify` then says that no
sample-exact check applies (exit status 3) instead of comparing.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyTransformer(nn.Module):
    """tokens (B, T) int64 -> logits (B, T, vocab)."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def build(vocab=64, width=32, heads=4, layers=2, seq_len=16, dropout=0.0):
    return TinyTransformer(vocab, width, heads, layers, dropout)


def example_inputs(batch_size=2, device="cpu", vocab=64, width=32, heads=4, layers=2, seq_len=16, dropout=0.0):
    return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)


def example_batch(batch_size, seed, vocab=64, width=32, heads=4, layers=2, seq_len=16, dropout=0.0):
    g = torch.Generator().manual_seed(seed)
    seq = (torch.randint(0, vocab, (batch_size, 1), generator=g) + torch.arange(seq_len + 1)) % vocab
    return (seq[:, :-1],), seq[:, 1:]          # (inputs,), targets: each position's next token

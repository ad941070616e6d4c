"""A nanoGPT-style decoder-only transformer.

Token + learned position embeddings, ``num_layers`` pre-LayerNorm blocks held in
``self.blocks`` (an ``nn.ModuleList``, so module paths read ``blocks.3.attn.qkv``), a final
LayerNorm and an un-tied ``lm_head``. The input and output embeddings are deliberately
*not* tied, so no parameter is shared between layers and pipeline cuts never have to
synchronise a shared weight.

Shapes: idx (B, T) int64 token ids with T <= seq_len -> logits (B, T, vocab_size) float.
Letters: B batch, T tokens, C = hidden channels, H heads, D = C / H channels per head.

The forward is written for ``torch.fx.symbolic_trace``: no Python branch looks at a
traced value; head counts and widths are fixed when the module is built, and the only
runtime size used (T) flows through traced ``size``/``arange`` calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of the decoder.

    Attributes:
        vocab_size: number of token ids (tokens).
        seq_len: longest sequence the position embedding covers (tokens).
        hidden: model width C (channels per token).
        num_layers: number of transformer blocks.
        num_heads: attention heads per block; must divide ``hidden``.
        mlp_ratio: MLP inner width as a multiple of ``hidden``.
        dropout: dropout probability (embeddings, attention, residual branches).
        bias: whether Linear and LayerNorm layers carry a bias.
    """

    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "hidden", "num_layers", "num_heads",
                     "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden % self.num_heads != 0:
            raise ValueError(
                f"GPTConfig: hidden={self.hidden} is not divisible by "
                f"num_heads={self.num_heads}; choose hidden as a multiple of num_heads")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        """Channels per attention head (D = hidden / num_heads)."""
        return self.hidden // self.num_heads


# Named sizes. "tiny" and "small" are for tests and examples; the large ones are only
# meant to be built on the meta device (for planning), e.g.
#   with torch.device("meta"): model = build(preset="1t")
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=128, seq_len=16, hidden=32, num_layers=2, num_heads=4),
    "small": dict(vocab_size=512, seq_len=64, hidden=128, num_layers=4, num_heads=4),
    "gpt3-175b": dict(vocab_size=51200, seq_len=2048, hidden=12288, num_layers=96,
                      num_heads=96),
    "megatron-530b": dict(vocab_size=51200, seq_len=2048, hidden=20480, num_layers=105,
                          num_heads=128),
    "1t": dict(vocab_size=51200, seq_len=2048, hidden=25600, num_layers=128,
               num_heads=160),
}

_FIELDS = tuple(f.name for f in dataclasses.fields(GPTConfig))


def make_config(preset: str | None = None, **overrides) -> GPTConfig:
    """GPTConfig from a preset (default "tiny") with explicit fields overriding it.

    Overrides whose value is None are ignored, so callers can pass optional arguments
    straight through.
    """
    name = "tiny" if preset is None else preset
    if name not in PRESETS:
        raise ValueError(f"gpt: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise ValueError(f"gpt: unknown config field(s) {unknown}; valid fields are "
                         f"{list(_FIELDS)}")
    fields = dict(PRESETS[name])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return GPTConfig(**fields)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection.

    ``qkv`` (C -> 3C) is the column-parallel Linear and ``proj`` (C -> C) the
    row-parallel one in the Megatron pattern; heads are independent in between.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C)
        qkv = self.qkv(x)                                              # (B, T, 3C)
        qkv = qkv.unflatten(-1, (3, self.num_heads, self.head_dim))    # (B, T, 3, H, D)
        qkv = qkv.permute(2, 0, 3, 1, 4)                               # (3, B, H, T, D)
        q, k, v = qkv[0], qkv[1], qkv[2]                               # each (B, H, T, D)
        # self.training is a plain Python bool (not traced), so this is fx-safe.
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).flatten(2)                               # (B, T, C)
        return self.resid_drop(self.proj(y))                           # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward: Linear C -> rC, GELU, Linear rC -> C."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        inner = cfg.mlp_ratio * cfg.hidden
        self.fc = nn.Linear(cfg.hidden, inner, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(inner, cfg.hidden, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C) -> (B, T, rC) -> (B, T, C)
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C) throughout
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Decoder-only language model: idx (B, T) int64 -> logits (B, T, vocab_size)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)    # token embedding
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)       # learned position embedding
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        # Not tied to wte on purpose (see module docstring).
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # idx: (B, T) int64, T <= seq_len (larger T fails inside the position embedding)
        pos = torch.arange(idx.size(1), device=idx.device)     # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))           # (B, T, C)
        for block in self.blocks:
            x = block(x)                                       # (B, T, C)
        x = self.ln_f(x)                                       # (B, T, C)
        return self.lm_head(x)                                 # (B, T, V)


def num_params(cfg: GPTConfig) -> int:
    """Closed-form parameter count of ``GPT(cfg)`` (no weight sharing).

    Per block about 12 * C^2 for mlp_ratio 4 (qkv 3C^2, proj C^2, MLP 2 * 4C^2), plus
    biases and LayerNorms; plus (V + seq_len) * C embeddings and the V * C lm_head.
    """
    c, r, b = cfg.hidden, cfg.mlp_ratio, int(cfg.bias)
    ln = c * (1 + b)                                  # weight (+ bias)
    attn = (c * 3 * c + b * 3 * c) + (c * c + b * c)  # qkv + proj
    mlp = (c * r * c + b * r * c) + (r * c * c + b * c)
    per_block = 2 * ln + attn + mlp
    embeddings = cfg.vocab_size * c + cfg.seq_len * c
    return embeddings + cfg.num_layers * per_block + ln + c * cfg.vocab_size


def build(preset: str | None = None, *, vocab_size: int | None = None,
          seq_len: int | None = None, hidden: int | None = None,
          num_layers: int | None = None, num_heads: int | None = None,
          mlp_ratio: int | None = None, dropout: float | None = None,
          bias: bool | None = None) -> GPT:
    """Factory used by model refs such as ``examples/models/gpt.py:build``.

    ``preset`` is one of ``PRESETS`` ("tiny" when None); explicit keyword arguments
    override the preset's fields.
    """
    cfg = make_config(preset, vocab_size=vocab_size, seq_len=seq_len, hidden=hidden,
                      num_layers=num_layers, num_heads=num_heads, mlp_ratio=mlp_ratio,
                      dropout=dropout, bias=bias)
    return GPT(cfg)


def example_inputs(batch_size: int = 2, device: str | torch.device = "cpu",
                   preset: str | None = None, **overrides) -> tuple[torch.Tensor, ...]:
    """Forward's positional inputs: ``(idx,)``, idx (batch_size, seq_len) int64.

    Deterministic (fixed seed); on the meta device only the shape is produced.
    """
    cfg = make_config(preset, **overrides)
    if torch.device(device).type == "meta":
        return (torch.empty(batch_size, cfg.seq_len, dtype=torch.long, device="meta"),)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
    return (idx.to(device),)


def example_batch(batch_size: int, seed: int, preset: str | None = None, **overrides
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Synthetic language-modelling batch on the CPU, a pure function of ``seed``.

    Each row is an arithmetic progression of token ids modulo vocab_size (random start
    and step per row), so the next token is predictable from the previous two and the
    loss can actually fall. Returns ``((idx,), targets)`` with idx and targets both
    (B, T) int64, targets = idx shifted left by one token (next-token ids).
    """
    cfg = make_config(preset, **overrides)
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=g)   # (B, 1)
    step = torch.randint(1, max(cfg.vocab_size, 2), (batch_size, 1), generator=g)
    t = torch.arange(cfg.seq_len + 1).unsqueeze(0)                           # (1, T+1)
    seq = (start + step * t) % cfg.vocab_size                                # (B, T+1)
    return (seq[:, :-1].contiguous(),), seq[:, 1:].contiguous()

"""A nanoGPT-style decoder-only transformer.

Token + learned position embeddings, ``num_layers`` pre-LayerNorm blocks held in
``self.blocks`` (an ``nn.ModuleList``, so module paths read ``blocks.3.attn.qkv``), a final
LayerNorm and an un-tied ``lm_head``. By default the input and output embeddings are *not*
tied, so no parameter is shared between layers and pipeline cuts never have to synchronise
a shared weight.

Config fields let the same GPT stand for the published models whose differences matter to
the cost (presets "bloom-176b", "opt-175b", "megascale-175b", "llama-70b"): the vocabulary,
tied embeddings (BLOOM), the MLP's activation (ReLU for OPT, SwiGLU with its own inner width
for Llama), grouped-query attention (fewer key/value heads, Llama) and no learned position
table. ``positions="none"`` stands for ALiBi (BLOOM) and RoPE (Llama): neither has a
parameter, ALiBi adds one bias to the (T x T) scores and RoPE rotates q and k, elementwise
work that is small beside the block's GEMMs, so leaving them out changes the cost little;
keeping a learned table instead would add seq_len x hidden parameters that the models do
not have (1.07e9 for Llama at 128K tokens).

Shapes: idx (B, T) int64 token ids with T <= seq_len -> logits (B, T, vocab_size) float.
Letters: B batch, T tokens, C = hidden channels, H heads, D = C / H channels per head.

The forward is written for ``torch.fx.symbolic_trace``: no Python branch looks at a
traced value; head counts and widths are fixed when the module is built, and the only
runtime size used (T) flows through traced ``size``/``arange`` calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import nn
from torch.nn import functional as F


class Activation(StrEnum):
    """The MLP's nonlinearity."""

    GELU = "gelu"        # GPT-2/3, Megatron, BLOOM
    RELU = "relu"        # OPT (arXiv 2205.01068, section 2.1)
    SWIGLU = "swiglu"    # Llama: proj(silu(gate(x)) * fc(x)), three matrices


class Positions(StrEnum):
    """How token positions reach the model."""

    LEARNED = "learned"  # a learned (seq_len, hidden) table added to the token embedding
    NONE = "none"        # no table: stands for ALiBi / RoPE (see the module docstring)


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
        activation: the MLP's nonlinearity, an Activation value ("gelu", "relu", "swiglu").
        mlp_hidden: MLP inner width (channels); None means ``mlp_ratio * hidden``.
        num_kv_heads: key/value heads (grouped-query attention); must divide ``num_heads``;
            None means ``num_heads`` (plain multi-head attention, one fused qkv Linear).
        tie_embeddings: the output layer reuses the token embedding's (V, C) weight.
        positions: a Positions value; "none" leaves out the learned position table.
    """

    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    activation: str = Activation.GELU
    mlp_hidden: int | None = None
    num_kv_heads: int | None = None
    tie_embeddings: bool = False
    positions: str = Positions.LEARNED

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
        for name, vocabulary in (("activation", Activation), ("positions", Positions)):
            value = getattr(self, name)
            if value not in set(vocabulary):
                raise ValueError(f"GPTConfig.{name}={value!r} is not one of {', '.join(vocabulary)}")
            object.__setattr__(self, name, vocabulary(value).value)   # a plain string in reprs
        for name in ("mlp_hidden", "num_kv_heads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"GPTConfig.{name} must be a positive integer or None, got {value!r}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"GPTConfig: num_kv_heads={self.num_kv_heads} does not divide "
                             f"num_heads={self.num_heads}; choose a divisor of num_heads")

    @property
    def head_dim(self) -> int:
        """Channels per attention head (D = hidden / num_heads)."""
        return self.hidden // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_heads unless grouped-query attention)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def inner(self) -> int:
        """MLP inner width (channels)."""
        return self.mlp_ratio * self.hidden if self.mlp_hidden is None else self.mlp_hidden


# Named sizes. "tiny" and "small" are for tests and examples; the large ones are only
# meant to be built on the meta device (for planning), e.g.
#   with torch.device("meta"): model = build(preset="1t")
PRESETS: dict[str, dict[str, int | str | bool]] = {
    "tiny": dict(vocab_size=128, seq_len=16, hidden=32, num_layers=2, num_heads=4),
    "small": dict(vocab_size=512, seq_len=64, hidden=128, num_layers=4, num_heads=4),
    "gpt3-175b": dict(vocab_size=51200, seq_len=2048, hidden=12288, num_layers=96,
                      num_heads=96),
    "megatron-530b": dict(vocab_size=51200, seq_len=2048, hidden=20480, num_layers=105,
                          num_heads=128),
    "1t": dict(vocab_size=51200, seq_len=2048, hidden=25600, num_layers=128,
               num_heads=160),
    # BLOOM-176B: bigscience tr11-176B-ml README (h 14336, 70 layers, 112 heads, vocab 250880,
    # tied embeddings, ALiBi); docs/reference/PUBLISHED.md, "More measured runs".
    "bloom-176b": dict(vocab_size=250880, seq_len=2048, hidden=14336, num_layers=70,
                       num_heads=112, tie_embeddings=True, positions=Positions.NONE.value),
    # OPT-175B: arXiv 2205.01068 Table 1 (96 layers, 96 heads, h 12288), ReLU (section 2.1),
    # GPT-2 BPE vocabulary of 50272 as released in metaseq.
    "opt-175b": dict(vocab_size=50272, seq_len=2048, hidden=12288, num_layers=96,
                     num_heads=96, activation=Activation.RELU.value),
    # MegaScale's GPT-175B: arXiv 2402.15627 Table 1 (h 12288, 96 layers, 128 heads, vocab 64000).
    "megascale-175b": dict(vocab_size=64000, seq_len=2048, hidden=12288, num_layers=96,
                           num_heads=128),
    # Llama-style 70B: the Llama 3 paper (arXiv 2407.21783) Table 3: 80 layers, h 8192, FFN
    # 28672 (SwiGLU), 64 heads, 8 key/value heads, RoPE; no biases; vocabulary 128256 as in the
    # released model config (the table rounds it to 128,000).
    "llama-70b": dict(vocab_size=128256, seq_len=8192, hidden=8192, num_layers=80,
                      num_heads=64, num_kv_heads=8, activation=Activation.SWIGLU.value,
                      mlp_hidden=28672, bias=False, positions=Positions.NONE.value),
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
    With grouped-query attention (num_kv_heads < num_heads) the projections are
    ``q`` (C -> C), ``k`` and ``v`` (C -> KV*D), each column-parallel; every key/value
    head serves num_heads / num_kv_heads consecutive query heads. Tensor parallelism splits
    q by its heads and k, v by theirs in matching contiguous blocks (the tensor degree must
    divide num_kv_heads; planner/strategies/tensor/split/rules.py).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        if self.kv_heads == self.num_heads:
            self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        else:
            self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
            self.k = nn.Linear(cfg.hidden, self.kv_heads * self.head_dim, bias=cfg.bias)
            self.v = nn.Linear(cfg.hidden, self.kv_heads * self.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, D) and k, v (B, KV, T, D) from x (B, T, C).

        The head counts are written -1 (inferred), as Hugging Face models write them, so that the
        same code runs on a tensor-parallel rank's local features (H / t heads)."""
        if self.kv_heads == self.num_heads:
            qkv = self.qkv(x)                                              # (B, T, 3C)
            qkv = qkv.unflatten(-1, (3, -1, self.head_dim))                # (B, T, 3, H, D)
            qkv = qkv.permute(2, 0, 3, 1, 4)                               # (3, B, H, T, D)
            return qkv[0], qkv[1], qkv[2]
        q = self.q(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)   # (B, H, T, D)
        k = self.k(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)   # (B, KV, T, D)
        v = self.v(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)   # (B, KV, T, D)
        return q, k, v   # attention lets each key/value head serve H / KV query heads (enable_gqa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C)
        q, k, v = self._heads(x)                                       # (B, H|KV, T, D)
        # self.training is a plain Python bool (not traced), so this is fx-safe.
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                           enable_gqa=self.kv_heads != self.num_heads)
        y = y.transpose(1, 2).flatten(2)                               # (B, T, C)
        return self.resid_drop(self.proj(y))                           # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward: Linear C -> I, activation, Linear I -> C (I = cfg.inner).

    SwiGLU adds a second column-parallel Linear ``gate`` (C -> I): proj(silu(gate(x)) * fc(x)).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.inner, bias=cfg.bias)
        self.gated = cfg.activation == Activation.SWIGLU
        if self.gated:
            self.gate = nn.Linear(cfg.hidden, cfg.inner, bias=cfg.bias)
        self.act = {Activation.GELU: nn.GELU, Activation.RELU: nn.ReLU, Activation.SWIGLU: nn.SiLU}[
            Activation(cfg.activation)]()
        self.proj = nn.Linear(cfg.inner, cfg.hidden, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C) -> (B, T, I) -> (B, T, C)
        h = self.act(self.gate(x)) * self.fc(x) if self.gated else self.act(self.fc(x))
        return self.drop(self.proj(h))


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
        self.learned_positions = cfg.positions == Positions.LEARNED
        if self.learned_positions:
            self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)   # learned position embedding
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        # Not tied to wte unless asked (see module docstring).
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # idx: (B, T) int64, T <= seq_len (larger T fails inside the position embedding)
        x = self.wte(idx)                                      # (B, T, C)
        if self.learned_positions:
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))   # + (T, C)
        x = self.drop(x)                                       # (B, T, C)
        for block in self.blocks:
            x = block(x)                                       # (B, T, C)
        x = self.ln_f(x)                                       # (B, T, C)
        return self.lm_head(x)                                 # (B, T, V)


def num_params(cfg: GPTConfig) -> int:
    """Closed-form parameter count of ``GPT(cfg)`` (a tied weight counted once).

    Per block about 12 * C^2 for mlp_ratio 4 (qkv 3C^2, proj C^2, MLP 2 * 4C^2), plus
    biases and LayerNorms; plus (V + seq_len) * C embeddings and the V * C lm_head.
    Grouped-query attention has k and v of C x KV*D each; SwiGLU a third C x I matrix.
    """
    c, i, b = cfg.hidden, cfg.inner, int(cfg.bias)
    kv = cfg.kv_heads * cfg.head_dim
    ln = c * (1 + b)                                  # weight (+ bias)
    attn = (c * (c + 2 * kv) + b * (c + 2 * kv)) + (c * c + b * c)   # q, k, v + proj
    mats = 3 if cfg.activation == Activation.SWIGLU else 2
    mlp = (mats - 1) * (c * i + b * i) + (i * c + b * c)
    per_block = 2 * ln + attn + mlp
    embeddings = cfg.vocab_size * c + (cfg.seq_len * c if cfg.positions == Positions.LEARNED else 0)
    head = 0 if cfg.tie_embeddings else c * cfg.vocab_size
    return embeddings + cfg.num_layers * per_block + ln + head


def build(preset: str | None = None, *, vocab_size: int | None = None,
          seq_len: int | None = None, hidden: int | None = None,
          num_layers: int | None = None, num_heads: int | None = None,
          mlp_ratio: int | None = None, dropout: float | None = None,
          bias: bool | None = None, activation: str | None = None,
          mlp_hidden: int | None = None, num_kv_heads: int | None = None,
          tie_embeddings: bool | None = None, positions: str | None = None) -> GPT:
    """Factory used by model refs such as ``examples/models/gpt.py:build``.

    ``preset`` is one of ``PRESETS`` ("tiny" when None); explicit keyword arguments
    override the preset's fields.
    """
    cfg = make_config(preset, vocab_size=vocab_size, seq_len=seq_len, hidden=hidden,
                      num_layers=num_layers, num_heads=num_heads, mlp_ratio=mlp_ratio,
                      dropout=dropout, bias=bias, activation=activation, mlp_hidden=mlp_hidden,
                      num_kv_heads=num_kv_heads, tie_embeddings=tie_embeddings, positions=positions)
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

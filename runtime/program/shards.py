"""How a parameter or a module is split over a group of ranks: the description a Program's StageSpec
(runtime/spec.py), a checkpoint's conversion and the single-process reference read, whichever strategy
made it (the tensor split decides it: planner/strategies/tensor/split/; runtime/parallel/tensor/layers.py
builds the split modules from it).

How a feature dimension is split is a `FeatureSplit`: the dimension's full size written as mixed-radix
factors (outermost first) and the factor that is divided among the ranks. A plain split is
`FeatureSplit((n,), 0)` (rank r holds the r-th contiguous block). GPT's fused qkv projection, whose 3C
outputs are read as (3, heads, head_dim), is `FeatureSplit((3, H, D), 1)`: each rank holds its heads of
q, of k and of v. A plain split of a size the ranks do not divide is padded (every rank holds
ceil(n / t) entries, the last ones zeros), and may round each rank's block up to a multiple of
`multiple` entries; a split factor among several is never padded.

A `ModuleShard` splits a whole module (its role, a ShardRole, says which of its dimensions); a
`ParamShard` splits a tensor the generated code reads directly (ATen graphs of torch.export captures).
All three are values that round-trip through the Program's JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from runtime.vocab import ShardRole

SHARD_ROLES = (ShardRole.COLUMN, ShardRole.COLUMN_OUT, ShardRole.ROW, ShardRole.VOCAB, ShardRole.CHANNELS,
               ShardRole.SEQUENCE)


class ShardError(ValueError):
    """A module or tensor that cannot be split as asked; the message names it."""


@dataclass(frozen=True)
class FeatureSplit:
    """A feature dimension of full size prod(factors), split on factor `split`."""

    factors: tuple[int, ...]
    split: int
    multiple: int = 1     # a plain split: each rank's block is rounded up to a multiple of this many entries

    def __post_init__(self) -> None:
        object.__setattr__(self, "factors", tuple(int(f) for f in self.factors))
        if not self.factors or any(f < 1 for f in self.factors) or not 0 <= self.split < len(self.factors):
            raise ShardError(f"bad FeatureSplit factors={self.factors} split={self.split}")
        if isinstance(self.multiple, bool) or not isinstance(self.multiple, int) or self.multiple < 1 \
                or (self.multiple > 1 and len(self.factors) > 1):
            raise ShardError(f"bad FeatureSplit multiple={self.multiple!r} for factors={self.factors}: a whole "
                             "number >= 1, and 1 unless the split is plain (one factor)")

    @property
    def size(self) -> int:
        return math.prod(self.factors)

    @property
    def groups(self) -> int:
        """Equal parts of the dimension that are each split into contiguous blocks (3 for a fused
        q/k/v projection split by heads: rank r holds q_r, k_r, v_r; 1 for one contiguous block each)."""
        return math.prod(self.factors[: self.split])

    def padded(self, num: int) -> bool:
        """Whether `num` ranks split it with padding (a plain split that `num` does not divide, or whose
        blocks are rounded up to `multiple`)."""
        return len(self.factors) == 1 and self.local_size(num) * num != self.size

    def check(self, num: int) -> None:
        if len(self.factors) > 1 and self.factors[self.split] % num:
            raise ShardError(f"a split over {num} ranks needs {num} to divide {self.factors[self.split]} "
                             f"(factor {self.split} of {self.factors})")

    def local_size(self, num: int) -> int:
        """Entries each rank holds (padding included)."""
        self.check(num)
        block = -(-self.size // num)
        return -(-block // self.multiple) * self.multiple

    def indices(self, rank: int, num: int) -> torch.Tensor:
        """The full-dimension indices rank `rank` of `num` holds, ascending (int64); a padded
        split's last ranks hold fewer (their padding is not an index)."""
        self.check(num)
        if len(self.factors) == 1:
            block = self.local_size(num)
            return torch.arange(min(rank * block, self.size), min((rank + 1) * block, self.size))
        idx = torch.arange(self.size)
        stride = math.prod(self.factors[self.split + 1:])
        digit = (idx // stride) % self.factors[self.split]
        per = self.factors[self.split] // num
        keep = (digit >= rank * per) & (digit < (rank + 1) * per)
        return idx[keep]

    def contiguous_start(self, rank: int, num: int) -> int | None:
        """First index of rank's block when its indices are one contiguous block, else None."""
        if math.prod(self.factors[: self.split]) == 1:
            return rank * self.local_size(num)
        return None

    def take(self, t: torch.Tensor, dim: int, rank: int, num: int) -> torch.Tensor:
        """Rank's slice of `t` along `dim` (a copy), zero-padded to local_size."""
        idx = self.indices(rank, num).to(t.device)
        out = t.detach().index_select(dim, idx)
        pad = self.local_size(num) - len(idx)
        if pad:
            shape = list(out.shape)
            shape[dim] = pad
            out = torch.cat([out, out.new_zeros(shape)], dim)
        return out.clone()

    def put(self, full: torch.Tensor, dim: int, rank: int, num: int, piece: torch.Tensor) -> None:
        """Write rank's slice `piece` (as take gives it) back into `full`, dropping the padding."""
        idx = self.indices(rank, num).to(full.device)
        full.index_copy_(dim, idx, piece.narrow(dim, 0, len(idx)))

    def to_list(self) -> list:
        """[factors, split], and the multiple when it is not 1 (splits written before it read alike)."""
        return [list(self.factors), self.split] + ([self.multiple] if self.multiple != 1 else [])

    @classmethod
    def from_list(cls, x) -> "FeatureSplit":
        return cls(tuple(x[0]), int(x[1]), int(x[2]) if len(x) > 2 else 1)


@dataclass(frozen=True)
class ParamShard:
    """How a parameter or buffer the generated code reads directly (get_attr) is split:
    along dimension `dim`, as `split` (ATen graphs of torch.export captures)."""

    name: str
    dim: int
    split: FeatureSplit

    def to_dict(self) -> dict:
        return {"name": self.name, "dim": self.dim, "split": self.split.to_list()}

    @classmethod
    def from_dict(cls, d: dict) -> "ParamShard":
        return cls(str(d["name"]), int(d["dim"]), FeatureSplit.from_list(d["split"]))


@dataclass(frozen=True)
class ModuleShard:
    """How one module of the model is split over the tensor axis.

    role: "column"/"column_out" (output features), "row" (input features),
    "vocab" (embedding rows), "channels" (per-channel parameters of a norm
    between a column and a row op). `split` describes the split dimension.
    """

    path: str
    role: str
    split: FeatureSplit
    sequence_dim: int | None = None   # sequence parallelism: the dimension a column gathers / a row scatters

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", str(self.role))   # a ShardRole member: its plain name, as in the JSON
        if self.role not in SHARD_ROLES:
            raise ShardError(f"unknown shard role {self.role!r} for {self.path}; known: {', '.join(SHARD_ROLES)}")

    def local_parameters(self, module: nn.Module, num: int) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
        """(name, shape, dtype, requires_grad) of each parameter of `module` (the model's, full size; meta
        is fine) as one of `num` ranks holds it after shard_module, in the same order, read from this
        description alone: the split dimension (shard_dim) at its local size, the rest whole. As
        shard_module makes them, a split module's parameters all train if any of the original's does."""
        params = list(module.named_parameters())
        if self.role == ShardRole.SEQUENCE:   # whole, as the module is
            return [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in params]
        trains = any(p.requires_grad for _, p in params)
        out = []
        for name, p in params:
            shape = list(p.shape)
            dim = shard_dim(self.role, name, p.dim())
            if dim is not None:
                shape[dim] = self.split.local_size(num)
            out.append((name, tuple(shape), p.dtype, trains))
        return out

    def to_dict(self) -> dict:
        # str(): a ShardRole role is written as its plain name (a rank script holds it as a literal)
        d = {"path": self.path, "role": str(self.role), "split": self.split.to_list()}
        if self.sequence_dim is not None:
            d["sequence_dim"] = self.sequence_dim
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModuleShard":
        dim = d.get("sequence_dim")
        return cls(d["path"], d["role"], FeatureSplit.from_list(d["split"]), None if dim is None else int(dim))


def shard_dim(role: str, leaf: str, ndim: int) -> int | None:
    """The dimension a module shard of `role` splits its tensor `leaf` ("weight", "bias",
    "running_mean", ...) along, or None when that tensor is whole on every rank."""
    if ndim == 0:
        return None
    if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT, ShardRole.VOCAB, ShardRole.CHANNELS):
        return 0
    if role == ShardRole.ROW and leaf == "weight":
        return 1
    return None

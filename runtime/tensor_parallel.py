"""Tensor-parallel layers: column/row Linear and conv, vocabulary-parallel embedding
and cross-entropy, per-channel shards of norms, as autograd-aware modules.

How a feature dimension is split is a `FeatureSplit`: the dimension's full
size written as mixed-radix factors (outermost first) and the factor that is
divided among the ranks. A plain split is `FeatureSplit((n,), 0)` (rank r
holds the r-th contiguous block). GPT's fused qkv projection, whose 3C
outputs are read as (3, heads, head_dim), is `FeatureSplit((3, H, D), 1)`:
each rank holds its heads of q, of k and of v, so attention stays local.

Collectives (Megatron-LM's pattern):
  column op:   forward identity on the input, backward all-reduce of its gradient
  row op:      forward all-reduce of the partial output (bias added once, after)
  vocab embed: each rank looks up its rows (others masked to 0), forward all-reduce
  vocab loss:  max, sum-exp and target-logit all-reduces; the logits are never gathered

A module built with `group=None` performs no communication (shape checks on meta).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.comm import Group

SHARD_ROLES = ("column", "column_out", "row", "vocab", "channels")


class ShardError(ValueError):
    """A module or tensor that cannot be split as asked; the message names it."""


@dataclass(frozen=True)
class FeatureSplit:
    """A feature dimension of full size prod(factors), split on factor `split`."""

    factors: tuple[int, ...]
    split: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "factors", tuple(int(f) for f in self.factors))
        if not self.factors or any(f < 1 for f in self.factors) or not 0 <= self.split < len(self.factors):
            raise ShardError(f"bad FeatureSplit factors={self.factors} split={self.split}")

    @property
    def size(self) -> int:
        return math.prod(self.factors)

    def check(self, num: int) -> None:
        if self.factors[self.split] % num:
            raise ShardError(f"a split over {num} ranks needs {num} to divide {self.factors[self.split]} "
                             f"(factor {self.split} of {self.factors})")

    def local_size(self, num: int) -> int:
        self.check(num)
        return self.size // num

    def indices(self, rank: int, num: int) -> torch.Tensor:
        """The full-dimension indices rank `rank` of `num` holds, ascending (int64)."""
        self.check(num)
        idx = torch.arange(self.size)
        stride = math.prod(self.factors[self.split + 1:])
        digit = (idx // stride) % self.factors[self.split]
        per = self.factors[self.split] // num
        keep = (digit >= rank * per) & (digit < (rank + 1) * per)
        return idx[keep]

    def contiguous_start(self, rank: int, num: int) -> int | None:
        """First index of rank's block when its indices are one contiguous block, else None."""
        if math.prod(self.factors[: self.split]) == 1:
            return rank * (self.size // num)
        return None

    def to_list(self) -> list:
        return [list(self.factors), self.split]

    @classmethod
    def from_list(cls, x) -> "FeatureSplit":
        return cls(tuple(x[0]), int(x[1]))


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

    def __post_init__(self) -> None:
        if self.role not in SHARD_ROLES:
            raise ShardError(f"unknown shard role {self.role!r} for {self.path}; known: {', '.join(SHARD_ROLES)}")

    def to_dict(self) -> dict:
        return {"path": self.path, "role": self.role, "split": self.split.to_list()}

    @classmethod
    def from_dict(cls, d: dict) -> "ModuleShard":
        return cls(d["path"], d["role"], FeatureSplit.from_list(d["split"]))


# ---------------------------------------------------------------------------
# autograd functions


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.group.all_reduce(grad)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    if group is None or group.size == 1:
        return x
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    if group is None or group.size == 1:
        return x
    return _ReduceFromGroup.apply(x, group)


# ---------------------------------------------------------------------------
# modules


class _ShardedLinear(nn.Module):
    """A linear layer holding this rank's shard of the weight (and bias) plus its tensor group."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Group | None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group = group


class ColumnParallelLinear(_ShardedLinear):
    """y_local = x W_local^T + b_local: this rank's output features (B, ..., out/t)."""

    def forward(self, x):
        return F.linear(copy_to_group(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, local_out_features={self.weight.shape[0]}"


class RowParallelLinear(_ShardedLinear):
    """y = all_reduce(x_local W_local^T) + b: input features split, full output."""

    def forward(self, x):
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local_in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class _ParallelConv(nn.Module):
    def __init__(self, conv: nn.Module, weight, bias, group):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group = group
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.dims = weight.dim() - 2
        self._fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[self.dims]

    def _conv(self, x, bias):
        return self._fn(x, self.weight, bias, self.stride, self.padding, self.dilation, 1)


class ColumnParallelConv(_ParallelConv):
    """Output channels split: (B, C_out/t, ...)."""

    def forward(self, x):
        return self._conv(copy_to_group(x, self.group), self.bias)


class RowParallelConv(_ParallelConv):
    """Input channels split; partial outputs all-reduced, bias added once."""

    def forward(self, x):
        y = reduce_from_group(self._conv(x, None), self.group)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, *([1] * self.dims))
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the table; ids outside give zeros; outputs all-reduced."""

    def __init__(self, weight: torch.Tensor, start: int, group: Group | None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start = int(start)
        self.group = group

    def forward(self, ids):
        n = self.weight.shape[0]
        outside = (ids < self.start) | (ids >= self.start + n)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.group)

    def extra_repr(self) -> str:
        return f"rows={self.start}..{self.start + self.weight.shape[0]}, dim={self.weight.shape[1]}"


def _take(t: torch.Tensor | None, dim: int, idx: torch.Tensor) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().index_select(dim, idx.to(t.device)).clone()


def shard_module(module: nn.Module, shard: ModuleShard, rank: int, num: int, group: Group | None) -> nn.Module:
    """This rank's part of `module` as a tensor-parallel module (parameters copied).

    Raises ShardError naming the module when it is of a kind that cannot be split so.
    """
    split, role, path = shard.split, shard.role, shard.path
    idx = split.indices(rank, num)
    requires_grad = any(p.requires_grad for p in module.parameters())

    def finish(m: nn.Module) -> nn.Module:
        for p in m.parameters():
            p.requires_grad_(requires_grad)
        m.train(module.training)
        return m

    if isinstance(module, nn.Linear):
        if role in ("column", "column_out"):
            if split.size != module.out_features:
                raise ShardError(f"{path}: split of size {split.size} does not match out_features {module.out_features}")
            return finish(ColumnParallelLinear(_take(module.weight, 0, idx), _take(module.bias, 0, idx), group))
        if role == "row":
            if split.size != module.in_features:
                raise ShardError(f"{path}: split of size {split.size} does not match in_features {module.in_features}")
            b = module.bias.detach().clone() if module.bias is not None else None
            return finish(RowParallelLinear(_take(module.weight, 1, idx), b, group))
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise ShardError(f"{path}: only convolutions with groups=1, zero padding and numeric padding "
                             f"can be split over the tensor axis (got groups={module.groups}, "
                             f"padding={module.padding!r}, padding_mode={module.padding_mode!r})")
        if role in ("column", "column_out"):
            return finish(ColumnParallelConv(module, _take(module.weight, 0, idx), _take(module.bias, 0, idx), group))
        if role == "row":
            b = module.bias.detach().clone() if module.bias is not None else None
            return finish(RowParallelConv(module, _take(module.weight, 1, idx), b, group))
    if isinstance(module, nn.Embedding) and role == "vocab":
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ShardError(f"{path}: a vocabulary-parallel embedding cannot have padding_idx, max_norm or sparse")
        start = split.contiguous_start(rank, num)
        if start is None:
            raise ShardError(f"{path}: vocabulary rows must be split in contiguous blocks")
        return finish(VocabParallelEmbedding(_take(module.weight, 0, idx), start, group))
    if role == "channels":
        return finish(shard_channels(module, split, idx, path))
    raise ShardError(f"{path}: cannot split a {type(module).__name__} as {role!r}; tensor parallelism splits "
                     "nn.Linear, nn.Conv1d/2d/3d, nn.Embedding and per-channel norms (BatchNorm)")


def shard_channels(module: nn.Module, split: FeatureSplit, idx: torch.Tensor, path: str = "") -> nn.Module:
    """A copy of a per-channel module (BatchNorm) holding only the channels in `idx`."""
    if any(True for _ in module.children()):
        raise ShardError(f"{path}: only leaf modules can be split per channel")
    m = copy.copy(module)
    m._parameters = dict(module._parameters)
    m._buffers = dict(module._buffers)
    for name, p in module._parameters.items():
        if p is not None and p.dim() >= 1:
            if p.shape[0] != split.size:
                raise ShardError(f"{path}.{name}: {tuple(p.shape)} is not per-channel over {split.size} channels")
            m._parameters[name] = nn.Parameter(_take(p, 0, idx), requires_grad=p.requires_grad)
    for name, b in module._buffers.items():
        if b is not None and b.dim() >= 1:
            if b.shape[0] != split.size:
                raise ShardError(f"{path}.{name}: {tuple(b.shape)} is not per-channel over {split.size} channels")
            m._buffers[name] = _take(b, 0, idx)
        elif b is not None:
            m._buffers[name] = b.detach().clone()
    if hasattr(m, "num_features"):
        m.num_features = len(idx)
    return m


# ---------------------------------------------------------------------------
# vocabulary-parallel cross-entropy


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, group):
        # logits (N, V/t) this rank's classes [start, start + V/t); target (N,) global ids
        logits = logits.float()
        vmax = logits.max(dim=-1).values
        group.all_reduce(vmax, op="max")
        shifted = logits - vmax.unsqueeze(-1)
        n = logits.shape[-1]
        outside = (target < start) | (target >= start + n)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        group.all_reduce(picked)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        group.all_reduce(sum_exp)
        loss = sum_exp.log() - picked
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 group: Group) -> torch.Tensor:
    """Per-element cross-entropy of class-split logits (..., V/t) against global targets (...)."""
    flat = logits.reshape(-1, logits.shape[-1])
    loss = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), int(start), group)
    return loss.reshape(target.shape)

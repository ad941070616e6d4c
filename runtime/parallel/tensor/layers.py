"""Tensor-parallel layers: column/row Linear and conv, vocabulary-parallel embedding
and cross-entropy, per-channel shards of norms, as autograd-aware modules.

How a feature dimension is split is a `FeatureSplit`: the dimension's full
size written as mixed-radix factors (outermost first) and the factor that is
divided among the ranks. A plain split is `FeatureSplit((n,), 0)` (rank r
holds the r-th contiguous block). GPT's fused qkv projection, whose 3C
outputs are read as (3, heads, head_dim), is `FeatureSplit((3, H, D), 1)`:
each rank holds its heads of q, of k and of v, so attention stays local.

A plain split of a size the ranks do not divide (GPT-2's 50257-token vocabulary over 2
ranks) is padded, as Megatron pads the vocabulary: every rank holds ceil(n / t) entries,
the last ones zeros that the model never reads (the padded classes of vocabulary-parallel
logits are masked out of the loss, and the padded part of a weight's gradient is zeroed),
so the logits, the loss and the weights the user sees keep their size n. A plain split may
also round each rank's block up to a multiple of `multiple` entries (Execution.vocab_multiple:
aligned vocabulary GEMMs); at one rank that pads the whole dimension. A split factor among
several (heads in (3, H, D)) must be divisible and is never padded.

Modules split as wholes (fx captures: nn.Linear, nn.Embedding, ...) become the modules
below; a weight an ATen graph reads directly (torch.export captures) is split by a
`ParamShard`, and the generated code calls the functions `copy_to_group`,
`reduce_from_group` and `vocab_parallel_embedding` with the stage's `tensor_group`.

Collectives (Megatron-LM's pattern):
  column op:   forward identity on the input, backward all-reduce of its gradient
  row op:      forward all-reduce of the partial output (bias added once, after)
  vocab embed: each rank looks up its rows (others masked to 0), forward all-reduce
  vocab loss:  max, sum-exp and target-logit all-reduces; the logits are never gathered
               (runtime/losses.py vocab_parallel_cross_entropy)

Under sequence parallelism (Korthikanti et al. 2022, section 4.2.2; planner/strategies/tensor/split/sequence.py
decides where) the values between regions hold this rank's block of the sequence (dimension
`sequence_dim`): a column op all-gathers its input along it (backward: reduce-scatter of the
input gradient), a row op and a vocabulary embedding reduce-scatter their output along it
(backward: all-gather), a replicated op that needs the whole sequence gathers it (backward: each
rank keeps its block of the gradient), and a norm's parameters, which see only this rank's
tokens, get their gradient all-reduced (`sequence_grads`).

A module built with `group=None` performs no communication; a shape-only run on meta tensors gives it a
`ShapeGroup`, whose collectives only make outputs of the local shape.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from runtime.comm import Group
# the collectives with autograd (runtime/comm/autograd.py); importable from here too, as generated code and
# builds of earlier trees import them
from runtime.comm.autograd import (copy_to_group, gather_sequence, gather_whole, reduce_from_group,  # noqa: F401
                                   reduce_scatter_sequence)
# the split description, kept in the Program's documents (runtime/program/shards.py); importable from here too,
# as generated code and builds of earlier trees import it
from runtime.program.shards import SHARD_ROLES, FeatureSplit, ModuleShard, ParamShard, ShardError, shard_dim  # noqa: F401
from runtime.vocab import ShardRole



class ShapeGroup:
    """A stand-in tensor group for shape-only (meta) runs: rank 0 of `size`, no communication."""

    def __init__(self, size: int):
        self.size, self.rank = int(size), 0

    def all_reduce(self, tensor, op: str = "sum", async_op: bool = False):
        return None

    def all_gather(self, output, tensor, async_op: bool = False):
        return None

    def reduce_scatter(self, output, tensor, async_op: bool = False):
        return None


def sequence_grads(module: nn.Module, group: Group | None) -> None:
    """All-reduce over `group` the gradient of each of `module`'s parameters as it arrives: a norm
    that runs on this rank's tokens computes its parameters' gradient over those tokens only."""
    if group is None or group.size == 1:
        return

    def hook(g: torch.Tensor) -> torch.Tensor:
        g = g.contiguous().clone()
        group.all_reduce(g)
        return g
    for p in module.parameters():
        if p.requires_grad:
            p.register_hook(hook)


def scatter_to_group(x: torch.Tensor, dim: int, factors: tuple[int, ...], split: int,
                     group: Group | None) -> torch.Tensor:
    """This rank's part of a replicated tensor along `dim`, split as FeatureSplit(factors, split):
    where a replicated value (a per-head bias) meets a split one. Every rank computes the
    replicated value alike; backward all-reduces its gradient, whose parts each rank computes."""
    if group is None or group.size == 1:
        return x
    fs = FeatureSplit(tuple(factors), split)
    idx = fs.indices(group.rank, group.size).to(x.device)
    out = copy_to_group(x, group).index_select(dim, idx)
    pad = fs.local_size(group.size) - len(idx)
    if pad:
        shape = list(out.shape)
        shape[dim] = pad
        out = torch.cat([out, out.new_zeros(shape)], dim)
    return out


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, group: Group | None,
                             padding_idx: int | None = None, sequence_dim: int | None = None) -> torch.Tensor:
    """embedding(weight, ids, padding_idx) for a table split by rows over `group`: this rank
    holds rows [rank * n, (rank + 1) * n) of it (n = weight.shape[0], padding included).
    sequence_dim: reduce-scatter the output along it (sequence parallelism) instead of all-reducing."""
    rank = group.rank if group is not None else 0
    return _vocab_lookup(ids, weight, rank * weight.shape[0], group, padding_idx, sequence_dim)


def _combine(partial: torch.Tensor, group: Group | None, sequence_dim: int | None) -> torch.Tensor:
    """The sum over `group` of every rank's partial output: whole, or this rank's block of the sequence."""
    if sequence_dim is None:
        return reduce_from_group(partial, group)
    return reduce_scatter_sequence(partial, sequence_dim, group)


def row_bias(bias: torch.Tensor, group: Group | None, sequence_dim: int | None) -> torch.Tensor:
    """A row op's bias, added once to the reduced output: under sequence parallelism it meets only this
    rank's tokens, so its gradient is all-reduced."""
    return bias if sequence_dim is None else copy_to_group(bias, group)


def _column_input(x: torch.Tensor, group: Group | None, sequence_dim: int | None) -> torch.Tensor:
    """A column op's input: whole on every rank (gradient all-reduced), or gathered along the sequence."""
    if sequence_dim is None:
        return copy_to_group(x, group)
    return gather_sequence(x, sequence_dim, group)


# ---------------------------------------------------------------------------
# modules


class _ShardedLinear(nn.Module):
    """A linear layer holding this rank's shard of the weight (and bias) plus its tensor group."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Group | None,
                 sequence_dim: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group = group
        self.sequence_dim = sequence_dim


class ColumnParallelLinear(_ShardedLinear):
    """y_local = x W_local^T + b_local: this rank's output features (B, ..., out/t)."""

    def forward(self, x):
        return F.linear(_column_input(x, self.group, self.sequence_dim), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, local_out_features={self.weight.shape[0]}"


class RowParallelLinear(_ShardedLinear):
    """y = all_reduce(x_local W_local^T) + b: input features split, full output."""

    def forward(self, x):
        y = _combine(F.linear(x, self.weight), self.group, self.sequence_dim)
        return y + row_bias(self.bias, self.group, self.sequence_dim) if self.bias is not None else y

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


def _vocab_lookup(ids: torch.Tensor, weight: torch.Tensor, start: int, group: Group | None,
                  padding_idx: int | None = None, sequence_dim: int | None = None) -> torch.Tensor:
    n = weight.shape[0]
    outside = (ids < start) | (ids >= start + n)
    local = (ids - start).masked_fill(outside, 0)
    # the padding row (it takes no gradient) if this rank holds it; rows looked up from outside
    # are masked below, and a masked row's gradient is zero anyway
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + n else None
    out = F.embedding(local, weight, padding_idx=pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return _combine(out, group, sequence_dim)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the table; ids outside give zeros; outputs all-reduced."""

    def __init__(self, weight: torch.Tensor, start: int, group: Group | None, sequence_dim: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start = int(start)
        self.group = group
        self.sequence_dim = sequence_dim

    def forward(self, ids):
        return _vocab_lookup(ids, self.weight, self.start, self.group, sequence_dim=self.sequence_dim)

    def extra_repr(self) -> str:
        return f"rows={self.start}..{self.start + self.weight.shape[0]}, dim={self.weight.shape[1]}"


def _take(t: torch.Tensor | None, dim: int, split: FeatureSplit, rank: int, num: int) -> torch.Tensor | None:
    return None if t is None else split.take(t, dim, rank, num)


def mask_padding(p: torch.Tensor, dim: int, split: FeatureSplit, rank: int, num: int) -> None:
    """Zero the padded part of `p`'s gradient as it arrives, so the padding stays zero."""
    keep = len(split.indices(rank, num))
    if keep == p.shape[dim] or not p.requires_grad:
        return

    def hook(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.narrow(dim, keep, g.shape[dim] - keep).zero_()
        return g
    p.register_hook(hook)


def shard_module(module: nn.Module, shard: ModuleShard, rank: int, num: int, group: Group | None) -> nn.Module:
    """This rank's part of `module` as a tensor-parallel module (parameters copied).

    Raises ShardError naming the module when it is of a kind that cannot be split so.
    """
    split, role, path = shard.split, shard.role, shard.path
    requires_grad = any(p.requires_grad for p in module.parameters())

    def finish(m: nn.Module) -> nn.Module:
        for p in m.parameters():
            p.requires_grad_(requires_grad)
        for name, p in m.named_parameters():
            dim = shard_dim(role, name, p.dim())
            if dim is not None:
                mask_padding(p, dim, split, rank, num)
        m.train(module.training)
        return m

    def take(t, dim):
        return _take(t, dim, split, rank, num)

    if isinstance(module, nn.Linear):
        if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT):
            if split.size != module.out_features:
                raise ShardError(f"{path}: split of size {split.size} does not match out_features {module.out_features}")
            return finish(ColumnParallelLinear(take(module.weight, 0), take(module.bias, 0), group, shard.sequence_dim))
        if role == ShardRole.ROW:
            if split.size != module.in_features:
                raise ShardError(f"{path}: split of size {split.size} does not match in_features {module.in_features}")
            b = module.bias.detach().clone() if module.bias is not None else None
            return finish(RowParallelLinear(take(module.weight, 1), b, group, shard.sequence_dim))
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise ShardError(f"{path}: only convolutions with groups=1, zero padding and numeric padding "
                             f"can be split over the tensor axis (got groups={module.groups}, "
                             f"padding={module.padding!r}, padding_mode={module.padding_mode!r})")
        if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT):
            return finish(ColumnParallelConv(module, take(module.weight, 0), take(module.bias, 0), group))
        if role == ShardRole.ROW:
            b = module.bias.detach().clone() if module.bias is not None else None
            return finish(RowParallelConv(module, take(module.weight, 1), b, group))
    if isinstance(module, nn.Embedding) and role == ShardRole.VOCAB:
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ShardError(f"{path}: a vocabulary-parallel embedding cannot have padding_idx, max_norm or sparse")
        start = split.contiguous_start(rank, num)
        if start is None:
            raise ShardError(f"{path}: vocabulary rows must be split in contiguous blocks")
        return finish(VocabParallelEmbedding(take(module.weight, 0), start, group, shard.sequence_dim))
    if role == ShardRole.CHANNELS:
        return finish(shard_channels(module, split, rank, num, path))
    if role == ShardRole.SEQUENCE:   # whole; runs on this rank's tokens (its gradients: runtime/parallel/tensor/strategy.py)
        return module
    raise ShardError(f"{path}: cannot split a {type(module).__name__} as {role!r}; tensor parallelism splits "
                     "nn.Linear, nn.Conv1d/2d/3d, nn.Embedding and per-channel norms (BatchNorm)")


def shard_channels(module: nn.Module, split: FeatureSplit, rank: int, num: int, path: str = "") -> nn.Module:
    """A copy of a per-channel module (BatchNorm) holding only rank's channels (padded with zeros)."""
    if any(True for _ in module.children()):
        raise ShardError(f"{path}: only leaf modules can be split per channel")
    m = copy.copy(module)
    m._parameters = dict(module._parameters)
    m._buffers = dict(module._buffers)
    for name, p in module._parameters.items():
        if p is not None and p.dim() >= 1:
            if p.shape[0] != split.size:
                raise ShardError(f"{path}.{name}: {tuple(p.shape)} is not per-channel over {split.size} channels")
            m._parameters[name] = nn.Parameter(_take(p, 0, split, rank, num), requires_grad=p.requires_grad)
    for name, b in module._buffers.items():
        if b is not None and b.dim() >= 1:
            if b.shape[0] != split.size:
                raise ShardError(f"{path}.{name}: {tuple(b.shape)} is not per-channel over {split.size} channels")
            m._buffers[name] = _take(b, 0, split, rank, num)
        elif b is not None:
            m._buffers[name] = b.detach().clone()
    if hasattr(m, "num_features"):
        m.num_features = split.local_size(num)
    return m

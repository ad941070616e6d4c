"""A split module at one rank's sizes, for the shape-only (meta) run that makes a split graph's shape constants
local (codegen/strategies/tensor/shapes.py).

Built from the plan's description of the split alone (ModuleShard: role, split, sequence dimension; its
parameters' local shapes from ModuleShard.local_parameters), with what the split layers do to the shapes of
the values they exchange (runtime/parallel/tensor/layers.py, which a test holds these to): a column op's
input gathered along the sequence under sequence parallelism, a row op's or a vocabulary-parallel
embedding's output reduce-scattered along it; every other collective keeps its shape. Values are meta
tensors of rank 0's sizes; nothing is communicated and no weight is copied.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from planner.strategies.tensor.split.rules import TensorSplitError
from runtime.program.shards import ModuleShard, shard_dim
from runtime.vocab import ShardRole

_COLUMNS = (ShardRole.COLUMN, ShardRole.COLUMN_OUT)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=dtype.is_floating_point)


def _gathered(x: torch.Tensor, dim: int | None, t: int) -> torch.Tensor:
    """`x` as gathered along the sequence `dim` from `t` ranks (None: as it is)."""
    return x if dim is None else torch.cat([x] * t, dim)


def _scattered(y: torch.Tensor, dim: int | None, t: int) -> torch.Tensor:
    """Rank 0's block of `y` reduce-scattered along the sequence `dim` over `t` ranks (None: whole)."""
    return y if dim is None else y.narrow(dim, 0, y.shape[dim] // t)


class _LocalSplitOp(nn.Module):
    """A Linear, ConvNd or Embedding split as `shard` says, at rank 0's sizes (see module docstring)."""

    def __init__(self, module: nn.Module, shard: ModuleShard, t: int):
        super().__init__()
        for name, shape, dtype, _ in shard.local_parameters(module, t):
            setattr(self, name, _meta(shape, dtype))
        if getattr(module, "bias", None) is None:
            self.bias = None
        self.kind, self.role, self.t, self.seq = type(module), shard.role, t, shard.sequence_dim
        if isinstance(module, _CONV):
            self.conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[module.weight.dim() - 2]
            self.geometry = (module.stride, module.padding, module.dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        column = self.role in _COLUMNS
        if issubclass(self.kind, nn.Embedding):
            return _scattered(F.embedding(x, self.weight), self.seq, self.t)
        if issubclass(self.kind, nn.Linear):
            if column:
                return F.linear(_gathered(x, self.seq, self.t), self.weight, self.bias)
            y = _scattered(F.linear(x, self.weight), self.seq, self.t)
            return y + self.bias if self.bias is not None else y
        y = self.conv(x, self.weight, self.bias if column else None, *self.geometry, 1)
        if self.bias is not None and not column:
            y = y + self.bias.view(1, -1, *([1] * (y.dim() - 2)))
        return y


def _local_channels(module: nn.Module, shard: ModuleShard, t: int) -> nn.Module:
    """A per-channel module (BatchNorm) holding rank 0's channels: its per-channel tensors at the local size."""
    m = copy.copy(module)
    m._parameters = {name: None if p is None else
                     _meta(tuple(p.shape) if p.dim() == 0 else (shard.split.local_size(t), *p.shape[1:]), p.dtype)
                     for name, p in module._parameters.items()}
    m._buffers = {name: None if b is None else torch.empty(
        (shard.split.local_size(t), *b.shape[1:]) if shard_dim(shard.role, name, b.dim()) is not None else b.shape,
        dtype=b.dtype, device="meta") for name, b in module._buffers.items()}
    if hasattr(m, "num_features"):
        m.num_features = shard.split.local_size(t)
    return m


def local_module(module: nn.Module, shard: ModuleShard, t: int) -> nn.Module:
    """`module` (the model's, full size) as rank 0 of `t` runs it under `shard`, on meta tensors.

    Raises TensorSplitError naming the module where the split does not fit it (a kind tensor parallelism
    does not split so)."""
    role = shard.role
    if role == ShardRole.SEQUENCE:   # whole; it runs on this rank's tokens
        return module
    if role == ShardRole.CHANNELS:
        return _local_channels(module, shard, t)
    fits = (isinstance(module, (nn.Linear, *_CONV)) and role in (*_COLUMNS, ShardRole.ROW)) or \
        (isinstance(module, nn.Embedding) and role == ShardRole.VOCAB)
    if not fits:
        raise TensorSplitError(f"{shard.path}: cannot split a {type(module).__name__} as {role!r}; tensor "
                               "parallelism splits nn.Linear, nn.Conv1d/2d/3d, nn.Embedding and per-channel norms")
    if isinstance(module, _CONV) and (module.groups != 1 or module.padding_mode != "zeros"
                                      or isinstance(module.padding, str)):
        raise TensorSplitError(f"{shard.path}: only convolutions with groups=1, zero padding and numeric padding "
                               f"can be split over the tensor axis (got groups={module.groups}, "
                               f"padding={module.padding!r}, padding_mode={module.padding_mode!r})")
    whole = module.weight.shape[1 if role == ShardRole.ROW else 0]
    if shard.split.size != whole:
        raise TensorSplitError(f"{shard.path}: a split of size {shard.split.size} does not match its "
                               f"{'input' if role == ShardRole.ROW else 'output'} features ({whole})")
    return _LocalSplitOp(module, shard, t)

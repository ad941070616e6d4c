"""Collectives with autograd over a group of ranks (Megatron-LM's "mappings"): what split layers, the
generated stage code and the fused output head call where a value crosses from whole to split or back.

  copy_to_group            forward identity, backward all-reduce (sum) of the gradient
  reduce_from_group        forward all-reduce (sum), backward identity
  gather_sequence          forward all-gather along a dimension, backward reduce-scatter
  reduce_scatter_sequence  forward reduce-scatter along a dimension, backward all-gather
  gather_whole             forward all-gather along a dimension, backward this rank's block of the gradient

A `group` of None or of one rank makes each the identity. Shapes: `x` is any tensor; the gathers' output is
`group.size` times `x` along `dim`, the reduce-scatter's `1 / group.size` of it (the size divides).
"""

from __future__ import annotations

import torch

from runtime.comm import Group


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
    """Identity; the gradient is all-reduced over `group` (the input of column-parallel ops)."""
    if group is None or group.size == 1:
        return x
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """The sum over `group` of every rank's partial `x` (the output of row-parallel ops)."""
    if group is None or group.size == 1:
        return x
    return _ReduceFromGroup.apply(x, group)


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Every rank's block of `x` along `dim`, concatenated in rank order."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((group.size * front.shape[0], *front.shape[1:]))
    group.all_gather(out.view(-1), front.view(-1))
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's block along `dim` of the sum over ranks of `x`."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // group.size, *front.shape[1:]))
    group.reduce_scatter(out.view(-1), front.view(-1))
    return out.movedim(0, dim)


def _block(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's block of `x` along `dim` (a copy)."""
    n = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * n, n).contiguous()


class _SequenceCollective(torch.autograd.Function):
    """`forward(x, dim, group)` in forward, `backward(grad, dim, group)` in backward: the pairs below."""

    @staticmethod
    def forward(ctx, x, dim, group, forward, backward):
        ctx.dim, ctx.group, ctx.backward = dim, group, backward
        return forward(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward(grad, ctx.dim, ctx.group), None, None, None, None


def _sequence(x: torch.Tensor, dim: int, group: Group | None, forward, backward) -> torch.Tensor:
    if group is None or group.size == 1:
        return x
    return _SequenceCollective.apply(x, dim, group, forward, backward)


def gather_sequence(x: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    """The whole sequence of a sequence-split `x` for a column-parallel op: all-gather along `dim`;
    backward reduce-scatters the gradient (every rank's column op gives a partial one)."""
    return _sequence(x, dim, group, _gather, _reduce_scatter)


def reduce_scatter_sequence(x: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    """This rank's block along `dim` of the sum of every rank's partial `x` (a row op's output);
    backward all-gathers the gradient."""
    return _sequence(x, dim, group, _reduce_scatter, _gather)


def gather_whole(x: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    """The whole sequence of a sequence-split `x` for an op every rank runs alike: all-gather along
    `dim`; every rank computes the same gradient of the whole, so backward keeps its block of it."""
    return _sequence(x, dim, group, _gather, _block)


__all__ = ["copy_to_group", "gather_sequence", "gather_whole", "reduce_from_group", "reduce_scatter_sequence"]

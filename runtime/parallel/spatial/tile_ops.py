"""The tile ops of spatial parallelism: what runs on one rank's tile of an image in place of the
unsplit op. A window op (conv, max/avg pool) runs unpadded on its tile and the halos its neighbours
send (runtime/parallel/spatial/halo.py); a BatchNorm takes the whole image's statistics ("sync") or
its tile's ("local"); the gather at the end of the spatial part gives every member the full activation.

They are autograd Functions over the runtime's Communicator and Group (gloo, NCCL or MPI alike), and
modules that wrap one model layer on a tile (parameters and buffers keep the wrapped module's names).
A tile op keeps only its tile and the thin halos for backward (the extended copy is rebuilt), and the
BatchNorm keeps only its input, so a tile saves 1/s of what the unsplit layers save
(benchmarks/spatial_memory.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.parallel.spatial.geometry import SpatialError, TileLayout, Window, bounds, check_batchnorm
from runtime.parallel.spatial.halo import TileExchange
from runtime.vocab import SpatialBatchNorm


# ---------------------------------------------------------------------------
# autograd Functions


class _TileWindow(torch.autograd.Function):
    """A window op on tile + halo that keeps only the tile and the (thin) halos for backward.

    Forward exchanges the halos (rows, then columns of the row-extended tile) and runs
    `op.forward(ext, weight, bias)` without padding; backward rebuilds the extended tile from
    the saved tile and halos, takes `op.backward` and returns the halo gradients to their owners.
    The extended copy is never kept: a tile saves what the unsplit op saves, plus the halos.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, axes: tuple, op, fill: float):
        halos, lengths, cur = [], [], x
        for ax in axes:
            lo, hi = ax.receive(cur)
            halos.append((lo, hi))
            lengths.append(cur.shape[ax.dim])
            cur = ax.assemble(cur, lo, hi, fill)
        ctx.save_for_backward(x, weight, bias)
        ctx.axes, ctx.op, ctx.fill, ctx.halos, ctx.lengths = axes, op, fill, halos, lengths
        return op.forward(cur, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight, bias = ctx.saved_tensors
        cur = x
        for ax, (lo, hi) in zip(ctx.axes, ctx.halos):
            cur = ax.assemble(cur, lo, hi, ctx.fill)
        g_ext, g_w, g_b = ctx.op.backward(cur, weight, bias, g.contiguous())
        for ax, length in zip(reversed(ctx.axes), reversed(ctx.lengths)):
            g_ext = ax.backward(g_ext, length)
        return g_ext, g_w, g_b, None, None, None


class _GatherTiles(torch.autograd.Function):
    """Tiles (B, C, h_ij, w_ij) on the group -> the full (B, C, H, W) on every member.

    The layers after the gather run replicated on every member of the group. Backward,
    `reduce=False`: this member's slice of the gradient (every member computed the same
    gradient of the same loss). `reduce=True`: the slice of the gradient summed over the
    members, for runs where each member's loss is scaled by 1/s so that every gradient,
    replicated layers' included, is a partial sum that one all-reduce completes.
    """

    @staticmethod
    def forward(ctx, x, group, layout: TileLayout, full_h: int, full_w: int, reduce: bool = False):
        ctx.rows, ctx.cols = layout.tile_of(full_h, full_w)
        ctx.group, ctx.reduce = group, reduce
        bh, bw = bounds(full_h, layout.rows), bounds(full_w, layout.cols)
        mh = max(bh[k + 1] - bh[k] for k in range(layout.rows))
        mw = max(bw[k + 1] - bw[k] for k in range(layout.cols))
        lead = x.shape[:-2]
        padded = x.new_zeros((*lead, mh, mw))
        padded[..., :x.shape[-2], :x.shape[-1]] = x
        flat = x.new_empty(group.size * padded.numel())
        group.all_gather(flat, padded.reshape(-1))
        tiles = flat.view(group.size, *lead, mh, mw)
        out = x.new_empty((*lead, full_h, full_w))
        for i in range(layout.rows):
            for j in range(layout.cols):
                h, w = bh[i + 1] - bh[i], bw[j + 1] - bw[j]
                out[..., bh[i]:bh[i + 1], bw[j]:bw[j + 1]] = tiles[i * layout.cols + j, ..., :h, :w]
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce:
            g = g.contiguous().clone()
            ctx.group.all_reduce(g, "sum")
        return g[..., ctx.rows, ctx.cols].contiguous(), None, None, None, None, None


def gather_tiles(x: torch.Tensor, group, layout: TileLayout, full_h: int, full_w: int,
                 reduce: bool = False) -> torch.Tensor:
    """The full activation from the group's tiles (see _GatherTiles)."""
    return _GatherTiles.apply(x, group, layout, full_h, full_w, reduce)


# ---------------------------------------------------------------------------
# spatially split modules (parameters and buffers keep the wrapped module's names)


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def conv_windows(conv: nn.Conv2d, layer: str) -> tuple[Window, Window]:
    """(H window, W window) of a Conv2d; SpatialError for what a tile cannot reproduce."""
    if conv.padding_mode != "zeros":
        raise SpatialError(f"{layer}: padding_mode={conv.padding_mode!r} is not supported spatially; use 'zeros'")
    k, s, d = _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.dilation)
    if conv.padding == "valid":
        p = (0, 0)
    elif conv.padding == "same":
        p = tuple(d[a] * (k[a] - 1) // 2 for a in range(2))
    else:
        p = _pair(conv.padding)
    return Window(k[0], s[0], d[0], p[0]), Window(k[1], s[1], d[1], p[1])


def pool_windows(pool: nn.Module, layer: str) -> tuple[Window, Window]:
    if getattr(pool, "ceil_mode", False):
        raise SpatialError(f"{layer}: ceil_mode=True pooling is not supported spatially; use ceil_mode=False")
    k = _pair(pool.kernel_size)
    s = _pair(pool.stride if pool.stride is not None else pool.kernel_size)
    d = _pair(getattr(pool, "dilation", 1))
    p = _pair(pool.padding)
    if isinstance(pool, nn.AvgPool2d) and any(p) and not pool.count_include_pad:
        raise SpatialError(f"{layer}: AvgPool2d with count_include_pad=False divides border windows by their "
                           "in-image size, which a tile cannot see; use count_include_pad=True or padding 0")
    return Window(k[0], s[0], d[0], p[0]), Window(k[1], s[1], d[1], p[1])


@dataclass(frozen=True)
class _ConvOp:
    """conv2d without padding; backward by torch.nn.grad (no recomputation)."""

    stride: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    def forward(self, ext, weight, bias):
        return F.conv2d(ext, weight, bias, self.stride, 0, self.dilation, self.groups)

    def backward(self, ext, weight, bias, g):
        g_ext = torch.nn.grad.conv2d_input(ext.shape, weight, g, self.stride, 0, self.dilation, self.groups)
        g_w = torch.nn.grad.conv2d_weight(ext, weight.shape, g, self.stride, 0, self.dilation, self.groups)
        return g_ext, g_w, (g.sum((0, 2, 3)) if bias is not None else None)


@dataclass(frozen=True)
class _PoolOp:
    """max/avg pooling without padding; backward recomputes the (cheap) pool under autograd."""

    is_max: bool
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    divisor: int | None

    def forward(self, ext, weight=None, bias=None):
        if self.is_max:
            return F.max_pool2d(ext, self.kernel, self.stride, 0, self.dilation)
        return F.avg_pool2d(ext, self.kernel, self.stride, 0, divisor_override=self.divisor)

    def backward(self, ext, weight, bias, g):
        with torch.enable_grad():
            e = ext.detach().requires_grad_(True)
            (g_ext,) = torch.autograd.grad(self.forward(e), (e,), g)
        return g_ext, None, None


def _conv_op(conv: nn.Module) -> _ConvOp:
    return _ConvOp(_pair(conv.stride), _pair(conv.dilation), conv.groups)


def _pool_op(pool: nn.Module) -> tuple[_PoolOp, float]:
    """The unpadded pool and the value its halo takes beyond the image border (-inf for max)."""
    is_max = isinstance(pool, nn.MaxPool2d)
    op = _PoolOp(is_max, _pair(pool.kernel_size), _pair(pool.stride or pool.kernel_size),
                 _pair(getattr(pool, "dilation", 1)), getattr(pool, "divisor_override", None))
    return op, float("-inf") if is_max else 0.0


def tile_conv(conv: nn.Module, x: torch.Tensor, exchange: TileExchange) -> torch.Tensor:
    """conv (a Conv2d, or a module with its weight, bias, stride, dilation and groups) on this
    rank's tile x (B, C, h, w): halo exchange, then the conv without padding."""
    return _TileWindow.apply(x, conv.weight, conv.bias, exchange.axes(x.dim()), _conv_op(conv), 0.0)


def tile_pool(pool: nn.Module, x: torch.Tensor, exchange: TileExchange) -> torch.Tensor:
    """MaxPool2d / AvgPool2d on this rank's tile: halo (-inf or 0 at the border), then the pool unpadded."""
    op, fill = _pool_op(pool)
    return _TileWindow.apply(x, None, None, exchange.axes(x.dim()), op, fill)


class SpatialConv2d(nn.Module):
    """A Conv2d on one tile as a module of its own (tile_conv). Same parameter names."""

    def __init__(self, conv: nn.Conv2d, exchange: TileExchange):
        super().__init__()
        self.weight = conv.weight
        self.bias = conv.bias
        self.stride, self.dilation, self.groups = conv.stride, conv.dilation, conv.groups
        self.exchange = exchange

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tile_conv(self, x, self.exchange)


class SpatialPool2d(nn.Module):
    """MaxPool2d / AvgPool2d on one tile as a module of its own (tile_pool)."""

    def __init__(self, pool: nn.Module, exchange: TileExchange):
        super().__init__()
        self.pool = pool
        self.exchange = exchange

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tile_pool(self.pool, x, self.exchange)


class _SyncBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm of tiles with the whole image's statistics.

    Forward: one all-reduce of the per-channel sums and count, one of the squared deviations
    (two passes, as exact as the unsplit op). Backward: one all-reduce of the per-channel sums
    of g and g * xhat. Saves only the input tile and per-channel statistics (as F.batch_norm
    does), not the normalized intermediates. Returns (y, mean, biased var, element count).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):
        dims = (0, 2, 3)
        c = x.shape[1]
        stats = torch.cat([x.sum(dims), x.new_tensor([float(x.numel() // c)])])
        group.all_reduce(stats, "sum")
        n = float(stats[-1])
        mean = stats[:c] / n
        sq = ((x - mean[None, :, None, None]) ** 2).sum(dims)
        group.all_reduce(sq, "sum")
        var = sq / n
        invstd = torch.rsqrt(var + eps)
        scale = invstd if weight is None else invstd * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        y = x * scale[None, :, None, None] + shift[None, :, None, None]
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.group, ctx.n, ctx.has_bias = group, n, bias is not None
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var, n

    @staticmethod
    def backward(ctx, g, _gm, _gv, _gn):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = (0, 2, 3)
        c = x.shape[1]
        xhat_of = lambda: (x - mean[None, :, None, None]) * invstd[None, :, None, None]  # noqa: E731
        sum_g = g.sum(dims)
        sum_gx = (g * xhat_of()).sum(dims)
        grad_w = sum_gx.clone() if weight is not None else None     # this tile's share
        grad_b = sum_g.clone() if ctx.has_bias else None
        both = torch.cat([sum_g, sum_gx])
        ctx.group.all_reduce(both, "sum")
        mg, mgx = both[:c] / ctx.n, both[c:] / ctx.n
        scale = invstd if weight is None else invstd * weight
        gx = (g - mg[None, :, None, None] - xhat_of() * mgx[None, :, None, None]) * scale[None, :, None, None]
        return gx, grad_w, grad_b, None, None


class SpatialBatchNorm2d(nn.Module):
    """BatchNorm2d on one tile, with statistics over the whole image ("sync", exact: two all-reduces
    forward and one backward per layer) or over the tile alone ("local", cheaper, not equal to the
    unsplit model). Same parameter and buffer names as the wrapped BatchNorm2d."""

    def __init__(self, bn: nn.BatchNorm2d, group, mode: str):
        super().__init__()
        check_batchnorm(mode)
        self.weight, self.bias = bn.weight, bn.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(bn, name))
        self.eps, self.momentum, self.affine = bn.eps, bn.momentum, bn.affine
        self.group, self.mode = group, mode
        self.training = bn.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tile_batch_norm(self, x, self.group, self.mode)


def tile_batch_norm(bn: nn.Module, x: torch.Tensor, group, mode: str) -> torch.Tensor:
    """bn (a BatchNorm2d, or a module with its parameters, buffers, eps, momentum and training flag)
    on this rank's tile x, with statistics over the whole image (`mode` "sync") or the tile ("local");
    bn's running statistics are updated in place."""
    if mode == SpatialBatchNorm.LOCAL or not bn.training:
        mom = 0.0
        if bn.training and bn.running_mean is not None:
            bn.num_batches_tracked.add_(1)
            mom = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.training, mom, bn.eps)
    y, mean, var, n = _SyncBatchNorm.apply(x, bn.weight, bn.bias, bn.eps, group)
    if bn.running_mean is not None:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            mom = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.mul_(1 - mom).add_(mean, alpha=mom)
            bn.running_var.mul_(1 - mom).add_(var * (n / max(n - 1, 1.0)), alpha=mom)
    return y


__all__ = ["SpatialBatchNorm2d", "SpatialConv2d", "SpatialPool2d", "conv_windows", "gather_tiles", "pool_windows",
           "tile_batch_norm", "tile_conv", "tile_pool"]

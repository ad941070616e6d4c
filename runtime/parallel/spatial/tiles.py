"""Spatial parallelism: one image split into tiles over the ranks of a spatial group.

Tiles are horizontal strips (split kind "strips_h": the H axis is cut into s
pieces), vertical strips ("strips_v": W is cut) or a rows x cols grid
("grid"). Every size along a cut axis is split canonically: n rows over t
tiles gives tile i the rows [i*n//t, (i+1)*n//t). Because each activation's
partition depends only on its own full size, a conv's output tiles, the
shortcut's output tiles and the residual sum all line up without talking.

A window op (conv, max/avg pool) with kernel k, stride s, dilation d and
leading padding p computes output row o from input rows
[o*s - p, o*s - p + d*(k-1)]. The tile that owns output rows [c, e) thus
needs input rows [c*s - p, (e-1)*s - p + d*(k-1) + 1): what lies outside its
own rows [a, b) is a halo from the neighbour (or the op's padding at the
image border; or rows it owns but does not need, which are dropped). The
op then runs *unpadded* on tile + halo. For stride 1 and p = (k-1)/2 this is
the textbook halo of (k-1)/2 rows on each side.

Grids exchange in two phases, rows first and then columns of the row-extended
tile: the column messages carry the corner blocks, so the diagonal
neighbours' pixels arrive without eight separate messages (the bytes are the
same). Backward runs the phases in reverse and sends every halo's gradient
back to the tile that owns those pixels, which adds it into its own input
gradient: border gradients are exact.

The tile ops, the synchronized BatchNorm statistics and the gather at the
end of the spatial part are autograd Functions over the runtime's
Communicator and Group (gloo, NCCL or MPI alike). Generated stage code calls
them through its `SpatialContext` (codegen/strategies/spatial/tiles.py writes the calls
at build time); `attach_tiles` gives that context this rank's tile and the
spatial group from the Program (runtime.parallel.spatial.part.SpatialTiles). A tile op keeps only its
tile and the thin halos for backward (the extended copy is rebuilt), and the
BatchNorm keeps only its input, so a tile saves 1/s of what the unsplit
layers save (benchmarks/spatial_memory.py measures it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.program import Program
from runtime.parallel.spatial.part import SpatialTiles
from runtime.parallel.spatial.geometry import AxisHalo, SpatialError, TileLayout, Window, axis_halos, bounds, check_batchnorm
from runtime.vocab import SpatialBatchNorm

# Halo messages live above the pipeline's p2p tags (runtime.comm.p2p_tag stays below 2**29).
SPATIAL_TAG_BASE = 2**30


# ---------------------------------------------------------------------------
# autograd Functions


def _wait(handles) -> None:
    for h in handles:
        h.wait()


@dataclass(frozen=True)
class _AxisExchange:
    """One phase of a halo exchange: along tensor dim `dim` with the previous/next tile (global
    ranks, -1 for none), message tags tag (to the next tile) and tag + 1 (to the previous one);
    backward uses tag + 2 and tag + 3."""

    comm: object
    plan: AxisHalo
    dim: int
    prev: int
    nxt: int
    tag: int
    halo_grads: bool = True   # False only to show that --verify notices (runtime/verify/sabotage.py)

    def _block(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        shape = list(like.shape)
        shape[self.dim] = rows
        return like.new_empty(shape)

    def receive(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send this tile's border rows to the neighbours; return the rows received (before, after)."""
        plan, dim, comm = self.plan, self.dim, self.comm
        x = x.contiguous()
        length = x.shape[dim]
        handles, keep = [], []
        recv_lo = self._block(x, plan.recv_lo) if plan.recv_lo else None
        recv_hi = self._block(x, plan.recv_hi) if plan.recv_hi else None
        if recv_lo is not None:
            handles.append(comm.irecv(recv_lo, self.prev, self.tag))
        if recv_hi is not None:
            handles.append(comm.irecv(recv_hi, self.nxt, self.tag + 1))
        if plan.send_lo:
            keep.append(x.narrow(dim, 0, plan.send_lo).contiguous())
            handles.append(comm.isend(keep[-1], self.prev, self.tag + 1))
        if plan.send_hi:
            keep.append(x.narrow(dim, length - plan.send_hi, plan.send_hi).contiguous())
            handles.append(comm.isend(keep[-1], self.nxt, self.tag))
        _wait(handles)
        return recv_lo, recv_hi

    def assemble(self, x: torch.Tensor, recv_lo, recv_hi, fill: float) -> torch.Tensor:
        """x (..., L, ...) -> (..., pad_lo + recv_lo + L - crop_lo - crop_hi + recv_hi + pad_hi, ...)."""
        plan, dim = self.plan, self.dim
        parts = []
        if plan.pad_lo:
            parts.append(self._block(x, plan.pad_lo).fill_(fill))
        if recv_lo is not None:
            parts.append(recv_lo)
        parts.append(x.narrow(dim, plan.crop_lo, x.shape[dim] - plan.crop_lo - plan.crop_hi))
        if recv_hi is not None:
            parts.append(recv_hi)
        if plan.pad_hi:
            parts.append(self._block(x, plan.pad_hi).fill_(fill))
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()

    def backward(self, g: torch.Tensor, length: int) -> torch.Tensor:
        """Gradient of the extended tile -> gradient of the tile (length rows): the halo rows'
        gradients go back to their owners, whose gradients of this tile's border rows are added."""
        plan, dim, comm = self.plan, self.dim, self.comm
        g = g.contiguous()
        mid = length - plan.crop_lo - plan.crop_hi
        at = plan.pad_lo
        g_lo = g.narrow(dim, at, plan.recv_lo).contiguous() if plan.recv_lo else None
        at += plan.recv_lo
        g_mid = g.narrow(dim, at, mid)
        at += mid
        g_hi = g.narrow(dim, at, plan.recv_hi).contiguous() if plan.recv_hi else None
        gx = self._block(g, length).zero_()
        gx.narrow(dim, plan.crop_lo, mid).copy_(g_mid)
        tag = self.tag + 2  # backward messages use their own pair of tags
        handles, got = [], []
        if g_lo is not None:
            handles.append(comm.isend(g_lo, self.prev, tag + 1))
        if g_hi is not None:
            handles.append(comm.isend(g_hi, self.nxt, tag))
        if plan.send_lo:
            buf = self._block(g, plan.send_lo)
            handles.append(comm.irecv(buf, self.prev, tag))
            got.append((0, buf))
        if plan.send_hi:
            buf = self._block(g, plan.send_hi)
            handles.append(comm.irecv(buf, self.nxt, tag + 1))
            got.append((length - plan.send_hi, buf))
        _wait(handles)
        if self.halo_grads:
            _AxisExchange.add_borrowed(gx, got, dim)
        return gx

    @staticmethod
    def add_borrowed(gx: torch.Tensor, got: list[tuple[int, torch.Tensor]], dim: int) -> None:
        """Add the neighbours' gradients of the rows they borrowed (start row, gradient) into gx."""
        for start, buf in got:
            gx.narrow(dim, start, buf.shape[dim]).add_(buf)


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


@dataclass(frozen=True)
class TileExchange:
    """The halo plans of one window op for this rank: along H then W, and its message tags."""

    comm: object
    layout: TileLayout
    h: AxisHalo
    w: AxisHalo
    tag: int
    halo_grads: bool = True   # False only to show that --verify notices (runtime/verify/sabotage.py)

    @classmethod
    def plan(cls, comm, layout: TileLayout, in_hw: tuple[int, int], out_hw: tuple[int, int],
             wh: Window, ww: Window, op_id: int, layer: str) -> "TileExchange":
        if not 0 <= op_id < 2**20:
            raise SpatialError(f"{layer}: spatial op id {op_id} out of range")
        h = axis_halos(in_hw[0], out_hw[0], layout.rows, wh, layer=layer)[layout.i]
        w = axis_halos(in_hw[1], out_hw[1], layout.cols, ww, layer=layer)[layout.j]
        return cls(comm, layout, h, w, SPATIAL_TAG_BASE + op_id * 8)

    def axes(self, ndim: int = 4) -> tuple[_AxisExchange, ...]:
        """The exchange phases that change the tile: rows (H) first, then columns (W)."""
        L, out = self.layout, []
        for plan, dim, tag, before, after in (
                (self.h, ndim - 2, self.tag, (L.i - 1, L.j), (L.i + 1, L.j)),
                (self.w, ndim - 1, self.tag + 4, (L.i, L.j - 1), (L.i, L.j + 1))):
            if not (plan.exchanges or plan.pad_lo or plan.pad_hi or plan.crop_lo or plan.crop_hi):
                continue
            prev = L.rank_at(*before) if min(before) >= 0 else -1
            nxt = L.rank_at(*after) if after[0] < L.rows and after[1] < L.cols else -1
            out.append(_AxisExchange(self.comm, plan, dim, prev, nxt, tag, self.halo_grads))
        return tuple(out)


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


# ---------------------------------------------------------------------------
# the spatial part of a generated stage module


class SpatialContext:
    """What a stage module's spatial part calls: its ops on this rank's tile of every image.

    Generated stage code (codegen/strategies/spatial/tiles.py) holds one as `self.spatial` and calls
    `take` on the images it reads, `conv`/`pool`/`batch_norm` with the model's own modules (so
    parameters and buffers keep their names), and `gather` on every value the layers after
    the spatial part read. A window op names its message-tag slot `op` (numbered at build
    time) and its full (height, width) in and out. `attach_tiles` sets the tile layout and
    the spatial group before training.
    """

    def __init__(self, batchnorm: str = SpatialBatchNorm.SYNC):
        check_batchnorm(batchnorm)
        self.batchnorm = SpatialBatchNorm(batchnorm)
        self.layout: TileLayout | None = None
        self.group = None
        self.comm = None
        self.halo_grads = True   # False only to show that --verify notices (runtime/verify/sabotage.py)
        self._exchanges: dict[int, TileExchange] = {}

    def attach(self, layout: TileLayout, group, comm) -> None:
        if tuple(group.ranks) != layout.ranks:
            raise SpatialError(f"the spatial group {list(group.ranks)} is not the tiles' ranks {list(layout.ranks)}")
        self.layout, self.group, self.comm = layout, group, comm
        self._exchanges = {}

    def _layout(self) -> TileLayout:
        if self.layout is None:
            raise SpatialError("this stage's spatial part has no tile layout; the rank runs it after "
                               "runtime.parallel.spatial.tiles.attach_tiles (the Program's spatial field)")
        return self.layout

    def _exchange(self, module: nn.Module, windows, op: int, image) -> TileExchange:
        if op not in self._exchanges:
            (in_hw, out_hw), layer = image, f"{type(module).__name__} (spatial op {op})"
            ex = TileExchange.plan(self.comm, self._layout(), in_hw, out_hw, *windows(module, layer), op, layer)
            self._exchanges[op] = dataclasses.replace(ex, halo_grads=self.halo_grads)
        return self._exchanges[op]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> this rank's tile (B, C, h, w), a copy (autograd keeps the tile, not the image)."""
        rows, cols = self._layout().tile_of(x.shape[-2], x.shape[-1])
        return x[..., rows, cols].clone(memory_format=torch.contiguous_format)

    def conv(self, conv: nn.Module, x: torch.Tensor, op: int, image) -> torch.Tensor:
        """conv on the tile x; image: ((H, W) in, (H, W) out) of the whole image."""
        return tile_conv(conv, x, self._exchange(conv, conv_windows, op, image))

    def pool(self, pool: nn.Module, x: torch.Tensor, op: int, image) -> torch.Tensor:
        """MaxPool2d / AvgPool2d on the tile x; image as for conv."""
        return tile_pool(pool, x, self._exchange(pool, pool_windows, op, image))

    def batch_norm(self, bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tile_batch_norm(bn, x, self.group, self.batchnorm)

    def gather(self, x: torch.Tensor, image: tuple[int, int]) -> torch.Tensor:
        """The full (B, C, H, W) activation (image: (H, W)) from the group's tiles, on every member.
        Its backward sums the gradient over the group: each member's loss is scaled by
        1 / (data x degree), so every gradient is a partial sum the gradient all-reduce completes."""
        return gather_tiles(x, self.group, self._layout(), image[0], image[1], reduce=True)


def spatial_contexts(module: nn.Module) -> list[SpatialContext]:
    """The SpatialContext of a generated stage module (empty when it splits no images)."""
    sp = getattr(module, "spatial", None)
    return [sp] if isinstance(sp, SpatialContext) else []


def attach_tiles(program: Program, modules: dict[int, nn.Module], comm) -> None:
    """Give every stage module's spatial part this rank's tile and the spatial group (the Program's spatial part)."""
    contexts = [sp for m in modules.values() for sp in spatial_contexts(m)]
    if not contexts:
        return
    tiles = program.part(SpatialTiles.key)
    if tiles is None:
        raise SpatialError(f"rank {program.rank}'s stage code splits images but its Program has no spatial "
                           "field; generate the build again")
    layout = TileLayout.of(tiles)
    group = comm.group(tiles.ranks)
    for sp in contexts:
        sp.attach(layout, group, comm)

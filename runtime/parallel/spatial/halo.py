"""The halo exchange of spatial parallelism: the rows a window op's tile borrows from its neighbours.

A window op (conv, max/avg pool) with kernel k, stride s, dilation d and
leading padding p computes output row o from input rows
[o*s - p, o*s - p + d*(k-1)]. The tile that owns output rows [c, e) thus
needs input rows [c*s - p, (e-1)*s - p + d*(k-1) + 1): what lies outside its
own rows [a, b) is a halo from the neighbour (or the op's padding at the
image border; or rows it owns but does not need, which are dropped). The
op then runs *unpadded* on tile + halo. For stride 1 and p = (k-1)/2 this is
the textbook halo of (k-1)/2 rows on each side (runtime/parallel/spatial/geometry.py
works out each tile's rows).

Grids exchange in two phases, rows first and then columns of the row-extended
tile: the column messages carry the corner blocks, so the diagonal
neighbours' pixels arrive without eight separate messages (the bytes are the
same). Backward runs the phases in reverse and sends every halo's gradient
back to the tile that owns those pixels, which adds it into its own input
gradient: border gradients are exact. The messages go over the runtime's
Communicator (gloo, NCCL or MPI alike); runtime/parallel/spatial/tile_ops.py runs the ops around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.parallel.spatial.geometry import AxisHalo, SpatialError, TileLayout, Window, axis_halos

# Halo messages live above the pipeline's p2p tags (runtime.comm.p2p_tag stays below 2**29).
SPATIAL_TAG_BASE = 2**30


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


__all__ = ["SPATIAL_TAG_BASE", "TileExchange"]

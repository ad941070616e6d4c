"""Sub-graph parallelism at run time: a split fork/join region, and the modules a sub-grid holds.

The generated stage code calls a region as one function of the fork value x
(codegen/partition.py writes one method per path and one per region):

    forward   the paths this sub-grid owns run on x; every path output is then
              broadcast over the sub-graph group (the mesh axis MeshAxis.SUBGRAPH)
              from the sub-grid that computed it, in path order, so each
              sub-grid returns all outputs
    backward  the owned paths' outputs are back-propagated with the incoming
              gradients (which every sub-grid has in full: everything after the
              join is replicated); the gradient of x, the sum of the owned paths'
              contributions, is all-reduced over the group

An attention op split by heads (`heads`): sub-grid g of G runs heads
[g H/G, (g+1) H/G) of q, k, v (batch, heads, T, d) over the whole batch; the
outputs are all-gathered along the heads; in backward each sub-grid back-
propagates its heads' slice of the (replicated) output gradient and the q, k, v
gradients (zero outside its heads) are all-reduced.

The collectives are blocking and issued in program order, identically on every
sub-grid, so the sub-grids cannot disagree on their order.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from runtime.comm import Group


class SubgraphContext:
    """This rank's sub-grid index, the sub-graph group, and which sub-grid owns each module.

    `owners` maps module paths (as the stage code calls them) to the sub-grid that holds them;
    the generated stage class sets it. `index`/`group` are set by `set_branch` before training.
    """

    def __init__(self, owners: dict[str, int] | None = None):
        self.owners = dict(owners or {})
        self.index = 0
        self.group: Group | None = None

    def region(self, x: torch.Tensor, paths: Sequence[Callable[[torch.Tensor], torch.Tensor]],
               owners: Sequence[int], shapes: Sequence[Sequence[int]], dtypes: Sequence[str]
               ) -> tuple[torch.Tensor, ...]:
        """All path outputs of one region. x: the fork value; shapes/dtypes: each path output's
        (per micro-batch, as the plan's partition computed them)."""
        if self.group is None or self.group.size == 1:
            return tuple(p(x) for p in paths)
        return _Region.apply(x, self, tuple(paths), tuple(owners), tuple(tuple(s) for s in shapes), tuple(dtypes))


    def heads(self, fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """fn(q, k, v, **kwargs) (attention on (batch, heads, T, d)) with the heads split over the group."""
        if self.group is None or self.group.size == 1:
            return fn(q, k, v, **kwargs)
        if q.shape[1] % self.group.size:
            raise ValueError(f"{q.shape[1]} attention heads do not split over {self.group.size} sub-grids")
        return _Heads.apply(q, k, v, self, fn, kwargs)


class _Heads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sg: SubgraphContext, fn, kwargs):
        g = sg.group.size
        h = q.shape[1] // g
        lo = sg.index * h
        mine = [t[:, lo:lo + h].detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with torch.enable_grad():
            out = fn(*mine, **kwargs)                          # (batch, h, T, d)
        full = torch.empty((g, *out.shape), dtype=out.dtype, device=out.device)
        sg.group.all_gather(full.view(-1), out.detach().contiguous().view(-1))
        ctx.sg, ctx.mine, ctx.out, ctx.lo, ctx.h = sg, mine, out, lo, h
        ctx.shapes = [t.shape for t in (q, k, v)]
        # (g, batch, h, T, d) -> (batch, g * h, T, d): head g*h + j comes from sub-grid g
        return full.movedim(0, 1).reshape(out.shape[0], g * h, *out.shape[2:])

    @staticmethod
    def backward(ctx, grad):
        lo, h, mine = ctx.lo, ctx.h, ctx.mine
        if ctx.out.requires_grad:
            torch.autograd.backward(ctx.out, grad[:, lo:lo + h])
        grads = torch.zeros((3, *ctx.shapes[0]), dtype=grad.dtype, device=grad.device)
        for i, t in enumerate(mine):
            if t.grad is not None:
                grads[i][:, lo:lo + h] = t.grad
        ctx.sg.group.all_reduce(grads)
        ctx.mine = ctx.out = None
        return grads[0], grads[1], grads[2], None, None, None


class _Region(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sg: SubgraphContext, paths, owners, shapes, dtypes):
        # x must take a gradient so that backward runs (the owned paths' parameters need it)
        xd = x.detach().requires_grad_(True)
        with torch.enable_grad():
            mine = {k: paths[k](xd) for k in range(len(paths)) if owners[k] == sg.index}
        outs = []
        for k in range(len(paths)):
            if owners[k] == sg.index:   # in the plan's dtype (under autocast a path may compute in bf16)
                buf = mine[k].detach().to(getattr(torch, dtypes[k])).contiguous().clone()
            else:
                buf = torch.empty(shapes[k], dtype=getattr(torch, dtypes[k]), device=x.device)
            sg.group.broadcast(buf, sg.group.ranks[owners[k]])
            outs.append(buf)
        ctx.sg, ctx.xd, ctx.mine = sg, xd, mine
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        mine = ctx.mine
        ks = [k for k in sorted(mine) if mine[k].requires_grad and grads[k] is not None]
        if ks:
            torch.autograd.backward([mine[k] for k in ks], [grads[k].to(mine[k].dtype) for k in ks])
        gx = ctx.xd.grad.to(ctx.xd.dtype) if ctx.xd.grad is not None else torch.zeros_like(ctx.xd)
        ctx.sg.group.all_reduce(gx)
        ctx.mine = ctx.xd = None
        return gx, None, None, None, None, None


def contexts(module: nn.Module) -> list[SubgraphContext]:
    """The SubgraphContext of a generated stage module (empty when it splits nothing)."""
    sg = getattr(module, "subgraph", None)
    return [sg] if isinstance(sg, SubgraphContext) else []


def keep_own_paths(module: nn.Module, index: int) -> list[str]:
    """Drop the modules of paths other sub-grids run from a stage module; returns their paths.

    Must run before the optimizer and the gradient buckets see the parameters: this rank
    neither trains nor stores the other sub-grids' paths.
    """
    dropped = []
    for sg in contexts(module):
        sg.index = index
        for path, owner in sg.owners.items():
            if owner != index:
                parent, _, name = path.rpartition(".")
                holder = module.get_submodule(parent) if parent else module
                if hasattr(holder, name):
                    delattr(holder, name)
                    dropped.append(path)
    return dropped


def set_branch(module: nn.Module, index: int, group: Group | None) -> None:
    """Give a stage module's regions this rank's sub-grid index (its coordinate on the sub-graph axis)
    and that axis's group."""
    for sg in contexts(module):
        if group is not None and group.ranks[index] != group.ranks[group.rank]:
            raise ValueError(f"sub-grid {index} is not this rank's position {group.rank} in the sub-graph group")
        sg.index, sg.group = index, group

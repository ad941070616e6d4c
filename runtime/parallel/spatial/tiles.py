"""Spatial parallelism: one image split into tiles over the ranks of a spatial group.

Tiles are horizontal strips (split kind "strips_h": the H axis is cut into s
pieces), vertical strips ("strips_v": W is cut) or a rows x cols grid
("grid"). Every size along a cut axis is split canonically: n rows over t
tiles gives tile i the rows [i*n//t, (i+1)*n//t). Because each activation's
partition depends only on its own full size, a conv's output tiles, the
shortcut's output tiles and the residual sum all line up without talking.

A window op borrows halo rows from its neighbours (runtime/parallel/spatial/halo.py, which says
which and how they travel); the tile ops, the synchronized BatchNorm statistics and the gather at the
end of the spatial part are autograd Functions (runtime/parallel/spatial/tile_ops.py). Generated stage
code calls them through its `SpatialContext`, kept here (codegen/strategies/spatial/tiles.py writes the
calls at build time); `attach_tiles` gives that context this rank's tile and the spatial group from the
Program (runtime.parallel.spatial.part.SpatialTiles).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from runtime.program import Program
from runtime.parallel.spatial.part import SpatialTiles
from runtime.parallel.spatial.geometry import SpatialError, TileLayout, check_batchnorm
# the tile ops the context calls, and the names builds import from here (see __all__ at the end)
from runtime.parallel.spatial.halo import SPATIAL_TAG_BASE, TileExchange
from runtime.parallel.spatial.tile_ops import (SpatialBatchNorm2d, SpatialConv2d, SpatialPool2d, conv_windows,
                                               gather_tiles, pool_windows, tile_batch_norm, tile_conv, tile_pool)
from runtime.vocab import SpatialBatchNorm


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


# Every name this module defined before the halo exchange and the tile ops had modules of their own:
# builds on users' disks reach them here (rank scripts import SpatialContext from this path, and old
# builds' runtime.spatial looks every name up in this module).
__all__ = ["SPATIAL_TAG_BASE", "SpatialBatchNorm2d", "SpatialContext", "SpatialConv2d", "SpatialPool2d",
           "TileExchange", "attach_tiles", "conv_windows", "gather_tiles", "pool_windows", "spatial_contexts",
           "tile_batch_norm", "tile_conv", "tile_pool"]

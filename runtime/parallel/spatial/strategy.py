"""Spatial parallelism at run time: the stage code's spatial part (written at build time,
codegen/strategies/spatial/tiles.py) gets this rank's tile and the spatial group from the Program
(runtime.parallel.spatial.part.SpatialTiles). Which data the tiles read is the Program's too
(Program.data_shard)."""

from __future__ import annotations

from runtime.comm.context import DistContext
from runtime.parallel.base import Modules, RuntimeStrategy, Specs
from runtime.program import Program
from runtime.parallel.spatial.tiles import attach_tiles, spatial_contexts
from runtime.vocab import MeshAxis, StrategyName


class Spatial(RuntimeStrategy):
    """Image tiles over runs of s ranks on the data axis (the Program's spatial part)."""

    name = StrategyName.SPATIAL
    axis = MeshAxis.SPATIAL
    not_evaluated = "spatial parallelism (image tiles)"

    def attach(self, ctx: DistContext, program: Program, specs: Specs, modules: Modules) -> None:
        attach_tiles(program, modules, ctx.comm)

    # a tile ignores the gradients its neighbours return for the halo rows they borrowed
    sabotages = ("drop-halo-grad",)

    def sabotage(self, what: str, modules: Modules) -> None:
        for m in modules.values():
            for sp in spatial_contexts(m):
                sp.halo_grads = False


__all__ = ["Spatial"]

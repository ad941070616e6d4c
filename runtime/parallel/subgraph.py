"""Sub-graph parallelism (SUPER) at run time: each rank holds and runs only its sub-grid's paths.

The generated stage code hands every split region to the stage's SubgraphContext
(runtime/subgraph.py); this module drops the other sub-grids' path modules before training and
gives the contexts this rank's sub-grid index and the sub-grid group once the ranks are connected.
"""

from __future__ import annotations

from runtime.context import DistContext
from runtime.parallel.base import Modules, RuntimeStrategy, Specs, StrategyName, mesh_axis
from runtime.program import Program
from runtime.subgraph import keep_own_paths, set_branch
from runtime.vocab import MeshAxis


def _sub_grid(program: Program) -> int:
    """This rank's coordinate on the subgraph axis (0 without one)."""
    axis = mesh_axis(program.mesh_dict, MeshAxis.SUBGRAPH)
    return program.coord(axis) if axis is not None else 0


class Subgraph(RuntimeStrategy):
    """Branches placed on sub-grids (the subgraph mesh axis)."""

    name = StrategyName.SUBGRAPH

    def prepare(self, program: Program, specs: Specs, modules: Modules) -> None:
        for module in modules.values():
            keep_own_paths(module, _sub_grid(program))

    def attach(self, ctx: DistContext, program: Program, specs: Specs, modules: Modules) -> None:
        axis = mesh_axis(ctx.groups, MeshAxis.SUBGRAPH)
        if axis is None:
            return
        for module in modules.values():
            set_branch(module, ctx.coord(axis), ctx.group(axis))


__all__ = ["Subgraph"]

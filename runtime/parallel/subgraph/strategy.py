"""Sub-graph parallelism (SUPER) at run time: each rank holds and runs only its sub-grid's paths.

The generated stage code hands every split region to the stage's SubgraphContext
(runtime/parallel/subgraph/regions.py); this module drops the other sub-grids' path modules before training and
gives the contexts this rank's sub-grid index and the sub-grid group once the ranks are connected.
"""

from __future__ import annotations

from runtime.comm.context import DistContext
from runtime.parallel.base import Modules, RuntimeStrategy, Specs
from runtime.program import Program
from runtime.parallel.subgraph.regions import keep_own_paths, set_branch
from runtime.vocab import MeshAxis, StrategyName


def _sub_grid(program: Program) -> int:
    """This rank's coordinate on the subgraph axis (0 without one)."""
    return program.coord(MeshAxis.SUBGRAPH) if MeshAxis.SUBGRAPH in program.mesh_dict else 0


class Subgraph(RuntimeStrategy):
    """Branches placed on sub-grids (the subgraph mesh axis)."""

    name = StrategyName.SUBGRAPH
    axis = MeshAxis.SUBGRAPH
    not_evaluated = "sub-graph parallelism (--subgraph)"

    def prepare(self, program: Program, specs: Specs, modules: Modules) -> None:
        for module in modules.values():
            keep_own_paths(module, _sub_grid(program))

    def attach(self, ctx: DistContext, program: Program, specs: Specs, modules: Modules) -> None:
        if MeshAxis.SUBGRAPH not in ctx.groups:
            return
        for module in modules.values():
            set_branch(module, ctx.coord(MeshAxis.SUBGRAPH), ctx.group(MeshAxis.SUBGRAPH))


__all__ = ["Subgraph"]

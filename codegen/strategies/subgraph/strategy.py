"""Sub-graph parallelism (SUPER) in the lowering: a rank holds only its sub-grid's paths.

The stage code itself (one method per path and per region, calling the stage's
SubgraphContext) is written by codegen/strategies/subgraph/regions.py (its stage_code hook) while the
partition cuts the stages; here a
rank's gradient buckets leave out the parameters of paths another sub-grid runs
(planner.strategies.subgraph.regions.module_owners), since the rank neither holds nor trains them.
"""

from __future__ import annotations

import functools
from typing import Callable

from codegen.stages import StageCodeMaker
from codegen.strategies.base import Lowering, LoweringStrategy, Params, RankPlan
from codegen.strategies.subgraph.regions import stage_regions
from planner.graph.model import ModelGraph
from planner.plan import Plan
from planner.strategies.subgraph.regions import module_owners
from runtime.vocab import MeshAxis, StrategyName


class Subgraph(LoweringStrategy):
    """Branches placed on sub-grids (the subgraph mesh axis)."""

    name = StrategyName.SUBGRAPH
    exchanges_in_layers = "sub-graph parallelism (--subgraph)"

    def active(self, plan: Plan) -> bool:
        return bool(plan.subgraph)

    def stage_code(self, plan: Plan, graph: ModelGraph) -> StageCodeMaker:
        """Each region a layer holds whole: one call of a method running its paths on their sub-grids."""
        return functools.partial(stage_regions, plan.subgraph)

    def param_filter(self, lw: Lowering) -> Callable[[RankPlan, Params], Params]:
        owners = module_owners(lw.graph, lw.plan.subgraph)
        axes = [a for a, _ in lw.mesh]

        def held(rp: RankPlan, params: Params) -> Params:
            grid = rp.coords[axes.index(MeshAxis.SUBGRAPH)] if MeshAxis.SUBGRAPH in axes else 0
            return [q for q in params if owners.get(q[0], owners.get(q[0].rsplit(".", 1)[0], grid)) == grid]
        return held


__all__ = ["Subgraph"]

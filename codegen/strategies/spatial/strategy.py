"""Spatial parallelism in the lowering: a plan with spatial degree s runs as its data-parallel
twin (data x s ranks on the data axis); the first stage's code runs its spatial part on image
tiles, and every rank's Program names its tile (codegen/strategies/spatial/program.py)."""

from __future__ import annotations

import functools

from codegen.stages import Partition, StageCodeMaker
from codegen.strategies.spatial.program import spatial_spec, spatial_stages, spatial_tiles, spatial_twin
from codegen.strategies.base import LoweringStrategy
from codegen.strategies.spatial.tiles import stage_tiles
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.program import Program
from runtime.vocab import StrategyName


class Spatial(LoweringStrategy):
    """Image tiles over s ranks in the first stage's spatial part."""

    name = StrategyName.SPATIAL
    exchanges_in_layers = "spatial parallelism (--spatial)"

    def active(self, plan: Plan) -> bool:
        return plan.config.spatial > 1

    def lowered_plan(self, plan: Plan) -> Plan:
        return spatial_twin(plan)

    def stage_code(self, plan: Plan, graph: ModelGraph) -> StageCodeMaker:
        """The first stage's layers up to spatial_until run on image tiles."""
        return functools.partial(stage_tiles, spatial_spec(plan, graph), graph.module)

    def rewrite_stages(self, plan: Plan, graph: ModelGraph, parts: Partition) -> Partition:
        return spatial_stages(plan, graph, parts)

    def finish_program(self, plan: Plan, graph: ModelGraph, program: Program) -> Program:
        return program.with_part(spatial_tiles(program, spatial_spec(plan, graph)))


__all__ = ["Spatial"]

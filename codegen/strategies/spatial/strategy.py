"""Spatial parallelism in the lowering: a plan with spatial degree s runs as its data-parallel
twin (data x s ranks on the data axis); the first stage's code runs its spatial part on image
tiles, and every rank's Program names its tile (codegen/strategies/spatial/program.py)."""

from __future__ import annotations

from codegen.partition import Partition
from codegen.strategies.spatial.program import spatial_spec, spatial_stages, spatial_tiles, spatial_twin
from codegen.strategies.base import LoweringStrategy
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

    def partition_options(self, plan: Plan, graph: ModelGraph) -> dict:
        return {"spatial": spatial_spec(plan, graph)}

    def rewrite_stages(self, plan: Plan, graph: ModelGraph, parts: Partition) -> Partition:
        return spatial_stages(plan, graph, parts)

    def finish_program(self, plan: Plan, graph: ModelGraph, program: Program) -> Program:
        return program.with_part(spatial_tiles(program, spatial_spec(plan, graph)))


__all__ = ["Spatial"]

"""Spatial parallelism in the lowering: a plan with spatial degree s runs as its data-parallel
twin (data x s ranks on the data axis), whose stage modules carry a SpatialSpec saying which
part of the first stage runs on image tiles (codegen/spatial.py)."""

from __future__ import annotations

from codegen.partition import Partition
from codegen.spatial import spatial_stages, spatial_twin
from codegen.strategies.base import LoweringStrategy
from planner.graph import ModelGraph
from planner.plan import Plan
from runtime.parallel.base import StrategyName


class Spatial(LoweringStrategy):
    """Image tiles over s ranks in the first stage's spatial part."""

    name = StrategyName.SPATIAL

    def active(self, plan: Plan) -> bool:
        return plan.config.spatial > 1

    def lowered_plan(self, plan: Plan) -> Plan:
        return spatial_twin(plan)

    def rewrite_stages(self, plan: Plan, graph: ModelGraph, parts: Partition) -> Partition:
        return spatial_stages(plan, graph, parts)


__all__ = ["Spatial"]

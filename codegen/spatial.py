"""Lowering a spatial plan: per-rank Programs whose stage modules run on image tiles.

A plan with spatial degree s is lowered as its data-parallel twin with data x s ranks on the
data axis and s times the global batch: every run of s consecutive data coordinates is a
pipeline lane of its own, with the loss scaled by 1/(data x s) and one gradient all-reduce per
stage over the data axis. The spatial part must lie in the first stage: its tiles are gathered
before the first pipeline cut, and the later stages run replicated on the s lanes. What makes the twin spatial is the stage's `StageSpec.spatial`: each rank keeps its
tile of the images its run of s consecutive data coordinates shares (runtime.spatial_model),
exchanges halos inside the stage module, and gathers the tiles after the spatial part with a
backward that sums the gradient over the s ranks (runtime.spatial._GatherTiles). Every gradient,
tiled and replicated layers alike, is then a partial sum that the data-axis all-reduce completes.
"""

from __future__ import annotations

import dataclasses

from codegen.partition import Partition
from codegen.strategies.base import LoweringError
from planner.capabilities import MESHPLAN_RUNTIME
from planner.graph import ModelGraph
from planner.plan import Plan
from runtime.spatial import SpatialSpec


def spatial_twin(plan: Plan) -> Plan:
    """The data-parallel plan whose Programs a spatial plan runs (see module docstring)."""
    c = plan.config
    why = MESHPLAN_RUNTIME.why_not(c)
    if why:
        raise LoweringError(f"{why}; plan within those limits (or with spatial=1)")
    twin = c.replace(data=c.data * c.spatial, spatial=1, spatial_until=None)
    return dataclasses.replace(plan, config=twin, global_batch_size=plan.global_batch_size * c.spatial)


def spatial_stages(plan: Plan, graph: ModelGraph, parts: Partition) -> Partition:
    """The twin's stage modules (`parts`, cut from spatial_twin(plan)) with their SpatialSpec."""
    c = plan.config
    layers = {layer.name: layer for layer in graph.layers}
    until = layers[c.spatial_until].nodes[-1]
    first = min(parts.stages, key=lambda sp: sp.spec.index)
    if c.spatial_until not in first.spec.layers:
        raise LoweringError(f"the spatial part ends at layer {c.spatial_until!r}, beyond the first pipeline stage "
                            f"({first.spec.layers[0]} .. {first.spec.layers[-1]}); the tiles are gathered before the "
                            "first cut: put the whole spatial part in stage 0")

    def spec_of(sp):
        until_node = until if sp is first else None
        return SpatialSpec(c.spatial, c.spatial_split, until_node, c.spatial_batchnorm)

    return dataclasses.replace(parts, stages=tuple(
        dataclasses.replace(sp, spec=dataclasses.replace(sp.spec, spatial=spec_of(sp))) for sp in parts.stages))

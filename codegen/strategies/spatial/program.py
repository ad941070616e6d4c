"""Lowering a spatial plan: per-rank Programs whose stage code runs the spatial part on image tiles.

A plan with spatial degree s is lowered on its data-parallel twin's mesh: data x s ranks on the
data axis and s times the global batch, every run of s consecutive data coordinates holding the
tiles of the same images (a pipeline lane of its own). What is shared with data parallelism is
the gradient arithmetic: the loss is scaled by 1/(data x s) and one gradient all-reduce per
stage runs over the data axis, that is over data x spatial. What is spatial is said where it
runs: the first stage's code takes this rank's tile of the images, runs its layers up to
`spatial_until` as tile ops with halo exchange (codegen/strategies/spatial/tiles.py writes them), and
gathers the tiles after them with a backward that sums the gradient over the s ranks
(runtime.parallel.spatial.tile_ops._GatherTiles), so that every gradient, tiled and replicated layers alike, is a
partial sum that the data-axis all-reduce completes. Each rank's Program names its tile and its
spatial group (runtime.parallel.spatial.part.SpatialTiles). The spatial part must lie in the first stage: the
tiles are gathered before the first pipeline cut, and the later stages run replicated on the s
lanes.
"""

from __future__ import annotations

import dataclasses

from codegen.stages import Partition
from codegen.strategies.base import LoweringError
from planner.graph.model import ModelGraph
from planner.plan import Plan
from planner.strategies.combinations import Level, why_not
from runtime.parallel.spatial.part import SpatialTiles
from runtime.program import Program
from runtime.parallel.spatial.geometry import SpatialSpec, tile_shape
from runtime.vocab import MeshAxis


def spatial_twin(plan: Plan) -> Plan:
    """The data-parallel plan whose Programs a spatial plan runs (see module docstring)."""
    c = plan.config
    why = why_not(c, Level.RUNTIME)   # the combinations the runtime runs
    if why:
        raise LoweringError(f"{why}; plan within those limits (or with spatial=1)")
    twin = c.replace(data=c.data * c.spatial, spatial=1, spatial_until=None)
    return dataclasses.replace(plan, config=twin, global_batch_size=plan.global_batch_size * c.spatial)


def spatial_spec(plan: Plan, graph: ModelGraph) -> SpatialSpec:
    """The first stage's tiling (which the partition writes into its stage code); LoweringError when
    the spatial part reaches past the first stage."""
    c = plan.config
    first = min(plan.stages, key=lambda st: st.index)
    if c.spatial_until not in first.layers:
        raise LoweringError(f"the spatial part ends at layer {c.spatial_until!r}, beyond the first pipeline stage "
                            f"({first.layers[0]} .. {first.layers[-1]}); the tiles are gathered before the "
                            "first cut: put the whole spatial part in stage 0")
    layers = {layer.name: layer for layer in graph.layers}
    return SpatialSpec(c.spatial, c.spatial_split, layers[c.spatial_until].nodes[-1], c.spatial_batchnorm)


def spatial_stages(plan: Plan, graph: ModelGraph, parts: Partition) -> Partition:
    """The twin's stage modules (`parts`, cut with spatial_spec's tiling) with their SpatialSpec:
    the first stage's tiling, and on the later stages the same degree with no spatial part (they
    run replicated on the tiles' ranks)."""
    tiles = spatial_spec(plan, graph)
    first = min(sp.spec.index for sp in parts.stages)
    after = dataclasses.replace(tiles, until=None)
    return dataclasses.replace(parts, stages=tuple(
        dataclasses.replace(sp, spec=sp.spec.with_part(tiles if sp.spec.index == first else after))
        for sp in parts.stages))


def spatial_tiles(program: Program, tiles: SpatialSpec) -> SpatialTiles:
    """The rank's tile: the run of `degree` consecutive data coordinates holding its image, in
    row-major tile order."""
    data = program.group(MeshAxis.DATA)
    k = program.coord(MeshAxis.DATA) // tiles.degree
    rows, cols = tile_shape(tiles.split, tiles.degree)
    index = program.coord(MeshAxis.DATA) % tiles.degree
    return SpatialTiles(tiles.degree, tiles.split, (rows, cols), divmod(index, cols),
                        data[k * tiles.degree:(k + 1) * tiles.degree])

"""Sub-graph parallelism (SUPER, B sub-grids), planner side: its layer cost and its search space.

Which fork/join regions are split and which sub-grid runs each path is planner/strategies/subgraph/regions.py.
A layer holding split regions costs, on each device of a sub-grid: the layer's ops
outside the regions (replicated: every sub-grid runs them on the same samples), plus the
paths of the busiest sub-grid, plus the region's collectives over the B sub-grids of the
sub-grid mesh axis: in forward one broadcast per path output (from the sub-grid that
computed it), in backward one all-reduce of the fork value's gradient. Those collectives
block the layer, so they are charged in full to the layer's in-layer communication
(`LayerCost.comm`, under the sub-grid axis; a Prediction reports them in
tensor_comm with tensor-parallel traffic). Parameters, gradients and saved activations of
a path live only on its sub-grid; a device keeps the busiest sub-grid's share. An
attention op split by heads costs 1/B of its compute per sub-grid, plus an all-gather of
its output and an all-reduce of the q, k, v gradients.
"""

from __future__ import annotations

import dataclasses

from planner.config import ConfigError, ParallelConfig
from planner.graph.model import Layer
from planner.strategies.base import Strategy
from planner.strategies.subgraph.part import SubgraphRegions
from planner.strategies.subgraph.regions import Region, RegionKind, check_splittable, split_regions
from runtime.vocab import Collective, DType, MeshAxis, ShardRole, StrategyName

# config.mesh's name for the sub-grid axis; it becomes MeshAxis.SUBGRAPH with the vocabulary's axis rename.
SUBGRID_AXIS = MeshAxis.SUBGRAPH


class SubgraphStrategy(Strategy):
    """See module docstring; regions and per-layer costs are cached in the Evaluator's state."""

    name = StrategyName.SUBGRAPH
    compiles = False
    # a layer's split regions follow its structure, so layers of one signature split alike
    layer_cost_by_signature = True

    def pinned_on(self, constraints: dict) -> bool:
        return constraints.get("subgraph", 1) != 1

    def plan_part(self, graph, config: ParallelConfig) -> SubgraphRegions | None:
        """The split regions (SubgraphError where the graph has none to split `config.subgraph` ways)."""
        regions = check_splittable(graph, config.subgraph)
        return SubgraphRegions(regions) if regions else None

    def variants(self, ev, num_devices: int, constraints: dict, shapes_of) -> list[ParallelConfig]:
        """For each B dividing the devices (2, 4, 8) whose split finds regions, every data x pipeline shape
        of num_devices / B devices (`shapes_of(n)`) that combines with sub-graphs, with subgraph=B. Empty
        for graphs without splittable branches, so other models' search spaces are unchanged."""
        if constraints.get("subgraph", None) == 1:
            return []
        degrees = [constraints["subgraph"]] if "subgraph" in constraints else \
            [b for b in (2, 4, 8) if b <= num_devices]
        out = []
        for b in degrees:
            regions = split_regions(ev.graph, b)
            # more sub-grids than the widest region has paths would leave some idle everywhere
            if num_devices % b or not regions or b > max(len(r.paths) for r in regions):
                continue
            for base in shapes_of(num_devices // b):
                try:
                    out.append(base.replace(subgraph=b))
                except ConfigError:   # a shape that does not combine with sub-graphs (combinations.py)
                    continue
        return out

    def layer_cost(self, ev, layer: Layer, cost, config: ParallelConfig):
        """`cost` (the layer's LayerCost with every op replicated) on one device of a sub-grid."""
        regions = regions_for(ev, config.subgraph).get(layer.name)
        if not regions:
            return cost
        # the same layer under the same per-device shape and mesh costs the same (the search asks often)
        key = ("cost", layer.signature, cost, config.subgraph, config.micro_batch_size, config.dtype,
               config.recompute, config.mesh_items)
        cache = _cache(ev)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = _split_cost(ev, regions, cost, config)
        return hit


def _cache(ev) -> dict:
    """This strategy's cache on the Evaluator `ev`: split regions by sub-grid count, region collective
    times and layer costs by their keys."""
    return ev.state(StrategyName.SUBGRAPH, dict)


def regions_for(ev, sub_grids: int) -> dict[str, list[Region]]:
    """The evaluator's graph's split regions for B sub-grids, by layer name."""
    cache = _cache(ev)
    if sub_grids not in cache:
        by_layer: dict[str, list[Region]] = {}
        for r in split_regions(ev.graph, sub_grids):
            by_layer.setdefault(r.layer, []).append(r)
        cache[sub_grids] = by_layer
    return cache[sub_grids]


def region_comm_seconds(ev, config: ParallelConfig, region: Region) -> tuple[float, float]:
    """(forward, backward) seconds of one region's collectives for one micro-batch:
    a broadcast of every path output, and an all-reduce of the fork value's gradient."""
    scale = config.micro_batch_size / ev.graph.batch_size * DType(config.dtype).bytes / 4
    if region.kind == RegionKind.HEADS:   # all-gather of the output along the heads; all-reduce of dq, dk, dv
        attn = ev.node(region.fork)
        sizes = ((Collective.ALL_GATHER, attn.output_bytes * scale),
                 (Collective.ALL_REDUCE, sum(m.nbytes for m in attn.input_meta) * scale))
    else:                        # a broadcast per path output; all-reduce of the fork's gradient
        sizes = (*((Collective.BROADCAST, ev.node(e).output_bytes * scale) for e in region.exits),
                 (Collective.ALL_REDUCE, ev.node(region.fork).output_bytes * scale))
    key = ("comm", sizes, config.mesh_items)   # repeated blocks move the same bytes
    cache = _cache(ev)
    hit = cache.get(key)
    if hit is None:
        times = [ev.axis_seconds(config.mesh, SUBGRID_AXIS, op, n) for op, n in sizes]
        hit = cache[key] = (sum(times[:-1]), times[-1])
    return hit


def _split_cost(ev, regions: list[Region], cost, config: ParallelConfig):
    fwd, bwd, saved, params = cost.forward, cost.backward, cost.saved, cost.params
    sub_f, sub_b = cost.on(SUBGRID_AXIS).forward, cost.on(SUBGRID_AXIS).backward
    for r in regions:
        if r.kind == RegionKind.HEADS:    # each sub-grid runs 1/B of the heads of one attention op
            c = ev.node_cost(ev.node(r.fork), ShardRole.REPLICATE, config)
            share = 1 - 1 / config.subgraph
            fwd -= c.fwd * share
            bwd -= c.bwd * share
            saved -= c.saved * share
            cf, cb = region_comm_seconds(ev, config, r)
            sub_f += cf
            sub_b += cb
            continue
        per_path = [[ev.node_cost(ev.node(x), ShardRole.REPLICATE, config) for x in path] for path in r.paths]
        tot = [sum(getattr(c, f) for cs in per_path for c in cs) for f in ("fwd", "bwd", "saved", "params")]
        by_grid = [[0.0] * 4 for _ in range(config.subgraph)]
        for cs, g in zip(per_path, r.owners):
            for k, f in enumerate(("fwd", "bwd", "saved", "params")):
                by_grid[g][k] += sum(getattr(c, f) for c in cs)
        busiest = max(by_grid, key=lambda v: v[0] + v[1])
        fwd += busiest[0] - tot[0]
        bwd += busiest[1] - tot[1]
        saved += busiest[2] - tot[2]
        params += max(v[3] for v in by_grid) - tot[3]
        cf, cb = region_comm_seconds(ev, config, r)
        sub_f += cf
        sub_b += cb
    return dataclasses.replace(cost.with_comm(SUBGRID_AXIS, sub_f, sub_b), forward=fwd, backward=bwd, saved=saved,
                               params=params, largest_param_layer=params)

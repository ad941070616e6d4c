"""Cost of sub-graph parallelism (SUPER) per layer, for the Evaluator.

A layer holding split regions (planner/subgraph.py) costs, on each device of a
sub-grid: the layer's ops outside the regions (replicated: every sub-grid runs
them on the same samples), plus the paths of the busiest sub-grid, plus the
region's collectives over the B sub-grids of the "subgraph" axis: in forward one
broadcast per path output (from the sub-grid that computed it), in backward
one all-reduce of the fork value's gradient. Those collectives block the
layer, so they are charged in full to the layer's in-layer communication
(`tp_forward` / `tp_backward`, reported as tensor_comm with tensor-parallel
traffic). Parameters, gradients and saved activations of a path live only on
its sub-grid; a device keeps the busiest sub-grid's share. An attention op split
by heads costs 1/B of its compute per sub-grid, plus an all-gather of its output
and an all-reduce of the q, k, v gradients.
"""

from __future__ import annotations

import dataclasses

from planner.config import ParallelConfig
from planner.graph import Layer
from planner.subgraph import Region, split_regions
from runtime.vocab import DType, MeshAxis


def regions_for(ev, sub_grids: int) -> dict[str, list[Region]]:
    """The evaluator's graph's split regions for B sub-grids, by layer name (cached on the
    evaluator's `subgraph_regions` dict, which this module owns)."""
    cache = ev.subgraph_regions
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
    info = ev._nodes
    if region.kind == "heads":   # all-gather of the output along the heads; all-reduce of dq, dk, dv
        attn = info[region.fork]
        sizes = (("all_gather", attn.output_bytes * scale),
                 ("all_reduce", sum(m.nbytes for m in attn.input_meta) * scale))
    else:                        # a broadcast per path output; all-reduce of the fork's gradient
        sizes = (*(("broadcast", info[e].output_bytes * scale) for e in region.exits),
                 ("all_reduce", info[region.fork].output_bytes * scale))
    key = ("comm", sizes, tuple(config.mesh.items()))   # repeated blocks move the same bytes
    hit = ev.subgraph_regions.get(key)
    if hit is None:
        times = [ev._axis(config.mesh, MeshAxis.SUBGRAPH, op, n) for op, n in sizes]
        hit = ev.subgraph_regions[key] = (sum(times[:-1]), times[-1])
    return hit


def subgraph_layer_cost(ev, layer: Layer, cost, config: ParallelConfig):
    """`cost` (the layer's LayerCost with every op replicated) on one device of a sub-grid."""
    regions = regions_for(ev, config.subgraph).get(layer.name)
    if not regions:
        return cost
    # the same layer under the same per-device shape and mesh costs the same (the search asks often)
    key = ("cost", layer.signature, cost, config.subgraph, config.micro_batch_size, config.dtype, config.recompute,
           tuple(config.mesh.items()))
    hit = ev.subgraph_regions.get(key)
    if hit is None:
        hit = ev.subgraph_regions[key] = _split_cost(ev, regions, cost, config)
    return hit


def _split_cost(ev, regions: list[Region], cost, config: ParallelConfig):
    fwd, bwd, saved, params, tp_f, tp_b = cost.forward, cost.backward, cost.saved, cost.params, \
        cost.tp_forward, cost.tp_backward
    for r in regions:
        if r.kind == "heads":    # each sub-grid runs 1/B of the heads of one attention op
            c = ev._node_cost(ev._nodes[r.fork], "replicate", config)
            share = 1 - 1 / config.subgraph
            fwd -= c.fwd * share
            bwd -= c.bwd * share
            saved -= c.saved * share
            cf, cb = region_comm_seconds(ev, config, r)
            tp_f += cf
            tp_b += cb
            continue
        per_path = [[ev._node_cost(ev._nodes[x], "replicate", config) for x in path] for path in r.paths]
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
        tp_f += cf
        tp_b += cb
    return dataclasses.replace(cost, forward=fwd, backward=bwd, saved=saved, params=params,
                               largest_param_layer=params, tp_forward=tp_f, tp_backward=tp_b)

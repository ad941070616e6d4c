"""Spatial parallelism (s tiles per image), planner side: which layers can run on tiles, what they
cost, what to search.

`SpatialPricer` turns a layer's whole-image `LayerCost` into its per-tile cost
under a ParallelConfig with spatial degree s (planner/strategies/spatial/costs.py holds the
formulas): compute, activations and the cut's bytes divided by s (compute
times the halo's extra area), halo exchanges and synchronized BatchNorm
all-reduces on the critical path, and the gather of the tiles after the last
spatial layer. The layers after it run replicated on the s devices, priced
as before. `spatial_candidates` lists the (s, split, last layer) choices worth
searching: only for graphs with 2-D convolutions, and only where every tile
keeps at least MIN_TILE_ROWS rows of the last spatial layer's output. In a
pipeline, the first stage holds the whole spatial part (the tiles are gathered
before the first cut); the tile weight gradients are summed over the s devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.strategies.spatial.costs import batchnorm_sync_bytes, halo_seconds, tile_shape, window_halo_bytes
from planner.config import ConfigError, ParallelConfig
from planner.graph.model import Layer, ModelGraph, OpInfo
from planner.stage_split import balanced_partition
from planner.strategies.base import Bounds, Fits, Strategy
from runtime.vocab import (Collective, DType, MeshAxis, OpKind, RecomputeMode, SpatialBatchNorm, SpatialSplit,
                           StrategyName)

# A tile thinner than this (rows of the last spatial layer's output) spends more on halos than it
# saves; the search does not propose it (the user may still ask for it).
MIN_TILE_ROWS = 32

_WINDOW_TARGETS = ("Conv2d", "conv2d", "MaxPool2d", "AvgPool2d", "max_pool2d", "avg_pool2d")


def _is_window(n: OpInfo) -> bool:
    return n.kind in (OpKind.CONV, OpKind.POOL) and n.target.rsplit(".", 1)[-1] in _WINDOW_TARGETS and \
        bool(n.input_meta) and len(n.input_meta[0].shape) == 4


def _tileable(n: OpInfo) -> bool:
    """Whether the generated stage code runs this node on image tiles (codegen/strategies/spatial/tiles.py)."""
    if n.kind in (OpKind.INPUT, OpKind.SCALAR):
        return True
    if _is_window(n):
        return True
    if n.kind == OpKind.NORM:
        return n.target.endswith("BatchNorm2d")
    if n.kind == OpKind.ELEMENTWISE:
        return bool(n.output_meta) and len(n.output_meta[0].shape) == 4
    return False


@dataclass(frozen=True)
class _LayerGeometry:
    windows: tuple[OpInfo, ...]
    norms: tuple[int, ...]          # channels of each BatchNorm2d
    out_hw: tuple[int, int] | None  # spatial size of the layer's last 4-D output


class SpatialPricer:
    """Per-tile layer costs for spatial configs of one graph (see module docstring)."""

    def __init__(self, graph: ModelGraph):
        self.graph = graph
        nodes = {n.name: n for n in graph.nodes}
        self.index = {layer.name: layer.index for layer in graph.layers}
        self.geometry: list[_LayerGeometry] = []
        self.tileable_prefix = 0   # leading layers that can all run on tiles
        prefix_open = True
        for layer in graph.layers:
            ops = [nodes[name] for name in layer.nodes]
            out_hw = None
            for n in ops:
                if n.output_meta and len(n.output_meta[0].shape) == 4:
                    out_hw = tuple(n.output_meta[0].shape[-2:])
            self.geometry.append(_LayerGeometry(
                tuple(n for n in ops if _is_window(n)),
                tuple(n.input_meta[0].shape[1] for n in ops if n.kind == OpKind.NORM and n.input_meta),
                out_hw))
            if prefix_open and all(_tileable(n) for n in ops):
                self.tileable_prefix += 1
            else:
                prefix_open = False
        self.has_convs = any(g.windows for g in self.geometry)
        self._cache: dict[tuple, object] = {}

    # ---- checks -----------------------------------------------------------
    def until_index(self, config: ParallelConfig) -> int:
        """Index of the last spatial layer; ConfigError naming the layer when it cannot be tiled."""
        name = config.spatial_until
        if name not in self.index:
            names = [layer.name for layer in self.graph.layers]
            raise ConfigError(f"spatial_until={name!r} is not a layer of this model; layers are: "
                              f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
        k = self.index[name]
        if k >= self.tileable_prefix:
            bad = self.graph.layers[self.tileable_prefix]
            raise ConfigError(f"spatial_until={name!r}: layer {bad.name!r} (index {bad.index}) does not run on "
                              f"image tiles (only 2-D convs, max/avg pooling, BatchNorm2d and pointwise ops do); "
                              f"end the spatial part before it"
                              + (f", at {self.graph.layers[self.tileable_prefix - 1].name!r}"
                                 if self.tileable_prefix else ""))
        rows, cols = tile_shape(config.spatial_split, config.spatial)
        for layer in self.graph.layers[:k + 1]:
            hw = self.geometry[layer.index].out_hw
            if hw is not None and (hw[0] < rows or hw[1] < cols):
                raise ConfigError(f"spatial layer {layer.name!r} outputs {hw[0]} x {hw[1]} pixels, fewer than the "
                                  f"{rows} x {cols} tiles of spatial={config.spatial} {config.spatial_split}; end the "
                                  "spatial part earlier or use fewer tiles")
        return k

    # ---- costs ------------------------------------------------------------
    def adjust(self, layer: Layer, cost, config: ParallelConfig, ev):
        """The per-tile LayerCost of `layer` (whole-image `cost`) under `config`; `ev` is the Evaluator."""
        k = self.until_index(config)
        if layer.index > k:
            return cost
        key = (layer.index, cost, config.spatial, config.spatial_split, config.spatial_until,
               config.spatial_batchnorm, config.micro_batch_size, config.dtype, config.mesh_items)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        s = config.spatial
        elem = DType(config.dtype).bytes
        scale = config.micro_batch_size / self.graph.batch_size
        mesh = config.mesh

        def spatial(op: str, nbytes: float) -> float:
            return ev.axis_seconds(mesh, MeshAxis.SPATIAL, op, nbytes)

        def p2p(nbytes: float) -> float:   # a neighbour transfer
            return spatial(Collective.P2P, nbytes)

        halo_f = 0.0
        factor = 1.0
        for n in self.geometry[layer.index].windows:
            shape = n.input_meta[0].shape
            shape = (max(shape[0] * scale, 1e-9), *shape[1:])
            padding = n.attr("padding", 0)
            if isinstance(padding, str):  # "same" keeps the size, "valid" pads nothing
                k_ = n.attr("kernel_size", 1)
                d_ = n.attr("dilation", 1)
                kk = k_[0] if isinstance(k_, tuple) else k_
                dd = d_[0] if isinstance(d_, tuple) else d_
                padding = dd * (kk - 1) // 2 if padding == "same" else 0
            hb = window_halo_bytes(shape, n.attr("kernel_size", 1), n.attr("stride", None) or n.attr("kernel_size", 1),
                                   n.attr("dilation", 1), padding, config.spatial_split, s, elem)
            halo_f += halo_seconds(hb, p2p)
            factor = max(factor, hb.compute_factor)
        bn_f = bn_b = 0.0
        if config.spatial_batchnorm == SpatialBatchNorm.SYNC:
            for ch in self.geometry[layer.index].norms:
                fb, bb = batchnorm_sync_bytes(ch)
                # forward: two dependent all-reduces (sums, then squared deviations); backward: one
                bn_f += 2 * spatial(Collective.ALL_REDUCE, fb / 2)
                bn_b += spatial(Collective.ALL_REDUCE, bb)
        gather = gather_back = 0.0
        boundary = cost.boundary / s
        if layer.index == k:  # the tiles are gathered into the full activation after this layer
            gather = spatial(Collective.ALL_GATHER, cost.boundary)
            # backward sums the full activation's gradient over the tiles (as lowered plans run,
            # codegen/strategies/spatial/program.py), then each device keeps its tile
            gather_back = spatial(Collective.ALL_REDUCE, cost.boundary)
            boundary = cost.boundary
        comm_f = halo_f + bn_f + gather
        comm_b = halo_f + bn_b + gather_back + (comm_f if config.recompute == RecomputeMode.FULL else 0.0)
        hit = dataclasses.replace(
            cost.with_comm(MeshAxis.SPATIAL, comm_f, comm_b) if comm_f or comm_b else cost,
            forward=cost.forward / s * factor, backward=cost.backward / s * factor,
            recompute=cost.recompute / s * factor,
            saved=cost.saved / s, working=cost.working / s,
            temporary=max(cost.temporary / s, 2 * cost.boundary if layer.index == k else 0.0),
            boundary=boundary)
        self._cache[key] = hit
        return hit

    def grad_sync_seconds(self, config: ParallelConfig, ev) -> float:
        """Seconds per step to sum the spatial layers' weight gradients over the tiles."""
        k = self.until_index(config)
        params = sum(layer.param_count for layer in self.graph.layers[:k + 1])
        nbytes = params * (ev.grad_reduce_bytes or DType(config.dtype).bytes)
        return ev.axis_seconds(config.mesh, MeshAxis.SPATIAL, Collective.ALL_REDUCE, nbytes)


def spatial_candidates(pricer: SpatialPricer, degree: int) -> list[tuple[str, str]]:
    """(split, last spatial layer) pairs worth searching at spatial `degree` (see module docstring).

    The last layer is taken at the end of each run of layers with one output resolution (just
    before a downsampling, and the last tileable layer): ending inside a run saves no halo and
    holds fewer tiles' worth of memory.
    """
    if degree < 2 or not pricer.has_convs or pricer.tileable_prefix == 0:
        return []
    ends = []
    geo = pricer.geometry
    last = pricer.tileable_prefix - 1
    for k in range(last + 1):
        hw = geo[k].out_hw
        nxt = geo[k + 1].out_hw if k + 1 <= last else None
        if hw is not None and (k == last or (nxt is not None and nxt != hw)):
            ends.append(k)
    out = []
    first = next(g.out_hw for g in geo if g.out_hw is not None)
    # Strips cut the longer side (fewer halo pixels); square images use horizontal strips.
    strips = SpatialSplit.STRIPS_V if first[1] > first[0] else SpatialSplit.STRIPS_H
    for split in (strips, SpatialSplit.GRID):
        if split == SpatialSplit.GRID and tile_shape(SpatialSplit.GRID, degree)[0] == 1:
            continue  # a prime degree's grid is a row of strips
        rows, cols = tile_shape(split, degree)
        for k in ends:
            h, w = geo[k].out_hw
            if h // rows >= MIN_TILE_ROWS and w // cols >= MIN_TILE_ROWS:
                out.append((split, pricer.graph.layers[k].name))
    return out


def spatial_configs(pricer: SpatialPricer, num_devices: int, cons: dict, shapes_of) -> list[ParallelConfig]:
    """Spatial variants of the search space: for each spatial degree s dividing the devices, every
    data x tensor x pipeline shape of the other num_devices / s factor (`shapes_of(n)`) with each
    (split, last spatial layer) candidate. Empty for graphs without 2-D convolutions, so the search
    space of other models is unchanged.
    """
    if cons.get("spatial", None) == 1 or not pricer.has_convs:
        return []
    degrees = [cons["spatial"]] if "spatial" in cons else [s for s in range(2, num_devices + 1) if num_devices % s == 0]
    out = []
    for s in degrees:
        if num_devices % s:
            continue
        if "spatial_until" in cons:
            cands = [(split, cons["spatial_until"]) for split in SpatialSplit]
        else:
            cands = spatial_candidates(pricer, s)
        if "spatial_split" in cons:
            cands = list(dict.fromkeys((cons["spatial_split"], until) for _, until in cands))
        if not cands:
            continue
        for base in shapes_of(num_devices // s):
            for split, until in cands:
                out.append(base.replace(spatial=s, spatial_split=split, spatial_until=until,
                                        spatial_batchnorm=cons.get("spatial_batchnorm", SpatialBatchNorm.SYNC)))
    return out


def first_stage_partition(until: int, weights: list[float], parts: int, fits, partition) -> list[tuple[int, int]]:
    """Pipeline stages whose first stage holds layers 0..until (the spatial part, gathered before the
    first cut): `partition` (stage_split.balanced_partition) over the spatial part merged into one layer.

    fits(stage, lo, hi) and the result use real layer indices.
    """
    merged = [sum(weights[:until + 1])] + list(weights[until + 1:])
    if parts > len(merged):
        raise ConfigError(f"{parts} pipeline stages, but after the spatial part (layers 0..{until}, which the "
                          f"first stage holds) only {len(merged) - 1} layers remain; use fewer stages")

    def real(j: int) -> int:
        return 0 if j == 0 else j + until

    inner = (lambda stage, lo, hi: fits(stage, real(lo), real(hi))) if fits is not None else None
    return [(real(lo), real(hi)) for lo, hi in partition(merged, parts, inner)]


class SpatialStrategy(Strategy):
    """See module docstring; the per-graph `SpatialPricer` is kept in the Evaluator's state."""

    name = StrategyName.SPATIAL
    replicates_weights = True
    compiles = False

    def pinned_on(self, constraints: dict) -> bool:
        return constraints.get("spatial", 1) != 1

    def variants(self, ev, num_devices: int, constraints: dict, shapes_of) -> list[ParallelConfig]:
        return spatial_configs(pricer(ev), num_devices, constraints, shapes_of)

    def check(self, ev, config: ParallelConfig) -> None:
        pricer(ev).until_index(config)

    def layer_cost(self, ev, layer: Layer, cost, config: ParallelConfig):
        return pricer(ev).adjust(layer, cost, config, ev)

    def stage_bounds(self, ev, config: ParallelConfig, costs: list, weights: list[float],
                     fits: Fits | None) -> Bounds | None:
        """The first stage holds the whole spatial part (also in a bidirectional pipeline)."""
        if config.num_stages == 1:
            return None
        return first_stage_partition(pricer(ev).until_index(config), weights, config.num_stages, fits,
                                     balanced_partition)

    def grad_sync(self, ev, config: ParallelConfig, params: float, window: float, m: int) -> tuple[float, float]:
        return pricer(ev).grad_sync_seconds(config, ev), 0.0


def pricer(ev) -> SpatialPricer:
    """The SpatialPricer of the Evaluator `ev`'s graph (built once per Evaluator)."""
    return ev.state(StrategyName.SPATIAL, lambda: SpatialPricer(ev.graph))

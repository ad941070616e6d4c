"""Rewrite a CNN so that its first layers run on tiles of the image (see runtime/spatial.py).

`spatialize` traces the model with torch.fx, takes every node up to and
including `until` as the spatial part, and rewrites it for this rank:

* a 4-D model input read by the spatial part is cut to this rank's tile
  (every rank reads the whole micro-batch and keeps its tile);
* Conv2d, MaxPool2d and AvgPool2d become halo-exchanging tile ops, BatchNorm2d
  a tile BatchNorm with synchronized or per-tile statistics; ReLU-like
  activations, additions and multiplications run on the tiles as they are;
* every spatial value read after the spatial part is gathered into the full
  activation on every member of the group; the layers after it run replicated
  on the group (so the gather's backward is a slice).

Full shapes come from one forward pass on the meta device. Parameters and
buffers keep their names, so a tile model's state_dict matches the model's.
Weight gradients of the spatial part are partial sums per tile:
`sum_tile_gradients` adds them over the group after backward.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from runtime.spatial import (
    SpatialBatchNorm2d,
    SpatialConv2d,
    SpatialError,
    SpatialPool2d,
    TileExchange,
    TileLayout,
    conv_windows,
    gather_tiles,
    pool_windows,
)

# Ops that act on each pixel alone, so they run on a tile unchanged.
_POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Identity,
                      nn.Hardswish, nn.ELU)
_POINTWISE_FUNCTIONS = {operator.add, operator.iadd, operator.mul, operator.sub, torch.add, torch.mul,
                        torch.relu, torch.nn.functional.relu, torch.sigmoid, torch.tanh}
_POINTWISE_METHODS = {"relu", "relu_", "add", "add_", "mul", "sigmoid", "tanh", "contiguous"}


@dataclass
class SpatialModel:
    """The rewritten module for one rank and what the training loop needs to know.

    module: forward(*inputs) as the original model, on this rank's tiles;
    spatial_params: names of the parameters whose gradients are per-tile partial sums;
    spatial_nodes: fx node names of the spatial part, in order.
    """

    module: fx.GraphModule
    spatial_params: tuple[str, ...]
    spatial_nodes: tuple[str, ...]
    layout: TileLayout


class TakeTile(nn.Module):
    """(B, C, H, W) -> this rank's tile (B, C, h, w)."""

    def __init__(self, layout: TileLayout):
        super().__init__()
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = self.layout.tile_of(x.shape[-2], x.shape[-1])
        # a copy, so that what autograd keeps of the input is the tile, not the whole image's storage
        return x[..., rows, cols].clone(memory_format=torch.contiguous_format)


class GatherTiles(nn.Module):
    """This rank's tile (B, C, h, w) -> the full (B, C, H, W), on every member of the group."""

    def __init__(self, group, layout: TileLayout, full_h: int, full_w: int, reduce: bool = False):
        super().__init__()
        self.group, self.layout, self.full_h, self.full_w, self.reduce = group, layout, full_h, full_w, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_tiles(x, self.group, self.layout, self.full_h, self.full_w, self.reduce)


def _meta_shapes(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, tuple[int, ...]]:
    """fx node name -> full output shape, from one forward pass on the meta device."""
    meta = copy.deepcopy(model).to("meta")
    gm = fx.symbolic_trace(meta)
    ShapeProp(gm).propagate(*(torch.empty(x.shape, dtype=x.dtype, device="meta") for x in inputs))
    out = {}
    for n in gm.graph.nodes:
        tm = n.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "shape"):
            out[n.name] = tuple(tm.shape)
    return out


def spatialize(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], until: str, split: str, group, comm,
               *, batchnorm: str = "sync", reduce_at_gather: bool = False) -> SpatialModel:
    """This rank's tile version of `model` (see module docstring).

    Args:
        model: the model (its modules are shared, not copied: build one per rank).
        example_inputs: full-size inputs (any batch; shapes only; meta tensors are fine).
        until: fx node name of the last node of the spatial part (nodes in graph order).
        split: "strips_h", "strips_v" or "grid"; group: the spatial group (Group); comm: the Communicator.
        batchnorm: "sync" (exact statistics over the image) or "local" (per tile).
        reduce_at_gather: the gather's backward sums the gradient over the group (for losses
            scaled by 1/s; see runtime.spatial._GatherTiles) instead of slicing it.

    Raises SpatialError naming the node or layer that cannot run on tiles.
    """
    layout = TileLayout.for_group(split, group)
    shapes = _meta_shapes(model, tuple(example_inputs))
    gm = fx.symbolic_trace(model)
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    if until not in names:
        raise SpatialError(f"spatial part ends at {until!r}, which is not a node of {type(model).__name__}; "
                           f"nodes are {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")
    cut = names.index(until)
    prefix = [n for n in nodes[:cut + 1] if n.op != "placeholder"]
    in_prefix = {n.name for n in prefix}
    params: list[str] = []
    op_id = 0
    for n in prefix:
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            layer = f"layer {n.target!r} (node {n.name})"
            if isinstance(mod, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
                src = n.args[0]
                in_shape, out_shape = shapes[src.name], shapes[n.name]
                if isinstance(mod, nn.Conv2d):
                    wh, ww = conv_windows(mod, layer)
                else:
                    wh, ww = pool_windows(mod, layer)
                ex = TileExchange.plan(comm, layout, in_shape[-2:], out_shape[-2:], wh, ww, op_id, layer)
                op_id += 1
                new = SpatialConv2d(mod, ex) if isinstance(mod, nn.Conv2d) else SpatialPool2d(mod, ex)
            elif isinstance(mod, nn.BatchNorm2d):
                new = SpatialBatchNorm2d(mod, group, batchnorm)
            elif isinstance(mod, _POINTWISE_MODULES):
                new = None
            else:
                raise SpatialError(f"{layer} is a {type(mod).__name__}, which does not run on image tiles; end the "
                                   "spatial part before it (spatial layers: Conv2d, pooling, BatchNorm2d, "
                                   "pointwise activations, additions)")
            if new is not None:
                gm.set_submodule(n.target, new)
            params += [f"{n.target}.{p}" for p, q in mod.named_parameters() if q.requires_grad]
        elif n.op == "call_function" and n.target in _POINTWISE_FUNCTIONS:
            pass
        elif n.op == "call_method" and n.target in _POINTWISE_METHODS:
            pass
        elif n.op == "get_attr":
            raise SpatialError(f"node {n.name} reads attribute {n.target!r} inside the spatial part; a tile cannot "
                               "broadcast a full-image tensor; end the spatial part before it")
        else:
            what = n.target if n.op != "call_function" else getattr(n.target, "__name__", n.target)
            raise SpatialError(f"node {n.name} ({n.op} {what}) does not run on image tiles; end the spatial part "
                               "before it")
    g = gm.graph
    # Model inputs read by the spatial part: cut to this rank's tile.
    for n in nodes:
        if n.op != "placeholder":
            continue
        users = [u for u in n.users if u.name in in_prefix]
        if not users:
            continue
        if len(shapes.get(n.name, ())) != 4:
            raise SpatialError(f"input {n.name} has shape {shapes.get(n.name)}; spatial splitting cuts (B, C, H, W) "
                               "images")
        gm.add_submodule(f"spatial_tile_{n.name}", TakeTile(layout))
        with g.inserting_after(n):
            tile = g.call_module(f"spatial_tile_{n.name}", (n,))
        for u in users:
            u.replace_input_with(n, tile)
    # Spatial values read later: gathered into the full activation.
    for n in prefix:
        late = [u for u in n.users if u.name not in in_prefix]
        if not late:
            continue
        shape = shapes.get(n.name)
        if shape is None or len(shape) != 4:
            raise SpatialError(f"node {n.name} leaves the spatial part but is not a (B, C, H, W) tensor")
        gm.add_submodule(f"spatial_gather_{n.name}", GatherTiles(group, layout, shape[-2], shape[-1],
                                                                       reduce_at_gather))
        with g.inserting_after(n):
            full = g.call_module(f"spatial_gather_{n.name}", (n,))
        for u in late:
            u.replace_input_with(n, full)
    gm.recompile()
    return SpatialModel(gm, tuple(dict.fromkeys(params)), tuple(n.name for n in prefix), layout)


def sum_tile_gradients(module: nn.Module, names: tuple[str, ...], group) -> None:
    """Add the spatial part's weight gradients over the tiles (one all-reduce of a flat buffer)."""
    if group.size == 1 or not names:
        return
    named = dict(module.named_parameters())
    grads = [named[n].grad for n in names if named[n].grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.all_reduce(flat, "sum")
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


def data_shard(coord: int, size: int, specs) -> tuple[int, int]:
    """(data shard, number of shards) of a rank whose data-axis coordinate is `coord` of `size`.

    With spatial stages the data axis holds data x s ranks and each run of s consecutive
    coordinates reads the same micro-batches (they hold tiles of the same images).
    """
    degrees = {sp.spatial.degree for sp in specs.values() if getattr(sp, "spatial", None) is not None}
    if not degrees:
        return coord, size
    (s,) = degrees
    return coord // s, size // s


def apply_to_stages(specs, modules: dict, ctx) -> None:
    """Replace every spatial stage's module (StageSpec.spatial set) by its tile version for this rank.

    The spatial group is this rank's run of s consecutive ranks on the data axis. The loss of
    such a run is scaled by 1/(data x s) (the data axis's size), so the gather sums gradients
    (see runtime.spatial._GatherTiles) and the data-axis all-reduce completes every gradient.
    """
    for index, spec in specs.items():
        sp = getattr(spec, "spatial", None)
        if sp is None or sp.until is None:  # after the spatial part: the stage runs as it is
            continue
        data = ctx.group("data")
        k = data.rank // sp.degree
        group = ctx.comm.group(tuple(data.ranks[k * sp.degree:(k + 1) * sp.degree]))
        inputs = tuple(torch.empty(b.shape, dtype=getattr(torch, b.dtype), device="meta") for b in spec.inputs)
        modules[index] = spatialize(modules[index], inputs, sp.until, sp.split, group, ctx.comm,
                                    batchnorm=sp.batchnorm, reduce_at_gather=True).module

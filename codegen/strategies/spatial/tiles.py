"""Spatial parallelism in the generated stage code (see runtime/parallel/spatial/tiles.py, codegen/strategies/spatial/program.py).

The layers of a stage's spatial part run on this rank's tile of every image, and their code
says so: every op is a call of the stage's SpatialContext (`self.spatial`) or runs on the tile
as it is,

    spatial = self.spatial
    x_tile = spatial.take(x)                                    # the tile of a model input
    features_0_conv = spatial.conv(features_0_conv_module, x_tile, op = 0, image = ((64, 64), (64, 64)))
    features_0_bn = spatial.batch_norm(features_0_bn_module, features_0_conv)
    features_0_relu = getattr(self.features, "0").relu(features_0_bn)     # pointwise: unchanged

(Conv2d, MaxPool2d and AvgPool2d exchange halos, BatchNorm2d takes the whole image's or the
tile's statistics; ReLU-like activations, additions and multiplications run on the tiles), and
the stage's forward gathers, right after the spatial part, every value a later layer reads:

    features_3_relu = self.spatial.gather(features_3_relu, (32, 32))

Everything is decided here, at build time: which nodes run on tiles, the message-tag slot of
each window op, the full image sizes, and whether the tiles can hold the halos. The runtime
only gives the SpatialContext its tile and group (runtime.parallel.spatial.tiles.attach_tiles).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from runtime.parallel.spatial.tile_ops import conv_windows, pool_windows
from runtime.parallel.spatial.tiles import SpatialContext
from codegen.stages import PartitionError, StageCut
from codegen.stage_parts import StageCodePart
from runtime.parallel.spatial.geometry import SpatialError, SpatialSpec, axis_halos, tile_shape

# Ops that act on each pixel alone, so they run on a tile unchanged.
_POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Identity,
                      nn.Hardswish, nn.ELU)
_POINTWISE_FUNCTIONS = {operator.add, operator.iadd, operator.mul, operator.sub, torch.add, torch.mul,
                        torch.relu, torch.nn.functional.relu, torch.sigmoid, torch.tanh}
_POINTWISE_METHODS = {"relu", "relu_", "add", "add_", "mul", "sigmoid", "tanh", "contiguous"}

CONTEXT = "spatial"   # the stage module's attribute holding its SpatialContext


@dataclass
class TileRewrite:
    """Writes the nodes of a spatial part into new fx graphs as calls of the SpatialContext.

    degree, split: the tiles of every image; module_of: module path -> the model's module;
    shape_of: node name -> full output shape (one micro-batch), or None for a non-tensor.
    """

    degree: int
    split: str
    module_of: Callable[[str], nn.Module]
    shape_of: Callable[[str], tuple[int, ...] | None]
    ops: int = 0                                    # window ops written so far (their tag slots)
    _per_graph: dict = field(default_factory=dict)  # graph -> {"spatial" node, tiles taken}

    def _local(self, g: fx.Graph) -> dict:
        return self._per_graph.setdefault(g, {})

    def context(self, g: fx.Graph) -> fx.Node:
        """`spatial = self.spatial`, once per graph."""
        local = self._local(g)
        if CONTEXT not in local:
            local[CONTEXT] = g.create_node("get_attr", CONTEXT, name=CONTEXT)
        return local[CONTEXT]

    def take(self, g: fx.Graph, x: fx.Node, name: str) -> fx.Node:
        """This rank's tile of the model input `name` (node x in g), once per graph."""
        local = self._local(g)
        key = ("take", name)
        if key not in local:
            shape = self.shape_of(name)
            if shape is None or len(shape) != 4:
                raise SpatialError(f"input {name} has shape {shape}; spatial splitting cuts (B, C, H, W) images")
            local[key] = g.create_node("call_method", "take", (self.context(g), x), name=f"{name}_tile")
        return local[key]

    def node(self, g: fx.Graph, n: fx.Node, arg: Callable[[fx.Node], fx.Node]) -> fx.Node:
        """n (a node of the spatial part) written into g as it runs on the tiles; arg maps n's inputs
        to g's nodes (a model input read here is cut to this rank's tile)."""
        def tile_arg(a: fx.Node) -> fx.Node:
            return self.take(g, arg(a), a.name) if a.op == "placeholder" else arg(a)

        if n.op == "call_module":
            mod = self.module_of(str(n.target))
            layer = f"layer {n.target!r} (node {n.name})"
            if isinstance(mod, _POINTWISE_MODULES):
                return g.node_copy(n, tile_arg)
            if isinstance(mod, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
                src = n.args[0]
                image = (tuple(self.shape_of(src.name)[-2:]), tuple(self.shape_of(n.name)[-2:]))
                self._check_halos(mod, image, layer)
                method = "conv" if isinstance(mod, nn.Conv2d) else "pool"
                call = g.create_node("call_method", method, (self.context(g), self._module(g, n), tile_arg(src)),
                                     {"op": self.ops, "image": image}, name=n.name)
                self.ops += 1
                return call
            if isinstance(mod, nn.BatchNorm2d):
                return g.create_node("call_method", "batch_norm",
                                     (self.context(g), self._module(g, n), tile_arg(n.args[0])), name=n.name)
            raise SpatialError(f"{layer} is a {type(mod).__name__}, which does not run on image tiles; end the "
                               "spatial part before it (spatial layers: Conv2d, pooling, BatchNorm2d, "
                               "pointwise activations, additions)")
        if (n.op == "call_function" and n.target in _POINTWISE_FUNCTIONS) or \
                (n.op == "call_method" and n.target in _POINTWISE_METHODS):
            return g.node_copy(n, tile_arg)
        if n.op == "get_attr":
            raise SpatialError(f"node {n.name} reads attribute {n.target!r} inside the spatial part; a tile cannot "
                               "broadcast a full-image tensor; end the spatial part before it")
        what = n.target if n.op != "call_function" else getattr(n.target, "__name__", n.target)
        raise SpatialError(f"node {n.name} ({n.op} {what}) does not run on image tiles; end the spatial part "
                           "before it")

    def full_size(self, name: str) -> tuple[int, int]:
        """(H, W) of a spatial value a later layer reads (it is gathered there)."""
        shape = self.shape_of(name)
        if shape is None or len(shape) != 4:
            raise SpatialError(f"node {name} leaves the spatial part but is not a (B, C, H, W) tensor")
        return tuple(shape[-2:])

    def _module(self, g: fx.Graph, n: fx.Node) -> fx.Node:
        return g.create_node("get_attr", n.target, name=f"{n.name}_module")

    def _check_halos(self, mod: nn.Module, image, layer: str) -> None:
        """SpatialError naming the layer when a tile could not hold what its neighbours need."""
        wh, ww = (conv_windows if isinstance(mod, nn.Conv2d) else pool_windows)(mod, layer)
        rows, cols = tile_shape(self.split, self.degree)
        (h_in, w_in), (h_out, w_out) = image
        axis_halos(h_in, h_out, rows, wh, layer=layer)
        axis_halos(w_in, w_out, cols, ww, layer=layer)


@dataclass(frozen=True)
class StageTiles(StageCodePart):
    """The spatial part of one stage, for codegen/partition.py: the stage's `layers` that run on
    tiles (a prefix of its layers, in model order), the SpatialContext's BatchNorm mode, and the
    rewrite that writes their nodes."""

    layers: frozenset[str]
    batchnorm: str
    rewrite: TileRewrite

    def init_line(self) -> tuple[str, dict]:
        """The __init__ line that creates the stage's SpatialContext, and its global."""
        return (f"        self.{CONTEXT} = SpatialContext(batchnorm={str(self.batchnorm)!r})",
                {"SpatialContext": SpatialContext})

    def gather_lines(self, produced_in: dict[str, str], needed_after: dict[str, int], end: int) -> list[str]:
        """The forward's lines, right after the spatial part's last layer (index `end`), that replace
        every spatial value a later layer or the stage's output reads (needed_after: value -> index
        of its last reader; produced_in: value -> its layer) by the full activation."""
        late = [v for v, L in produced_in.items() if L in self.layers and needed_after.get(v, -1) > end]
        return [f"        {v} = self.{CONTEXT}.gather({v}, {self.rewrite.full_size(v)!r})" for v in late]

    # ---- its part in the stage's code (codegen/stage_parts.StageCodePart) ----------------------------
    def layer(self, name: str, body: list[fx.Node]) -> bool:
        """Whether layer `name` runs on tiles."""
        return name in self.layers

    def copy(self, lg: fx.Graph, n: fx.Node, arg: Callable[[fx.Node], fx.Node]) -> fx.Node:
        """A tiled layer's node as it runs on the tile (TileRewrite.node)."""
        return self.rewrite.node(lg, n, arg)

    def after(self, i: int, layers: list[str], produced_in: dict[str, str],
              needed_after: dict[str, int]) -> list[str]:
        """After the spatial part's last layer: the full activations of what later layers read."""
        if layers[i] in self.layers and not any(x in self.layers for x in layers[i + 1:]):
            return self.gather_lines(produced_in, needed_after, i)
        return []

    def finish(self) -> tuple[list[str], list[str], dict]:
        """The stage's SpatialContext."""
        line, globs = self.init_line()
        return [], [line], globs


def stage_tiles(spatial: SpatialSpec | None, gm: fx.GraphModule, cut: StageCut) -> dict[int, StageTiles]:
    """stage -> its spatial part (a StageCodePart for codegen/partition.py): the stage holding node
    `spatial.until` runs its layers up to that node's layer on image tiles. gm: the captured model."""
    if spatial is None or spatial.until is None:
        return {}
    layer_of, stage_of, known, lv = cut.layer_of, cut.stage_of, cut.known, cut.res.local_values
    if spatial.until not in stage_of:
        raise PartitionError(f"the spatial part ends at node {spatial.until!r}, which is not a node of the model")
    s = stage_of[spatial.until]
    last = known.index(layer_of[spatial.until])
    layers = frozenset(L for L in known[:last + 1] if cut.stage_of_layer[L] == s)

    def shape_of(name: str) -> tuple[int, ...] | None:
        v = lv.get(name)
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    return {s: StageTiles(layers, spatial.batchnorm, TileRewrite(spatial.degree, spatial.split, gm.get_submodule,
                                                                 shape_of))}


def full_shapes(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[fx.GraphModule, dict]:
    """(model traced with fx, node name -> full output shape) from one forward pass on the meta device."""
    gm = fx.symbolic_trace(model)
    meta = fx.symbolic_trace(copy.deepcopy(model).to("meta"))
    ShapeProp(meta).propagate(*(torch.empty(x.shape, dtype=x.dtype, device="meta") for x in inputs))
    shapes = {}
    for n in meta.graph.nodes:
        tm = n.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "shape"):
            shapes[n.name] = tuple(tm.shape)
    return gm, shapes


def tile_model(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], until: str, split: str, degree: int,
               *, batchnorm: str = "sync") -> fx.GraphModule:
    """`model` with every node up to and including `until` (an fx node name) on image tiles, as a
    GraphModule whose code calls its SpatialContext (`.spatial`; runtime.parallel.spatial.tiles), for runs and
    measurements of a whole model outside a build (tests/spatial_cases.py, benchmarks).

    The model's modules are shared, not copied (build one per rank); example_inputs: full-size
    inputs (shapes only; meta tensors are fine). Give the result's `.spatial` its tile before
    the first forward (SpatialContext.attach). Raises SpatialError naming what cannot run on tiles.
    """
    gm, shapes = full_shapes(model, tuple(example_inputs))
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    if until not in names:
        raise SpatialError(f"spatial part ends at {until!r}, which is not a node of {type(model).__name__}; "
                           f"nodes are {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")
    prefix = {n.name for n in nodes[:names.index(until) + 1] if n.op != "placeholder"}
    rw = TileRewrite(degree, split, gm.get_submodule, shapes.get)
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    gathered: dict[str, fx.Node] = {}

    def late(a: fx.Node) -> fx.Node:   # a spatial value read after the spatial part: the full activation
        if a.name not in prefix:
            return env[a.name]
        if a.name not in gathered:
            gathered[a.name] = g.call_method("gather", (rw.context(g), env[a.name], rw.full_size(a.name)))
        return gathered[a.name]

    for n in nodes:
        env[n.name] = rw.node(g, n, lambda a: env[a.name]) if n.name in prefix else g.node_copy(n, late)
    gm.spatial = SpatialContext(batchnorm)
    return fx.GraphModule(gm, g, class_name=type(model).__name__)

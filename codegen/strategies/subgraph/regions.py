"""Sub-graph parallelism in the generated stage code (see planner/strategies/subgraph/regions.py, runtime/parallel/subgraph/regions.py).

A split region of a layer becomes one call in that layer's method,

    subgraph_0 = self.subgraph_0(stem_relu)          # all path outputs, in path order
    blocks_0_b1_relu = subgraph_0[0]; ...

and the stage class gets one method per path (the path's nodes, from the fork
value to its exit) and one per region, which hands the paths to the stage's
SubgraphContext: a sub-grid runs only the paths it owns and receives the
others' outputs. Every rank runs the same code; which paths it runs, and which
modules it holds, follow from its coordinate on the sub-graph axis of its Program's mesh
(MeshAxis.SUBGRAPH): the stage code names the sub-grid of every path, the Program the
rank's sub-grid.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from codegen.stages import StageCut
from codegen.pysrc import graph_method
from codegen.stage_parts import StageCodePart
from planner.strategies.subgraph.regions import Region, RegionKind
from runtime.parallel.subgraph.regions import SubgraphContext


@dataclass(frozen=True)
class RegionCode:
    """One region as the stage code needs it: the plan's Region, a method name, and the
    shape and dtype of each path output per micro-batch."""

    region: Region
    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


def region_code(regions: tuple[Region, ...], local_values: dict) -> list[RegionCode]:
    """RegionCode for every region, with exit shapes from the partition's meta run."""
    out = []
    for k, r in enumerate(regions):
        vals = [local_values[e] for e in r.exits]
        for e, v in zip(r.exits, vals):
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"path exit {e!r} of the region at {r.fork!r} is not a tensor; "
                                 "sub-graph parallelism splits tensor-valued paths only")
        out.append(RegionCode(r, f"subgraph_{k}", tuple(tuple(v.shape) for v in vals),
                              tuple(str(v.dtype).removeprefix("torch.") for v in vals)))
    return out


def layer_regions(codes: list[RegionCode], layer: str, body: list[fx.Node]) -> dict[str, RegionCode]:
    """The regions held whole by this layer's body, keyed by their first path node (in body order)."""
    names = [n.name for n in body]
    pos = {x: i for i, x in enumerate(names)}
    out = {}
    for c in codes:
        nodes = [x for p in c.region.paths for x in p]
        if c.region.layer == layer and all(x in pos for x in nodes):
            out[min(nodes, key=pos.__getitem__)] = c
    return out


def skipped_nodes(regions: dict[str, RegionCode]) -> set[str]:
    return {x for c in regions.values() for p in c.region.paths for x in p}


def region_inputs(code: RegionCode, nodes: dict[str, fx.Node]) -> list[str]:
    """The values the region call reads: the fork value (paths), or q, k, v (heads)."""
    if code.region.kind == RegionKind.HEADS:
        return [a.name for a in nodes[code.region.fork].args[:3]]
    return [code.region.fork]


def insert_region_call(lg: fx.Graph, env: dict, code: RegionCode, nodes: dict[str, fx.Node]) -> None:
    """Add `self.<region>(inputs)` to the layer graph `lg`, and one getitem per path exit
    (heads: the call's value is the attention output)."""
    call = lg.call_module(code.name, tuple(env[a] for a in region_inputs(code, nodes)))
    if code.region.kind == RegionKind.HEADS:
        env[code.region.fork] = call
        return
    for k, e in enumerate(code.region.exits):
        env[e] = lg.call_function(operator.getitem, (call, k))


def region_methods(code: RegionCode, nodes: dict[str, fx.Node]) -> tuple[list[str], dict, dict[str, int]]:
    """(method sources, their globals, module path or directly read weight -> owning sub-grid) for one region."""
    r = code.region
    if r.kind == RegionKind.HEADS:
        return _heads_method(code, nodes[r.fork])
    methods, globs, owners = [], {}, {}
    names = []
    for k, (path, exit_) in enumerate(zip(r.paths, r.exits)):
        pg = fx.Graph()
        env = {r.fork: pg.placeholder(r.fork)}

        def arg(a: fx.Node, env=env, pg=pg) -> fx.Node:
            if a.name not in env:          # a parameter read directly: copy its get_attr
                env[a.name] = pg.node_copy(a)
            return env[a.name]

        for x in path:
            n = nodes[x]
            env[x] = pg.node_copy(n, arg)
            if n.op == "call_module":
                owners[str(n.target)] = r.owners[k]
            for a in n.all_input_nodes:   # a weight the path reads directly (torch.export) is its own too
                if a.op == "get_attr":
                    owners[str(a.target)] = r.owners[k]
        pg.output(env[exit_])
        name = f"{code.name}_path_{k}"
        src, gl = graph_method(pg, name)
        methods.append(f"    # path {k} of {code.name} (sub-grid {r.owners[k]}): {path[0]} .. {exit_}\n" + src)
        globs.update(gl)
        names.append(name)
    paths = ", ".join(f"self.{n}" for n in names)
    methods.insert(0, (
        f"    # ---- {code.name}: fork {r.fork} -> join {r.join}, {len(r.paths)} paths over sub-grids "
        f"{sorted(set(r.owners))} ----\n"
        f"    def {code.name}(self, {r.fork}):\n"
        f"        return self.subgraph.region({r.fork}, ({paths},), owners={tuple(r.owners)!r},\n"
        f"                                    shapes={code.shapes!r}, dtypes={code.dtypes!r})\n"))
    return methods, globs, owners


def _heads_method(code: RegionCode, n: fx.Node) -> tuple[list[str], dict, dict[str, int]]:
    r = code.region
    if len(n.args) != 3 or any(isinstance(v, fx.Node) for v in n.kwargs.values()):
        raise ValueError(f"{n.name}: only attention called as fn(q, k, v, **constants) splits by heads")
    fn = f"{code.name}_fn"
    q, k, v = (a.name for a in n.args)
    h = r.heads // len(r.paths)
    src = (f"    # ---- {code.name}: {n.name}, {r.heads} heads in groups of {h}, group g on sub-grid g ----\n"
           f"    def {code.name}(self, {q}, {k}, {v}):\n"
           f"        return self.subgraph.heads({fn}, {q}, {k}, {v}, {dict(n.kwargs)!r})\n")
    return [src], {fn: n.target}, {}


class StageRegions(StageCodePart):
    """Sub-graph parallelism's part in one stage's code (codegen/stage_parts.StageCodePart): a region a
    layer holds whole is one call of a method that runs its paths on their sub-grids (region_methods),
    and a stage with regions creates its SubgraphContext.

    codes: every region's RegionCode; nodes: the partition's graph's nodes by name."""

    def __init__(self, codes: list[RegionCode], nodes: dict[str, fx.Node]) -> None:
        self._codes, self._nodes = codes, nodes
        self._regions: dict[str, RegionCode] = {}   # the current layer's, by first path node
        self._skipped: set[str] = set()
        self._methods: list[str] = []
        self._owners: dict[str, int] = {}

    def layer(self, name: str, body: list[fx.Node]) -> bool:
        """Whether layer `name` holds a region whole (its nodes then written here)."""
        self._regions = layer_regions(self._codes, name, body)
        self._skipped = skipped_nodes(self._regions)
        return bool(self._regions)

    def writes(self, name: str) -> bool:
        return name in self._skipped

    def write(self, name: str, lg: fx.Graph, env: dict[str, fx.Node], need: Callable[[str], None]) -> dict:
        """At a region's first path node: the region's call (its other nodes are the paths' methods)."""
        code = self._regions.get(name)
        if code is None:
            return {}
        for a in region_inputs(code, self._nodes):
            need(a)
        insert_region_call(lg, env, code, self._nodes)
        src, globs, owners = region_methods(code, self._nodes)
        self._methods += src
        self._owners.update(owners)
        return globs

    def finish(self) -> tuple[list[str], list[str], dict]:
        """The region methods, and the stage's SubgraphContext where it has any."""
        if not self._methods:
            return [], [], {}
        line, globs = subgraph_init(self._owners)
        return self._methods, [line], globs


def stage_regions(regions: tuple[Region, ...], cut: StageCut) -> dict[int, StageRegions]:
    """Every stage's StageRegions (codegen/partition.py), with the regions' exit shapes from the cut's meta
    run; none without regions."""
    codes = region_code(regions, cut.res.local_values) if regions else []
    if not codes:
        return {}
    nodes = {n.name: n for n in cut.res.graph.nodes}
    return {s: StageRegions(codes, nodes) for s in cut.stages}


def subgraph_init(owners: dict[str, int]) -> tuple[str, dict]:
    """The __init__ line that creates the stage's SubgraphContext, and its global."""
    return f"        self.subgraph = SubgraphContext({owners!r})", {"SubgraphContext": SubgraphContext}

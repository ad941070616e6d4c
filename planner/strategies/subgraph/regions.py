"""Sub-graph parallelism (SUPER): which fork/join regions are split, and which sub-grid runs each path.

With `ParallelConfig.subgraph` = B the devices of every data replica form B
sub-grids (the "subgraph" mesh axis). Ops outside the split regions run
replicated on all B sub-grids, on the same samples. Inside a region, the
independent paths of a `Branch` are dealt to the sub-grids (longest first,
each to the least loaded, by forward + backward FLOPs); a sub-grid runs only
its paths, over the whole batch shard. At the region's exit every path output
is broadcast from the sub-grid that computed it, so the join (and everything
after it) sees all of them; in backward the gradient of the fork value is
all-reduced over the B sub-grids (each holds the part its paths contribute).

A region qualifies when its paths are the only readers of what they compute
(one exit node each), read nothing from outside but the fork value, and lie in
one layer; overlapping branches keep the first. An attention op's heads (a
"heads" Branch: scaled-dot-product attention on (batch, heads, T, d) q, k, v,
no mask, no dropout) split into B equal groups: sub-grid g runs heads
[g H/B, (g+1) H/B) over the whole batch, the outputs are all-gathered along the
heads, and in backward the gradients of q, k and v (each sub-grid holds its
heads' slice) are all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from planner.graph.model import BranchKind, ModelGraph
from runtime.vocab import OpKind


class SubgraphError(ValueError):
    """A sub-graph split that cannot be made; the message says what to change."""


class RegionKind(StrEnum):
    """What a Region's paths are: chains of nodes (a "parallel" Branch), or head groups of one attention op."""

    PATHS = "paths"
    HEADS = "heads"


@dataclass(frozen=True)
class Region:
    """One split fork/join region.

    fork: the fx node whose value every path reads; join: the node that reads the paths'
    outputs. paths: node names of each path (graph order). exits: each path's output node.
    owners: the sub-grid (branch coordinate, 0..B-1) that runs each path. layer: the layer
    holding the paths. cost: forward + backward FLOPs of each path (per captured batch).
    kind "heads": fork = join = the attention node; path g is head group g (heads/B heads
    of `heads`), run by sub-grid g.
    """

    fork: str
    join: str
    layer: str
    paths: tuple[tuple[str, ...], ...]
    exits: tuple[str, ...]
    owners: tuple[int, ...]
    cost: tuple[float, ...]
    kind: RegionKind = RegionKind.PATHS
    heads: int = 0

    def to_dict(self) -> dict:
        return {"fork": self.fork, "join": self.join, "layer": self.layer,
                **({"kind": str(self.kind), "heads": self.heads} if self.kind == RegionKind.HEADS else {}),
                "paths": [{"nodes": list(p), "exit": e, "sub_grid": o, "flops": c}
                          for p, e, o, c in zip(self.paths, self.exits, self.owners, self.cost)]}

    @classmethod
    def read(cls, f) -> "Region":
        """From a checked document reader (runtime.documents.Fields)."""
        paths = f.data.get("paths")
        if not isinstance(paths, list) or len(paths) < 2:
            raise f.error("paths", "must list at least two paths")
        nodes, exits, owners, cost = [], [], [], []
        for k, p in enumerate(paths):
            if not isinstance(p, dict) or not isinstance(p.get("nodes"), list) or not p["nodes"] \
                    or not all(isinstance(x, str) for x in p["nodes"]) or not isinstance(p.get("exit"), str) \
                    or not isinstance(p.get("sub_grid"), int) or isinstance(p.get("sub_grid"), bool) \
                    or p["sub_grid"] < 0 or not isinstance(p.get("flops"), (int, float)):
                raise f.error(f"paths[{k}]", "must be {nodes: [names], exit: name, sub_grid: int >= 0, flops}")
            nodes.append(tuple(p["nodes"]))
            exits.append(p["exit"])
            owners.append(p["sub_grid"])
            cost.append(float(p["flops"]))
        kind = f.text("kind") if "kind" in f.data else RegionKind.PATHS
        if kind not in tuple(RegionKind):
            raise f.error("kind", f"is {kind!r}; known: {', '.join(RegionKind)}")
        kind = RegionKind(kind)
        heads = f.integer("heads", minimum=1) if kind == RegionKind.HEADS else 0
        if kind == RegionKind.HEADS and heads % len(nodes):
            raise f.error("heads", f"is {heads}, not a multiple of its {len(nodes)} head groups")
        return cls(fork=f.text("fork"), join=f.text("join"), layer=f.text("layer"), paths=tuple(nodes),
                   exits=tuple(exits), owners=tuple(owners), cost=tuple(cost), kind=kind, heads=heads)


def split_regions(graph: ModelGraph, sub_grids: int) -> tuple[Region, ...]:
    """The regions of `graph` split over `sub_grids` sub-grids, paths dealt longest first."""
    if sub_grids < 2:
        return ()
    info = {n.name: n for n in graph.nodes}
    layer_of = {name: layer.name for layer in graph.layers for name in layer.nodes}
    users: dict[str, set[str]] = {n.name: set() for n in graph.nodes}
    for n in graph.nodes:
        for a in n.inputs:
            if a in users:
                users[a].add(n.name)
    taken: set[str] = set()
    out = []
    for br in graph.branches:
        if br.kind != BranchKind.PARALLEL or len(br.paths) < 2:
            continue
        nodes = {x for p in br.paths for x in p}
        if nodes & taken or len({layer_of.get(x) for x in nodes}) != 1:
            continue
        exits, ok = [], True
        for p in br.paths:
            inside = set(p)
            if any(a not in inside and a != br.fork and info[a].kind not in (OpKind.PARAM, OpKind.SCALAR)
                   for x in p for a in info[x].inputs if a in info):
                ok = False
                break
            leaving = [x for x in p if users[x] - inside]
            if len(leaving) != 1 or any(info[x].kind in (OpKind.PARAM, OpKind.SCALAR) for x in p):
                ok = False
                break
            exits.append(leaving[0])
        if not ok:
            continue
        cost = tuple(float(sum(info[x].fwd_flops + info[x].bwd_flops for x in p)) for p in br.paths)
        load = [0.0] * sub_grids
        owners = [0] * len(br.paths)
        for k in sorted(range(len(cost)), key=lambda k: (-cost[k], k)):
            g = min(range(sub_grids), key=lambda i: (load[i], i))
            owners[k] = g
            load[g] += cost[k]
        taken |= nodes
        out.append(Region(br.fork, br.join, layer_of[next(iter(nodes))], tuple(br.paths), tuple(exits),
                          tuple(owners), cost))
    for br in graph.branches:
        n = info.get(br.fork)
        if br.kind != BranchKind.HEADS or n is None or br.fork in taken or br.width % sub_grids or \
                not _plain_attention(n):
            continue
        taken.add(br.fork)
        share = float(n.fwd_flops + n.bwd_flops) / sub_grids
        out.append(Region(br.fork, br.fork, layer_of[br.fork], ((br.fork,),) * sub_grids, (br.fork,) * sub_grids,
                          tuple(range(sub_grids)), (share,) * sub_grids, kind=RegionKind.HEADS, heads=br.width))
    return tuple(out)


def _plain_attention(n) -> bool:
    """Scaled-dot-product attention on three (batch, heads, T, d) tensors, no mask, no dropout:
    what runtime.parallel.subgraph.regions splits by heads."""
    return (n.op == "call_function" and "scaled_dot_product_attention" in n.target and len(n.inputs) == 3
            and len(n.input_meta) == 3 and all(len(m.shape) == 4 for m in n.input_meta)
            and not n.attr("dropout_p") and n.attr("attn_mask") is None)


def check_splittable(graph: ModelGraph, sub_grids: int) -> tuple[Region, ...]:
    """split_regions, or SubgraphError when the model has nothing to split."""
    regions = split_regions(graph, sub_grids)
    if sub_grids > 1 and not regions:
        kinds = sorted({b.kind for b in graph.branches})
        raise SubgraphError(f"subgraph={sub_grids} needs fork/join branches whose paths are independent, or "
                            f"attention heads divisible by {sub_grids}; {graph.model_class} has "
                            + (f"only {', '.join(kinds)} branches that do not split {sub_grids} ways" if kinds
                               else "none") + "; use another subgraph degree or 1")
    return regions


def module_owners(graph: ModelGraph, regions: tuple[Region, ...]) -> dict[str, int]:
    """Module path (or, for a weight an ATen graph reads directly, its name) -> the sub-grid that
    holds it, for everything called or read inside a split path."""
    info = {n.name: n for n in graph.nodes}
    out: dict[str, int] = {}
    for r in regions:
        for path, owner in zip(r.paths, r.owners):
            for x in path:
                if info[x].op == "call_module" and info[x].module_path:
                    out[info[x].module_path] = owner
                for i in info[x].inputs:   # torch.export: the op reads its weight through a get_attr
                    if i in info and info[i].op == "get_attr" and info[i].kind == OpKind.PARAM:
                        out[info[i].target] = owner
    return out


def describe_regions(regions: tuple[Region, ...], sub_grids: int) -> list[str]:
    """One line per region: which sub-grid runs which paths (for summary and explain)."""
    lines = []
    for r in regions:
        if r.kind == RegionKind.HEADS:
            h = r.heads // len(r.paths)
            lines.append(f"{r.layer}: {r.fork} heads " + "; ".join(f"{g * h}-{g * h + h - 1} on sub-grid {g}"
                                                                   for g in r.owners))
            continue
        groups = {g: [r.exits[k] for k in range(len(r.paths)) if r.owners[k] == g] for g in range(sub_grids)}
        lines.append(f"{r.layer}: " + "; ".join(f"sub-grid {g}: {', '.join(v) if v else '(idle)'}"
                                                for g, v in groups.items()))
    return lines

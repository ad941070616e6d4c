"""Find `Branch`es: fork/join regions whose paths are independent.

For every activation with two or more consumers (a fork), the join is its
immediate post-dominator in the activation graph: the first node every path
from the fork must pass. The nodes strictly between fork and join split into
connected components; two or more components that each do real compute are
independent branches (Inception modules, separate q/k/v projections,
experts wired in parallel). A plain residual connection has one component
and is not a branch. Attention ops add a "heads" branch: their heads are
independent by construction.
"""

from __future__ import annotations

from planner.graph.model import Branch, BranchKind, OpInfo
from planner.graph.layers import NodeView
from runtime.vocab import OpKind

_EXIT = "__exit__"


def find_branches(infos: tuple[OpInfo, ...], views: list[NodeView]) -> tuple[Branch, ...]:
    by_name = {i.name: i for i in infos}
    order = {v.name: k for k, v in enumerate(views)}
    order[_EXIT] = len(views)
    # The activation DAG: tensor-producing nodes only (no parameters, no shape arithmetic).
    act = {v.name for v in views if by_name[v.name].kind not in (OpKind.PARAM, OpKind.SCALAR) and
           (by_name[v.name].output_meta or v.op == "output")}
    succ = {v.name: [u for u in v.users if u in act] for v in views if v.name in act}
    pred: dict[str, list[str]] = {n: [] for n in succ}
    for n, us in succ.items():
        for u in us:
            pred[u].append(n)

    ipdom = _post_dominators(succ, order)
    module_of = {v.name: v.module_path for v in views}

    branches: list[Branch] = []
    for f, users in succ.items():
        if len(users) < 2:
            continue
        join = ipdom.get(f, _EXIT)
        if join == _EXIT:
            continue
        region = _region(f, join, succ)
        comps = _components(region, succ, pred)
        real = [c for c in comps if any(by_name[n].is_compute for n in c)]
        if len(real) >= 2:
            # in graph order (the components come out of sets): the same model gives the same plan file
            paths = tuple(sorted((tuple(sorted(c, key=order.__getitem__)) for c in real),
                                 key=lambda p: order[p[0]]))
            branches.append(Branch(kind=BranchKind.PARALLEL, fork=f, join=join, paths=paths,
                                   width=len(paths), module_path=module_of.get(join, "")))

    for info in infos:
        if info.kind == OpKind.ATTENTION and info.input_meta and len(info.input_meta[0].shape) == 4:
            heads = info.input_meta[0].shape[1]  # q: (B, H, T, D)
            if heads > 1:
                branches.append(Branch(kind=BranchKind.HEADS, fork=info.name, join=info.name, paths=(),
                                       width=heads, module_path=info.module_path))
    return tuple(branches)


def _post_dominators(succ: dict[str, list[str]], order: dict[str, int]) -> dict[str, str]:
    """Immediate post-dominator of every node of a DAG (sinks post-dominated by a virtual exit)."""
    ipdom: dict[str, str] = {_EXIT: _EXIT}

    def intersect(a: str, b: str) -> str:
        while a != b:
            while order[a] < order[b]:
                a = ipdom[a]
            while order[b] < order[a]:
                b = ipdom[b]
        return a

    for n in sorted(succ, key=order.__getitem__, reverse=True):
        us = succ[n]
        if not us:
            ipdom[n] = _EXIT
            continue
        cur = us[0]
        for u in us[1:]:
            cur = intersect(cur, u)
        ipdom[n] = cur
    return ipdom


def _region(fork: str, join: str, succ: dict[str, list[str]]) -> set[str]:
    """Nodes reachable from the fork without passing the join."""
    seen: set[str] = set()
    stack = [u for u in succ[fork] if u != join]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(u for u in succ.get(n, ()) if u != join and u not in seen)
    return seen


def _components(region: set[str], succ, pred) -> list[set[str]]:
    comps = []
    left = set(region)
    while left:
        start = left.pop()
        comp = {start}
        stack = [start]
        while stack:
            n = stack.pop()
            for m in (*succ.get(n, ()), *pred.get(n, ())):
                if m in left:
                    left.discard(m)
                    comp.add(m)
                    stack.append(m)
        comps.append(comp)
    return comps

"""Group a captured graph into `Layer`s: the cut candidates pipeline stages are made of.

A cut after node i is a candidate when at most one activation crosses it,
not counting "side" tensors that fan out to many blocks from far away
(attention masks, rotary tables): those are a small fixed set a stage either
receives alongside the activation or recomputes. Among the candidates, a cut
is taken where the owning block changes ("blocks.3" -> "blocks.4"), so a
layer is a whole transformer or ResNet block, or one top-level module.
Identical blocks get the same signature, so their costs are computed once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from planner.graph.model import Layer, OpInfo
from runtime.vocab import OpKind

_CALL_OPS = ("call_module", "call_function", "call_method")


@dataclass(frozen=True)
class NodeView:
    """Graph structure of one node, as the grouping passes need it."""

    name: str
    op: str
    users: tuple[str, ...]
    owner: str          # the repeated block (or innermost module) the node belongs to
    module_path: str


def _is_activation(info: OpInfo) -> bool:
    return (bool(info.output_meta) and info.op in ("placeholder", *_CALL_OPS)
            and info.kind not in (OpKind.SCALAR, OpKind.PARAM))


def side_tensors(infos: tuple[OpInfo, ...], views: list[NodeView]) -> set[str]:
    """Activations fanned out into two or more repeated blocks: masks, rotary tables.

    Only blocks of a repeated stack ("h.3", "layers.7": paths ending in an
    index) count, so a final hidden state read by both a pooler and the
    model's output stays a main activation.
    """
    owner = {v.name: v.owner for v in views}
    by_name = {i.name: i for i in infos}
    out = set()
    for v in views:
        if not _is_activation(by_name[v.name]):
            continue
        user_owners = {owner[u] for u in v.users if u in owner and owner[u].rsplit(".", 1)[-1].isdigit()}
        if len(user_owners - {v.owner}) >= 2:
            out.add(v.name)
    return out


def find_layers(infos: tuple[OpInfo, ...], views: list[NodeView]) -> tuple[Layer, ...]:
    pos = {v.name: i for i, v in enumerate(views)}
    by_name = {i.name: i for i in infos}
    side = side_tensors(infos, views)

    last_use = {}
    for v in views:
        if _is_activation(by_name[v.name]) and v.users:
            last_use[v.name] = max(pos[u] for u in v.users)
    expire: dict[int, list[str]] = {}
    for name, lu in last_use.items():
        expire.setdefault(lu, []).append(name)

    calls = [v for v in views if v.op in _CALL_OPS]
    # Walk the graph once, keeping the set of live activations, and decide
    # after each call node whether the next call node starts a new layer.
    cut_after: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    live: set[str] = set()
    next_call = {calls[k].name: calls[k + 1] for k in range(len(calls) - 1)}
    for i, v in enumerate(views):
        if v.name in last_use and last_use[v.name] > i:
            live.add(v.name)
        for name in expire.get(i, ()):
            live.discard(name)
        nxt = next_call.get(v.name)
        if nxt is None:
            continue
        main = tuple(sorted(n for n in live if n not in side))
        if len(main) <= 1 and v.owner != nxt.owner and by_name[v.name].kind != OpKind.SCALAR:
            cut_after[v.name] = (main, tuple(sorted(n for n in live if n in side)))

    # Assign call nodes to layers; parameters and inputs join their first user's layer.
    groups: list[list[str]] = [[]]
    boundaries: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    layer_of: dict[str, int] = {}
    for v in calls:
        groups[-1].append(v.name)
        layer_of[v.name] = len(groups) - 1
        if v.name in cut_after:
            boundaries.append(cut_after[v.name])
            groups.append([])
    if not groups[-1]:
        groups.pop()
    if not groups:  # a graph with no call nodes (identity model): one empty layer
        groups = [[]]
    boundaries = boundaries[: len(groups) - 1] + [((), ())]

    for v in views:
        if v.op in _CALL_OPS:
            continue
        if v.op == "output":
            target = len(groups) - 1
        else:
            user_layers = [layer_of[u] for u in v.users if u in layer_of]
            target = min(user_layers) if user_layers else 0
        layer_of[v.name] = target
    members: list[list[str]] = [[] for _ in groups]
    for v in views:  # keep graph order inside each layer
        members[layer_of[v.name]].append(v.name)

    owner = {v.name: v.owner for v in views}
    layers = []
    used_names: set[str] = set()
    for idx, names in enumerate(members):
        nodes = [by_name[n] for n in names]
        # Name a layer after the module that holds its weights, else its first real op.
        calls_here = [n for n in nodes if n.op in _CALL_OPS and n.kind != OpKind.SCALAR]
        first = next((n for n in calls_here if n.param_count and owner.get(n.name)),
                     next((n for n in calls_here if owner.get(n.name)),
                          calls_here[0] if calls_here else (nodes[0] if nodes else None)))
        name = (owner.get(first.name) or first.name) if first is not None else f"layer{idx}"
        if name in used_names:
            name = f"{name}:{first.name}" if first is not None else f"{name}:{idx}"
        used_names.add(name)
        main, side_live = boundaries[idx]
        layers.append(Layer(
            name=name, index=idx, nodes=tuple(names), signature=_signature(nodes),
            fwd_flops=sum(n.fwd_flops for n in nodes), bwd_flops=sum(n.bwd_flops for n in nodes),
            param_count=sum(n.param_count for n in nodes), param_bytes=sum(n.param_bytes for n in nodes),
            saved_bytes=sum(n.saved_bytes for n in nodes),
            boundary=main, side_inputs=side_live,
            boundary_bytes=sum(by_name[n].output_bytes for n in (*main, *side_live)),
        ))
    return tuple(layers)


def _signature(nodes: list[OpInfo]) -> str:
    """Same sequence of ops on the same shapes, wired the same way -> same signature."""
    local = {n.name: i for i, n in enumerate(nodes)}
    h = hashlib.sha1()
    for n in nodes:
        wiring = [local[i] - local[n.name] if i in local else "ext" for i in n.inputs]
        target = "" if n.op == "get_attr" else n.target  # a parameter's path names its block
        # the kind as its text: a member's repr ("<OpKind.LINEAR: 'linear'>") would change every signature
        h.update(repr((n.op, target, str(n.kind), [(m.shape, m.dtype) for m in n.output_meta],
                       [(m.shape, m.dtype) for m in n.input_meta], n.bytes_read, n.fwd_flops,
                       wiring)).encode())
    return h.hexdigest()[:16]

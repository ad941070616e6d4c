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


# What crosses a cut: the main activations (at most one) and the side tensors live across it, by node name.
Boundary = tuple[tuple[str, ...], tuple[str, ...]]


def find_layers(infos: tuple[OpInfo, ...], views: list[NodeView]) -> tuple[Layer, ...]:
    """The graph's layers in order: call nodes cut where the owning block changes and at most one activation
    is live, every other node placed with its first user (the output with the last layer)."""
    by_name = {i.name: i for i in infos}
    cut_after = _cut_candidates(views, by_name, side_tensors(infos, views))
    calls = [v for v in views if v.op in _CALL_OPS]
    groups, boundaries, layer_of = _group_calls(calls, cut_after)
    members = _members(views, len(groups), layer_of)
    owner = {v.name: v.owner for v in views}
    layers = []
    used_names: set[str] = set()
    for idx, names in enumerate(members):
        nodes = [by_name[n] for n in names]
        name = _layer_name(idx, nodes, owner, used_names)
        used_names.add(name)
        layers.append(_layer(idx, name, names, nodes, boundaries[idx], by_name))
    return tuple(layers)


def _cut_candidates(views: list[NodeView], by_name: dict[str, OpInfo], side: set[str]) -> dict[str, Boundary]:
    """The call nodes after which the next call node starts a new layer, each with what crosses that cut:
    at most one main activation live, the owning block changing, and not after a scalar op."""
    pos = {v.name: i for i, v in enumerate(views)}
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
    cut_after: dict[str, Boundary] = {}
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
    return cut_after


def _group_calls(calls: list[NodeView], cut_after: dict[str, Boundary]
                 ) -> tuple[list[list[str]], list[Boundary], dict[str, int]]:
    """Call nodes cut into layers: (each layer's call nodes, what crosses the cut after each layer (nothing
    after the last), the layer of each call node). A graph with no call nodes has one empty layer."""
    groups: list[list[str]] = [[]]
    boundaries: list[Boundary] = []
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
    return groups, boundaries, layer_of


def _members(views: list[NodeView], num_layers: int, layer_of: dict[str, int]) -> list[list[str]]:
    """Every node's name in its layer, in graph order: parameters and inputs join their first user's layer,
    the output the last. `layer_of` holds the call nodes' layers."""
    layer_of = dict(layer_of)
    for v in views:
        if v.op in _CALL_OPS:
            continue
        if v.op == "output":
            target = num_layers - 1
        else:
            user_layers = [layer_of[u] for u in v.users if u in layer_of]
            target = min(user_layers) if user_layers else 0
        layer_of[v.name] = target
    members: list[list[str]] = [[] for _ in range(num_layers)]
    for v in views:  # keep graph order inside each layer
        members[layer_of[v.name]].append(v.name)
    return members


def _layer_name(idx: int, nodes: list[OpInfo], owner: dict[str, str], used_names: set[str]) -> str:
    """Name a layer after the module that holds its weights, else its first real op; a name already
    used gets that op's name (or the layer's index) after a colon."""
    calls_here = [n for n in nodes if n.op in _CALL_OPS and n.kind != OpKind.SCALAR]
    first = next((n for n in calls_here if n.param_count and owner.get(n.name)),
                 next((n for n in calls_here if owner.get(n.name)),
                      calls_here[0] if calls_here else (nodes[0] if nodes else None)))
    name = (owner.get(first.name) or first.name) if first is not None else f"layer{idx}"
    if name in used_names:
        name = f"{name}:{first.name}" if first is not None else f"{name}:{idx}"
    return name


def _layer(idx: int, name: str, names: list[str], nodes: list[OpInfo], boundary: Boundary,
           by_name: dict[str, OpInfo]) -> Layer:
    """The Layer of `nodes` with their summed FLOPs and bytes, and the bytes of what crosses its end."""
    main, side_live = boundary
    return Layer(
        name=name, index=idx, nodes=tuple(names), signature=_signature(nodes),
        fwd_flops=sum(n.fwd_flops for n in nodes), bwd_flops=sum(n.bwd_flops for n in nodes),
        param_count=sum(n.param_count for n in nodes), param_bytes=sum(n.param_bytes for n in nodes),
        saved_bytes=sum(n.saved_bytes for n in nodes),
        boundary=main, side_inputs=side_live,
        boundary_bytes=sum(by_name[n].output_bytes for n in (*main, *side_live)),
    )


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

"""Tied weights in the cost model: which layers read each parameter the model uses under two
names, so that a plan cutting between them is charged for the extra copy and the gradient sum.

Every stage that reads a tied weight holds a copy (weights, gradients and optimizer state),
and before each step the copies' gradients are all-reduced over the pipeline positions that
hold them (runtime/execute/ties.py). The graph counts the weight once, at its first user.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.graph.model import ModelGraph


@dataclass(frozen=True)
class TiedWeight:
    names: tuple[str, ...]      # the model's names for it, canonical first
    numel: int                  # elements
    layers: tuple[int, ...]     # indices of the layers that read it, ascending
    nodes: tuple[str, ...]      # the nodes that read it


def tied_weights(graph: ModelGraph) -> tuple[TiedWeight, ...]:
    """The model's tied weights and the layers reading each (read directly, or through a module)."""
    layer_of = {name: layer.index for layer in graph.layers for name in layer.nodes}
    attr_nodes: dict[str, str] = {n.name: n.target for n in graph.nodes if n.op == "get_attr"}
    out = []
    for names, numel in zip(graph.shared_params, graph.shared_numel or (0,) * len(graph.shared_params)):
        group = set(names)
        owners = {name.rsplit(".", 1)[0] for name in names}
        layers, nodes = set(), []
        for n in graph.nodes:
            reads = any(attr_nodes.get(i) in group for i in n.inputs) or bool(group & set(n.param_names)) \
                or (n.op == "call_module" and n.module_path in owners)
            if reads and n.name in layer_of:
                layers.add(layer_of[n.name])
                nodes.append(n.name)
        out.append(TiedWeight(tuple(names), int(numel), tuple(sorted(layers)), tuple(nodes)))
    return tuple(out)

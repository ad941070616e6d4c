"""Is a plan bound to this captured graph, and if not, how do the two models differ?

A plan is bound to the graph it was made for by the graph's fingerprint (planner/graph/analysis.py),
which does not depend on the device the model was captured on (capture traces a meta twin). When
the fingerprints differ, `graph_mismatch` says what differs, most telling first: the model's class,
its parameter count, its layers (the plan's stages name them), the nodes the plan splits; when all
of these agree, the operations between them differ (the model's code, or the torch or transformers
version that traced it).
"""

from __future__ import annotations

from planner.graph.model import ModelGraph
from planner.plan import Plan

_SHOWN = 3   # names shown of a longer list


def graph_mismatch(plan: Plan, graph: ModelGraph) -> str | None:
    """None when `plan` was made for `graph` (same fingerprint); else one sentence naming what
    differs between the plan's model and the graph's, ending with both fingerprints."""
    if graph.fingerprint == plan.graph_fingerprint:
        return None
    diffs = []
    if graph.model_class != plan.model_class:
        diffs.append(f"the plan is for {plan.model_class}, this model is {graph.model_class}")
    if plan.graph_params and plan.graph_params != graph.num_params:
        diffs.append(f"the plan's model has {plan.graph_params:,} parameters, this one {graph.num_params:,}")
    layers = _layer_difference([name for st in plan.stages for name in st.layers], [la.name for la in graph.layers])
    if layers:
        diffs.append(layers)
    nodes = {n.name for n in graph.nodes}
    missing = [name for name, _role in plan.shardings if name not in nodes]
    if missing:
        diffs.append(f"{len(missing)} node(s) the plan splits are not in this graph ({_names(missing)})")
    if not diffs:
        diffs.append("the same class, parameter count and layers, but other operations between them (the "
                     "model's code differs, or another version of torch or transformers traced it)")
    return (f"the plan was made for another model: {'; '.join(diffs)} (plan graph {plan.graph_fingerprint[:12]}, "
            f"this graph {graph.fingerprint[:12]})")


def _layer_difference(planned: list[str], have: list[str]) -> str | None:
    """How the plan's layers (in stage order) differ from the graph's, or None when they are the same."""
    if planned == have:
        return None
    k = next((i for i, (a, b) in enumerate(zip(planned, have)) if a != b), min(len(planned), len(have)))
    got = planned[k] if k < len(planned) else "no more layers"
    want = have[k] if k < len(have) else "no more layers"
    return (f"the plan's stages hold {len(planned)} layers, this model has {len(have)}; layer {k} is {got} in the "
            f"plan and {want} here")


def _names(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


__all__ = ["graph_mismatch"]

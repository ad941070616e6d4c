"""The split regions a target's code generator can carry out: the tensor split analysis run per region on
the captured graph (planner/capabilities.py's RuntimeSupport.splittable asks it through
TensorStrategy.target_splits)."""

from __future__ import annotations

from planner.strategies.tensor.sharding import ShardingPlan, without_regions
from planner.strategies.tensor.split.analysis import unsplittable
from runtime.vocab import OpKind, ShardRole

# the tensor-parallel roles of the ops whose weights are split
_WEIGHT_ROLES = (ShardRole.COLUMN, ShardRole.COLUMN_OUT, ShardRole.ROW, ShardRole.VOCAB)


def splittable(graph, sharding: ShardingPlan, degrees, split_kinds: tuple[OpKind, ...] | None) -> ShardingPlan:
    """`sharding` without the tensor-parallel regions the code generator cannot split for any of
    the tensor `degrees` (planner/strategies/tensor/split/, on the captured graph's shapes: no model run).

    A region that fails is replicated together with its copies in every layer of the same
    signature (a model's repeated blocks fail alike). Where the target splits the weights of some
    op kinds only (`split_kinds`), a region that splits another kind's weight or the channels of a
    norm is replicated first.
    """
    if split_kinds is not None:
        kinds = {n.name: n.kind for n in graph.nodes}
        other = {r.region for name, r in sharding.roles.items() if r.sharded and r.region >= 0 and (
            r.role == ShardRole.CHANNELS or (r.role in _WEIGHT_ROLES and kinds.get(name) not in split_kinds))}
        sharding = without_regions(sharding, other)
    if graph.module is None:
        return sharding
    key = _region_keys(graph, sharding)
    for t in sorted({int(t) for t in degrees if t > 1}):
        for _ in range(len(key) + 1):
            roles = {n: r.role for n, r in sharding.roles.items() if r.sharded}
            err = unsplittable(graph, roles, t) if roles else None
            if err is None:
                break
            bad = _failing_regions(graph, sharding, getattr(err, "node", None))
            if not bad:   # cannot tell which region: replicate them all for this degree
                bad = set(key)
            sharding = without_regions(sharding, {r for r in key if key[r] in {key[b] for b in bad}})
    return sharding


def _region_keys(graph, sharding: ShardingPlan) -> dict[int, tuple]:
    """Region -> (layer signature, position of its first node in the layer): equal for the same
    region of repeated blocks."""
    where = {}
    for layer in graph.layers:
        for k, name in enumerate(layer.nodes):
            where[name] = (layer.signature, k)
    keys: dict[int, tuple] = {}
    for name, r in sharding.roles.items():
        if r.sharded and r.region >= 0:
            keys.setdefault(r.region, where.get(name, ("", r.region)))
    return keys


def _failing_regions(graph, sharding: ShardingPlan, node: str | None) -> set[int]:
    """The regions the failing node belongs to or reads from."""
    if node is None or node not in sharding.roles:
        return set()
    own = sharding.roles[node].region
    if own >= 0:
        return {own}
    info = next((n for n in graph.nodes if n.name == node), None)
    return {sharding.roles[i].region for i in (info.inputs if info else ()) if i in sharding.roles
            and sharding.roles[i].region >= 0}

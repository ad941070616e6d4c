"""What meshplan's runtime can execute, so that the search never picks a plan it cannot run.

The cost model may price more than the runtime runs; `optimize` searches only
what `RuntimeSupport` allows unless asked for a what-if search with `runtime=None`.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.config import ParallelConfig
from planner.strategies.combinations import Level
from planner.strategies.combinations import why_not as combination_refusal
from planner.strategies.registry import STRATEGIES
from planner.sharding import ShardingPlan, without_regions
from planner.tensor_split.analysis import unsplittable
from runtime.vocab import StrategyName

# the strategies RuntimeSupport switches on and off (its boolean field of the strategy's name), and the
# refusal where a config uses one that is off
_SWITCHED: dict[StrategyName, str] = {
    StrategyName.BIDIRECTIONAL: "the runtime does not run bidirectional pipelines yet",
    StrategyName.SPATIAL: "the runtime does not run spatial plans",
    StrategyName.SUBGRAPH: "the runtime does not run sub-graph parallel plans",
}


@dataclass(frozen=True)
class RuntimeSupport:
    """The configurations the runtime executes exactly (proven by tests/distributed)."""

    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    bidirectional: bool = True   # GEMS MAST/MASTER: tests/distributed/test_bidirectional.py
    # fp16 trains with dynamic loss scaling (runtime/loss_scale.py); bf16 and fp32 need none.
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    # Spatial tiles: tests/distributed/test_spatial_build.py; sub-graph parallelism:
    # tests/distributed/test_subgraph.py. The compositions each runs are the RUNTIME rules of
    # planner/strategies/combinations.py; the others are priced, not run.
    spatial: bool = True
    subgraph: bool = True

    def allows(self, config: ParallelConfig) -> bool:
        return self.why_not(config) is None

    def why_not(self, config: ParallelConfig) -> str | None:
        """A sentence saying what the runtime cannot run in `config`, or None."""
        off = next((_SWITCHED[s.name] for s in STRATEGIES
                    if s.name in _SWITCHED and not getattr(self, s.name) and s.active(config)), None)
        if off:
            return off
        if config.schedule not in self.schedules:
            return f"the runtime does not run the {config.schedule} schedule"
        if config.recompute not in self.recompute:
            return f"the runtime does not run recompute={config.recompute!r}"
        if config.zero not in self.zero_stages:
            return f"the runtime does not run ZeRO stage {config.zero}"
        refusal = combination_refusal(config, Level.RUNTIME)   # planner/strategies/combinations.py
        if refusal:
            return refusal
        if config.dtype not in self.dtypes:
            return f"the runtime does not train in {config.dtype}; use one of {', '.join(self.dtypes)}"
        return None


    def splittable(self, graph, sharding: ShardingPlan, degrees) -> ShardingPlan:
        """`sharding` without the tensor-parallel regions the code generator cannot split for any of
        the tensor `degrees` (planner/tensor_split/, on the captured graph's shapes: no model run).

        A region that fails is replicated together with its copies in every layer of the same
        signature (a model's repeated blocks fail alike).
        """
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


MESHPLAN_RUNTIME = RuntimeSupport()

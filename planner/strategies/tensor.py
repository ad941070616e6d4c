"""Tensor (operator) parallelism (degree t), planner side: which regions to shard, which degrees fit.

The per-op roles come from planner/sharding.py (Megatron's column/row pattern, attention
by heads, vocabulary-parallel embeddings), grouped in regions that shard together. Per
layer, the integer program of planner/ilp.py picks which regions to shard at a degree
(shard where it pays: the sharded compute and memory against the all-reduces where a
region meets the replicated stream), or every region under the Evaluator's
sharding="all" (Megatron's layout). The Evaluator prices a node with its role: FLOPs,
bytes and weights over t, plus the role's all-reduces on the tensor axis.
"""

from __future__ import annotations

from cost_models.memory import param_bytes
from planner.config import ParallelConfig
from planner.graph.model import Layer, OpInfo
from planner.ilp import Edge, RegionOption, choose_shardings
from planner.strategies.base import Strategy
from runtime.vocab import StrategyName


class TensorStrategy(Strategy):
    """See module docstring."""

    name = StrategyName.TENSOR
    named_at_one = True

    def check(self, ev, config: ParallelConfig) -> None:
        """ValueError naming the first split size that the tensor degree must divide and does not."""
        ev.sharding.check(config.tensor)

    def node_roles(self, ev, layer: Layer, config: ParallelConfig) -> dict[str, str]:
        chosen = sharded_regions(ev, layer, config)
        roles = ev.sharding.roles
        return {name: roles[name].role for name in layer.nodes if roles[name].region in chosen}


def sharded_regions(ev, layer: Layer, config: ParallelConfig) -> frozenset[int]:
    """Regions of `layer` sharded at this tensor degree (see module docstring).

    The decision is cached per layer signature, as the positions of the chosen
    regions within the layer (first, second, ...): repeated blocks share the
    decision but each has its own region ids.
    """
    roles = ev.sharding.roles
    by_region: dict[int, list[OpInfo]] = {}  # in order of first appearance in the layer
    for name in layer.nodes:
        r = roles[name].region
        if r >= 0:
            by_region.setdefault(r, []).append(ev.node(name))
    ordered = list(by_region)
    key = (layer.signature, config.tensor, config.micro_batch_size, config.dtype)
    cache: dict[tuple, frozenset[int]] = ev.state(StrategyName.TENSOR, dict)
    hit = cache.get(key)
    if hit is not None:
        return frozenset(ordered[i] for i in hit if i < len(ordered))
    pb = param_bytes(config.dtype, config.zero, config.data).total
    options, edges = [], []
    for r, nodes in by_region.items():
        rep = [ev.node_cost(n, "replicate", config) for n in nodes]
        sh = [ev.node_cost(n, roles[n.name].role, config) for n in nodes]
        options.append(RegionOption(
            region=r,
            time_replicated=sum(c.fwd + c.bwd for c in rep),
            time_sharded=sum(c.fwd + c.bwd for c in sh),
            bytes_replicated=sum(c.params * pb + c.saved for c in rep),
            bytes_sharded=sum(c.params * pb + c.saved for c in sh),
        ))
        # Resharding edges: where the region's output rejoins the replicated stream
        # (forward all-reduce) and where the stream enters it (backward all-reduce).
        edges.append(Edge(r, -1, sum(c.tp_fwd for c in sh)))
        edges.append(Edge(-1, r, sum(c.tp_bwd for c in sh)))
    if ev.sharding_mode == "all":
        chosen = frozenset(by_region)
    else:
        chosen, _ = choose_shardings(options, edges, memory_cap=ev.cluster.device.memory_bytes)
    cache[key] = frozenset(i for i, r in enumerate(ordered) if r in chosen)
    return chosen

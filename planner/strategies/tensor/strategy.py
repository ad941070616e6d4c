"""Tensor (operator) parallelism (degree t), planner side: which regions to shard, which degrees fit.

The per-op roles come from planner/strategies/tensor/sharding.py (Megatron's column/row pattern, attention
by heads, vocabulary-parallel embeddings), grouped in regions that shard together. Per
layer, the integer program of planner/ilp.py picks which regions to shard at a degree
(shard where it pays: the sharded compute and memory against the all-reduces where a
region meets the replicated stream), or every region under the Evaluator's
sharding="all" (Megatron's layout). The Evaluator prices a node with its role: FLOPs,
bytes and weights over t, plus the role's all-reduces on the tensor axis.

Under sequence parallelism (config.sequence_parallel; planner/strategies/tensor/split/sequence.py) every
region is sharded, and the collectives are those of Megatron's sequence-parallel layers: a row
op's forward all-reduce becomes a reduce-scatter along the sequence and a column op's backward
all-reduce a reduce-scatter, each paired with an all-gather the other way (a column op gathers
its input in forward, a row op gathers its output gradient in backward), of the same full-tensor
bytes: a ring all-reduce is a reduce-scatter followed by an all-gather, so SP moves the bytes of
plain tensor parallelism. The replicated ops between regions do 1/t of their work, a replicated
op that reads a split value whole all-gathers it, and a pipeline cut sends 1/t of a split value.
"""

from __future__ import annotations

from cost_models.memory import param_bytes
from planner.config import ParallelConfig
from planner.graph.model import Layer, OpInfo
from planner.ilp import Edge, RegionOption, choose_shardings
from planner.strategies.base import Strategy
from planner.strategies.tensor.sharding import ShardingPlan, find_sharding
from planner.strategies.tensor.split.analysis import ConfigSplits
from planner.strategies.tensor.split.sequence import sequence_stream
from planner.strategies.tensor.split.splits import SequenceSplit
from planner.strategies.tensor.target_split import splittable
from runtime.vocab import Collective, DType, MeshAxis, OpKind, ShardRole, StrategyName


class TensorStrategy(Strategy):
    """See module docstring."""

    name = StrategyName.TENSOR
    named_at_one = True
    splits_nodes = True

    def graph_splits(self, graph) -> ShardingPlan:
        return find_sharding(graph)

    def split_analysis(self, graph) -> ConfigSplits:
        return ConfigSplits(graph)

    def target_splits(self, graph, splits: ShardingPlan, degrees, kinds) -> ShardingPlan:
        return splittable(graph, splits, degrees, kinds)

    def split_ranks(self, config: ParallelConfig) -> int:
        return config.tensor

    def sequence_ranks(self, config: ParallelConfig) -> int:
        return config.tensor if config.sequence_parallel else 1

    def check(self, ev, config: ParallelConfig) -> None:
        """ValueError naming the first split size that the tensor degree must divide and does not (and,
        under sequence parallelism, the sequence length or the node the split cannot pass)."""
        ev.sharding.check(config.tensor)
        if config.sequence_parallel:
            stream(ev, config.tensor)

    def pinned_on(self, constraints: dict) -> bool:
        return constraints.get("sequence_parallel") is True

    def variants(self, ev, num_devices: int, constraints: dict, shapes_of) -> list[ParallelConfig]:
        """Sequence parallelism on every tensor >= 2 shape (the search prices it against the plain one),
        unless the constraints pin sequence_parallel=False or the model cannot be split so."""
        if constraints.get("sequence_parallel") is False:
            return []
        out = []
        for cfg in shapes_of(num_devices):
            if cfg.tensor < 2:
                continue
            try:
                stream(ev, cfg.tensor)
            except ValueError:
                continue
            out.append(cfg.replace(sequence_parallel=True))
        return out

    def cache_key(self, config: ParallelConfig) -> tuple:
        return (config.sequence_parallel,)

    def token_share(self, ev, name: str, role: str, config: ParallelConfig) -> int:
        return sequence_share(ev, name, role, config)

    def boundary_share(self, ev, layer: Layer, config: ParallelConfig) -> int:
        return sequence_boundary_share(ev, layer, config)

    comm_axis = MeshAxis.TENSOR.value

    def node_comm(self, ev, n: OpInfo, role: str, config: ParallelConfig, scale: float,
                  ds: float) -> tuple[float, float]:
        """A split node's all-reduces on the tensor axis (or, under sequence parallelism, its reduce-scatters
        and all-gathers along the sequence), with what the runtime adds around them; a replicated node's
        gathers of the sequence-split values it reads whole."""
        if role == ShardRole.REPLICATE:
            return sequence_collectives(ev, n, role, config, scale * ds) if config.sequence_parallel else (0.0, 0.0)
        shard = ev.sharding.roles[n.name]
        if config.sequence_parallel:   # reduce-scatters and all-gathers along the sequence instead
            f, b = sequence_collectives(ev, n, role, config, scale * ds)
        else:
            mesh = config.mesh
            f = ev.axis_seconds(mesh, MeshAxis.TENSOR, Collective.ALL_REDUCE, shard.fwd_allreduce * scale * ds) \
                if shard.fwd_allreduce else 0.0
            b = ev.axis_seconds(mesh, MeshAxis.TENSOR, Collective.ALL_REDUCE, shard.bwd_allreduce * scale * ds) \
                if shard.bwd_allreduce else 0.0
        if shard.fwd_allreduce or shard.bwd_allreduce:
            # What the runtime adds around the all-reduce (calibrated; 0 otherwise): a vocabulary-parallel
            # embedding masks the ids it does not hold and zeroes their outputs; a layer's autograd function
            # costs both ways and copies the values it reduces.
            elements = max(shard.fwd_allreduce, shard.bwd_allreduce) * scale / 4  # fp32 bytes
            wf, wb = (ev.tp_embedding if role == ShardRole.VOCAB else ev.tp_wrapper).at(elements)
            f, b = f + wf, b + wb
        return f, b

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
    key = (layer.signature, config.tensor, config.micro_batch_size, config.dtype, config.sequence_parallel)
    cache: dict[tuple, frozenset[int]] = ev.state(StrategyName.TENSOR, dict)
    hit = cache.get(key)
    if hit is not None:
        return frozenset(ordered[i] for i in hit if i < len(ordered))
    if ev.sharding_mode == "all" or config.sequence_parallel:   # SP splits the stream between all regions
        chosen = frozenset(by_region)
    else:
        chosen = _choose(ev, by_region, config)
    cache[key] = frozenset(i for i, r in enumerate(ordered) if r in chosen)
    return chosen


def stream(ev, tensor: int) -> SequenceSplit:
    """The sequence split of `ev`'s graph with every region sharded on `tensor` ranks (cached);
    SequenceSplitError (a ConfigError) naming the node or the sequence length when there is none."""
    cache: dict[int, SequenceSplit | ValueError] = ev.state(f"{StrategyName.TENSOR}.sequence", dict)
    if tensor not in cache:
        roles = {name: shard.role for name, shard in ev.sharding.roles.items() if shard.sharded}
        try:
            cache[tensor] = sequence_stream(ev.graph, roles, tensor)
        except ValueError as e:
            cache[tensor] = e
    hit = cache[tensor]
    if isinstance(hit, ValueError):
        raise hit
    return hit


def sequence_share(ev, name: str, role: str, config: ParallelConfig) -> int:
    """What a node's FLOPs and bytes are divided by for sequence parallelism: t for a replicated op
    between regions (it runs on T/t tokens), else 1."""
    if not config.sequence_parallel or role != ShardRole.REPLICATE or name not in stream(ev, config.tensor).split:
        return 1
    return config.tensor


def sequence_collectives(ev, n: OpInfo, role: str, config: ParallelConfig, scale: float) -> tuple[float, float]:
    """(forward s, backward s) of node `n`'s sequence-parallel collectives on the tensor axis for one
    micro-batch (`scale`: the micro-batch's fraction of the captured batch times the dtype's size over
    the captured one). Row ops and vocabulary embeddings reduce-scatter their output and all-gather its
    gradient; a column op reading a split value all-gathers it and reduce-scatters its gradient (the
    bytes the plain all-reduce moves); a replicated op reading a split value whole all-gathers it; a
    parameter that meets only this rank's tokens has its gradient all-reduced in every backward."""
    seq, mesh = stream(ev, config.tensor), config.mesh

    def collective(op: str, nbytes: float, factor: float = scale) -> float:
        return ev.axis_seconds(mesh, MeshAxis.TENSOR, op, nbytes * factor)

    ds = DType(config.dtype).bytes / 4   # parameters do not scale with the micro-batch
    grads = sum((collective(Collective.ALL_REDUCE, b, ds) for b in _partial_grads(ev, n, role, seq)), 0.0)
    shard = ev.sharding.roles[n.name]
    if role in (ShardRole.ROW, ShardRole.VOCAB):
        return (collective(Collective.REDUCE_SCATTER, shard.fwd_allreduce),
                collective(Collective.ALL_GATHER, shard.fwd_allreduce) + grads)
    if n.name in seq.gathering:
        return (collective(Collective.ALL_GATHER, shard.bwd_allreduce),
                collective(Collective.REDUCE_SCATTER, shard.bwd_allreduce))
    if role != ShardRole.REPLICATE:
        return 0.0, collective(Collective.ALL_REDUCE, shard.bwd_allreduce)
    whole = seq.read_whole.get(n.name, ())
    return sum((collective(Collective.ALL_GATHER, ev.node(v).output_bytes) for v in whole), 0.0), grads


def _partial_grads(ev, n: OpInfo, role: str, seq: SequenceSplit) -> list[float]:
    """Captured bytes of each parameter of `n` whose gradient covers this rank's tokens only, which the
    lowering all-reduces (runtime.parallel.tensor.layers): a norm's weight and bias on split tokens (a module's
    tensors taken as equal, as a norm's are), and a row op's bias, added after the reduce-scatter."""
    if role == ShardRole.ROW and n.name in seq.split:
        if n.op == "call_module":
            has_bias = any(p.endswith("bias") for p in n.param_names)
            return [n.output_meta[0].shape[-1] * n.param_bytes / n.param_count] if has_bias and n.param_count else []
        return [m.output_bytes for m in map(ev.node, n.inputs)
                if m.kind == OpKind.PARAM and len(m.output_meta[0].shape) == 1]
    if role != ShardRole.REPLICATE or n.name not in seq.split:
        return []
    if n.op == "call_module":
        return [n.param_bytes / len(n.param_names)] * len(n.param_names) if n.param_names else []
    return [m.output_bytes for m in map(ev.node, n.inputs) if m.kind == OpKind.PARAM and str(m.target) in seq.params]


def sequence_boundary_share(ev, layer: Layer, config: ParallelConfig) -> int:
    """What the bytes crossing the cut after `layer` are divided by: t under sequence parallelism when
    every value crossing it is split along the sequence (the stage sends its rank's tokens), else 1."""
    if not config.sequence_parallel or not layer.boundary:
        return 1
    return config.tensor if set(layer.boundary) <= stream(ev, config.tensor).split else 1


def _choose(ev, by_region: dict[int, list[OpInfo]], config: ParallelConfig) -> frozenset[int]:
    """The regions the integer program shards: the sharded compute and memory against the all-reduces
    where a region meets the replicated stream."""
    roles = ev.sharding.roles
    pb = param_bytes(config.dtype, config.zero, config.data).total
    options, edges = [], []
    for r, nodes in by_region.items():
        rep = [ev.node_cost(n, ShardRole.REPLICATE, config) for n in nodes]
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
        edges.append(Edge(r, -1, sum(c.on(MeshAxis.TENSOR).forward for c in sh)))
        edges.append(Edge(-1, r, sum(c.on(MeshAxis.TENSOR).backward for c in sh)))
    chosen, _ = choose_shardings(options, edges, memory_cap=ev.cluster.device.memory_bytes)
    return chosen

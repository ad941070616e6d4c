"""Context parallelism (degree c, the "context" mesh axis), planner side: check, cost, search.

Every layer's activations are split along the sequence over the c ranks of the axis;
attention reaches the other ranks' keys and values (ring attention or Ulysses all-to-all,
runtime.vocab.ContextAttention). The sequence is cut into 2c equal chunks and rank r holds
chunks r and 2c-1-r (the causal load-balanced order): under a causal mask chunk k attends to
k+1 chunks, so every rank's pair attends to (r+1) + (2c-r) = 2c+1 chunks, the same masked work
on every rank, 1/c of the whole.

Cost per layer, one rank, one micro-batch: every op does 1/c of its FLOPs and bytes (its tokens
are 1/c of the sequence; attention by the load-balanced split), so compute, saved activations,
the working set and the pipeline boundary are divided by c, and so are the tensor-parallel
collectives of the layer (they carry this rank's tokens only; dividing their seconds drops
1 - 1/c of their latency term, small beside the bandwidth term at the sequence lengths that need
context parallelism). Each attention op adds its exchange (planner/strategies/context/costs.py): ring
attention's exposed transfers, or Ulysses' four all-to-alls each way, priced on the context
axis' links; a recomputed attention (full or selective recompute) repeats its forward exchange
in backward. Weights and optimizer state are not divided (context ranks hold whole replicas of
their tensor shard, ZeRO shards over the data axis only); gradients are summed over data x
context, priced as the data strategy's sync over the merged group less the data-only sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.strategies.context.costs import ExchangeSeconds, ring_attention, ulysses
from cost_models.overlap import DeviceWork
from planner.config import ConfigError, ParallelConfig
from planner.graph.model import Layer, OpInfo
from planner.strategies.base import Strategy
from runtime.vocab import Collective, ContextAttention, DType, MeshAxis, OpKind, RecomputeMode, ShardRole, StrategyName

# The search proposes a context degree only where each rank keeps at least this many tokens of a
# sequence. A ring step's block attention (4 n^2 H D FLOPs for n tokens per rank) hides its key/value
# transfer (4 n H_kv D bytes) only when n >= (peak FLOP/s / link bytes/s) x H_kv / H: for full
# multi-head attention on NVLink about 989 TFLOP/s / 450 GB/s = 2200 tokens on an H100 and
# 312 / 300 = 1040 on an A100 (NVIDIA datasheets, as tabled in PUBLISHED.md). Shorter blocks
# expose their transfers, and a search at pretraining lengths (2048 tokens) stays as large as
# without context parallelism. The user may still ask for any degree (constraint `context`).
MIN_SEARCH_TOKENS_PER_RANK = 2048

_MISSING = object()   # a cache miss (a cached refusal may be None)


@dataclass(frozen=True)
class AttentionShape:
    """One attention op's q/k/v geometry as captured: batch B (samples of the captured batch),
    query heads, key/value heads, sequence T (tokens) and head width D (channels)."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int


def attention_shape(n: OpInfo) -> AttentionShape:
    """The geometry of attention node `n`; ConfigError unless its q, k, v are (B, H, T, D)."""
    shapes = [m.shape for m in n.input_meta[:3]]
    if len(shapes) < 3 or any(len(s) != 4 for s in shapes):
        raise ConfigError(f"context parallelism splits attention given as (batch, heads, tokens, channels) "
                          f"q, k, v (scaled_dot_product_attention); attention op {n.name!r} has inputs "
                          f"{[tuple(s) for s in shapes]}; use context=1")
    (b, h, t, d), (_, hk, tk, _) = shapes[0], shapes[1]
    if tk != t:
        raise ConfigError(f"context parallelism splits self-attention; attention op {n.name!r} attends "
                          f"{t} queries to {tk} keys; use context=1")
    return AttentionShape(b, h, hk, t, d)


def sequence_length(ev) -> int:
    """Tokens per sequence of the Evaluator `ev`'s graph, read off its attention ops; ConfigError when
    it has none or they disagree."""
    def find() -> int:
        seqs = {attention_shape(n).seq for n in ev.graph.nodes if n.kind == OpKind.ATTENTION}
        if not seqs:
            raise ConfigError("context parallelism splits the sequence that attention runs over, and this "
                              "model has no attention op; use context=1")
        if len(seqs) > 1:
            raise ConfigError(f"context parallelism needs one sequence length, but this model's attention "
                              f"ops run over {sorted(seqs)} tokens; use context=1")
        return seqs.pop()

    return _cache(ev, ("seq",), find)


def _cache(ev, key: tuple, make):
    """What `make()` gives for `key` in this strategy's cache on the Evaluator `ev` (made once)."""
    cache: dict = ev.state(StrategyName.CONTEXT, dict)
    hit = cache.get(key, _MISSING)
    if hit is _MISSING:
        hit = cache[key] = make()
    return hit


def _local_heads(ev, layer: Layer, n: OpInfo, config: ParallelConfig) -> tuple[float, float]:
    """(query heads, key/value heads) of attention `n` on one tensor rank."""
    shape = attention_shape(n)
    div = ev.split_divisor(n.name, ev.layer_roles(layer, config).get(n.name), config)
    return shape.heads / div, shape.kv_heads / div


def check_config(ev, config: ParallelConfig) -> None:
    """ConfigError naming the numbers when `config`'s context degree cannot split `ev`'s model."""
    c = config.context
    seq = sequence_length(ev)
    refusal = _cache(ev, ("dropout",), lambda: _dropout_refusal(ev))
    if refusal:
        raise ConfigError(refusal)
    if seq % (2 * c):
        raise ConfigError(f"context={c} cuts each sequence into 2 x {c} = {2 * c} chunks (the causal load-balanced "
                          f"order), but the sequence has {seq} tokens; use a context degree c with {seq} divisible "
                          f"by 2c, or a sequence length divisible by {2 * c}")
    if config.context_attention != ContextAttention.ULYSSES:
        return
    # the tensor strategy's head split depends on these (its per-layer choice, planner/strategies/tensor/strategy.py)
    key = ("ulysses", c, config.mesh_items, config.micro_batch_size, config.dtype)
    refusal = _cache(ev, key, lambda: _ulysses_refusal(ev, config))
    if refusal:
        raise ConfigError(refusal)


def _dropout_refusal(ev) -> str | None:
    """Why the context-parallel attention (runtime/parallel/context/attention.py, which has no dropout) cannot
    run `ev`'s model, or None: an attention op with dropout (scaled_dot_product_attention's dropout_p,
    keyword or fifth argument); codegen/strategies/context/stage_code.py refuses the same at build time."""
    for n in ev.graph.nodes:
        p = n.attr("dropout_p", n.attr("arg4", 0.0)) if n.kind == OpKind.ATTENTION else 0.0
        if isinstance(p, (int, float)) and p > 0:
            return (f"context parallelism runs attention without dropout, but attention op {n.name!r} "
                    f"({n.module_path or 'the top level'}) has dropout_p={p}; set the model's attention dropout "
                    "to 0, or use context=1")
    return None


def _ulysses_refusal(ev, config: ParallelConfig) -> str | None:
    """Why Ulysses cannot deal `config`'s heads per tensor rank to its context ranks, or None."""
    c = config.context
    for layer in ev.graph.layers:
        for name in layer.nodes:
            n = ev.node(name)
            if n.kind != OpKind.ATTENTION:
                continue
            heads, kv = _local_heads(ev, layer, n, config)
            for what, count in (("attention heads", heads), ("key/value heads", kv)):
                if count != int(count) or int(count) % c:
                    return (f"Ulysses context parallelism deals each tensor rank's heads to the {c} context ranks, "
                            f"but attention op {n.name!r} has {count:g} {what} per tensor rank (tensor="
                            f"{ev.split_ranks(config)}); use a context degree dividing {count:g}, a smaller tensor degree, "
                            "or context_attention='ring'")
    return None


def exchange(ev, layer: Layer, n: OpInfo, config: ParallelConfig) -> tuple[ExchangeSeconds, float]:
    """Attention `n`'s context exchange (exposed seconds, one rank, one micro-batch) and the bytes of
    the buffers it needs besides the layer's own (received key/value blocks, head-split copies)."""
    c = config.context
    shape = attention_shape(n)
    heads, kv_heads = _local_heads(ev, layer, n, config)
    elem = DType(config.dtype).bytes
    tokens = config.micro_batch_size * shape.seq / c   # this rank's tokens of the micro-batch
    q_bytes = tokens * heads * shape.head_dim * elem
    kv_bytes = tokens * kv_heads * shape.head_dim * elem   # one of k, v
    mesh = config.mesh
    if config.context_attention == ContextAttention.ULYSSES:
        seconds = ulysses(c, (q_bytes, kv_bytes, kv_bytes), q_bytes,
                          lambda nb: ev.axis_seconds(mesh, MeshAxis.CONTEXT, Collective.ALL_TO_ALL, nb))
        return seconds, q_bytes + 2 * kv_bytes
    role = ev.layer_roles(layer, config).get(n.name, ShardRole.REPLICATE)
    attn = ev.node_cost(n, role, config)
    seconds = ring_attention(c, 2 * kv_bytes, lambda nb: ev.axis_seconds(mesh, MeshAxis.CONTEXT, Collective.P2P, nb),
                             attn.fwd / c, attn.bwd / c)
    return seconds, 2 * (2 * kv_bytes)   # the block being received beside the one attended to, for k and v


def adjust(ev, layer: Layer, cost, config: ParallelConfig):
    """`cost` (the whole-sequence LayerCost of `layer`) on one rank of the context axis."""
    c = config.context
    key = ("cost", layer.signature, cost, c, config.context_attention, config.micro_batch_size, config.dtype,
           config.recompute, config.mesh_items)

    def make():
        ex_f = ex_b = buffers = 0.0
        for name in layer.nodes:
            n = ev.node(name)
            if n.kind == OpKind.ATTENTION:
                seconds, nbytes = exchange(ev, layer, n, config)
                ex_f += seconds.forward
                ex_b += seconds.backward
                buffers = max(buffers, nbytes)
        if config.recompute in (RecomputeMode.FULL, RecomputeMode.SELECTIVE):
            ex_b += ex_f   # the recomputed attention exchanges its keys and values again
        shared = cost.comm_divided(c)   # each rank runs the other axes' collectives on its tokens alone
        return dataclasses.replace(
            shared.with_comm(MeshAxis.CONTEXT, ex_f, ex_b) if ex_f or ex_b else shared,
            forward=cost.forward / c, backward=cost.backward / c, recompute=cost.recompute / c,
            saved=cost.saved / c, working=cost.working / c, temporary=cost.temporary / c + buffers,
            boundary=cost.boundary / c, loss_forward=cost.loss_forward / c, loss_backward=cost.loss_backward / c,
            loss_peak=cost.loss_peak / c)

    return _cache(ev, key, make)


def grad_sync_seconds(ev, config: ParallelConfig, params: float, work: DeviceWork, m: int) -> tuple[float, float]:
    """What summing the gradients over data x context adds to the data-only sync: the data strategy's
    price over the merged group (the data and context axes are adjacent in config.mesh, so a data axis
    of d x c ranks has the same groups) less its price over the data axis. Under ZeRO the merged price
    also gathers the weight shards over d x c ranks (Megatron's distributed optimizer shards over data
    x context) while the memory model keeps ZeRO's shards over d: the time at least as long, the memory
    at least as large as a run's."""
    data = next(s for s in ev.strategies if s.name == StrategyName.DATA)
    merged = config.replace(data=config.data * config.context, context=1, context_attention=ContextAttention.RING)
    e1, o1 = data.grad_sync(ev, merged, params, work, m)
    e0, o0 = data.grad_sync(ev, config, params, work, m) if config.data > 1 else (0.0, 0.0)
    return e1 - e0, o1 - o0


def search_degrees(ev, num_devices: int, constraints: dict) -> list[int]:
    """Context degrees the search tries: the pinned one, else the powers of two 2, 4, 8, ... dividing the
    devices that keep at least MIN_SEARCH_TOKENS_PER_RANK tokens per rank and split the sequence."""
    if "context" in constraints:
        return [constraints["context"]] if constraints["context"] > 1 else []
    try:
        seq = sequence_length(ev)
    except ConfigError:
        return []
    out, c = [], 2
    while c <= num_devices and seq // c >= MIN_SEARCH_TOKENS_PER_RANK:
        if num_devices % c == 0 and seq % (2 * c) == 0:
            out.append(c)
        c *= 2
    return out


class ContextStrategy(Strategy):
    """See module docstring; per-layer costs and the sequence length are cached in the Evaluator's state."""

    name = StrategyName.CONTEXT
    replicates_weights = True
    compiles = False

    def pinned_on(self, constraints: dict) -> bool:
        return constraints.get("context", 1) != 1

    def variants(self, ev, num_devices: int, constraints: dict, shapes_of) -> list[ParallelConfig]:
        """For each searched context degree c, every data x tensor x pipeline shape of num_devices / c
        devices (`shapes_of(n)`), with ring and Ulysses attention (or the pinned one) where they apply.

        Shapes whose micro-batch size mb is a multiple of c are left out: data x c ranks with micro-batches
        of mb / c samples run the same tokens per rank and micro-batches per step, with the same compute,
        activations and gradient-sync group, without the attention exchange, and shard ZeRO state c times
        thinner; context parallelism pays where a micro-batch cannot be split further by samples."""
        modes = [constraints["context_attention"]] if "context_attention" in constraints else list(ContextAttention)
        out = []
        for c in search_degrees(ev, num_devices, constraints):
            if num_devices % c:
                continue
            for base in shapes_of(num_devices // c):
                if base.micro_batch_size % c == 0:
                    continue   # dominated by data x c with micro-batches of mb / c (see variants' docstring)
                for mode in modes:
                    try:
                        cfg = base.replace(context=c, context_attention=mode)
                        check_config(ev, cfg)
                    except ConfigError:   # a shape that does not combine, or heads Ulysses cannot deal
                        continue
                    out.append(cfg)
        return out

    def check(self, ev, config: ParallelConfig) -> None:
        check_config(ev, config)

    def layer_cost(self, ev, layer: Layer, cost, config: ParallelConfig):
        return adjust(ev, layer, cost, config)

    def grad_sync(self, ev, config: ParallelConfig, params: float, work: DeviceWork, m: int) -> tuple[float, float]:
        return grad_sync_seconds(ev, config, params, work, m)

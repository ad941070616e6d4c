"""`planner.evaluator`: predicted step time, memory and throughput of one ParallelConfig (the
`Evaluator`, and `planner.evaluate` for one configuration).

The `Evaluator` holds what does not change between configurations of one
model on one cluster (the tensor-parallel roles, per-layer cost tables keyed
by layer signature), so the search can price thousands of configurations:
a repeated transformer block is costed once per (tensor degree,
micro-batch, dtype, recompute) and reused for every copy.

Per micro-batch and device, a layer costs its ops' roofline times (FLOPs
and bytes divided by the tensor degree where the op is sharded) plus its
tensor-parallel all-reduces, less the part the stack runs under the split GEMMs
(`overlap`, cost_models/overlap.py). The Evaluator is one pricing driver with no
branch on a strategy: it loops over the strategies the config uses
(planner/strategies/registry.py), which give nodes their split roles (tensor),
check the config against the graph, adjust layer costs (tiles, sub-grids),
impose stage bounds and add gradient traffic; the last active `Placement`
(the pipeline, or its bi-directional refinement) lays the stages out and
prices the step. Parts of it with a concern of their own are classes it inherits: a node's price
(planner/node_pricing.py), what its Execution adds, the loss among it (planner/execution_pricing.py),
and the Prediction of a priced step (planner/step_summary.py).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, TypeVar

from cost_models.comm import collective_time, link_models
from cost_models.mesh_axes import axis_collective_time
from cost_models.calibrated import calibrated_efficiency, curve_mix, in_run_factors, op_curves, per_element_cost
from cost_models.activations import SelectivePolicy
from cost_models.autocast import FLOAT32
from cost_models.compute import Efficiency
from cost_models.gpu_costs import gpu_costs
from cost_models.gpu_fit import efficiency_of
from cost_models.gpu_node import GpuGraph
from cost_models.step_costs import StepSetup
from cost_models.overlap import DeviceWork, Overlap, OverlapPreset, tp_exposed
from cost_models.hardware import Cluster
from cost_models.memory import ALLOCATOR_MARGIN
from cost_models.prediction import Prediction
from planner.config import ConfigError, ParallelConfig
from planner.graph.model import Layer, ModelGraph, OpInfo
from planner.layer_cost import AxisComm, LayerCost
from planner.execution_pricing import ExecutionPricing, compiled_layers
from planner.node_pricing import NodePricing
from planner.saved import SavedActivations
from planner.step_summary import StepSummary, input_tokens_per_sample
from planner.strategies.base import GraphSplits, Placement, Strategy
from planner.strategies.registry import STRATEGIES, node_splitter
from planner.graph.ties import tied_weights
from runtime.execution import Execution
from runtime.vocab import Collective, DeviceKind, DType, OpKind, RecomputeMode, ShardRole

T = TypeVar("T")
_GEMM_KINDS = (OpKind.LINEAR, OpKind.CONV)  # the ops whose split a tensor-parallel collective feeds


def _checked_options(selective: SelectivePolicy | str, zero3_live_parameters: float | None,
                     allocator_margin: float, sharding: str) -> SelectivePolicy:
    """The Evaluator's `selective` policy; ValueError naming the option when one of these is out of range."""
    try:
        policy = SelectivePolicy(selective)
    except ValueError:
        raise ValueError(f"selective={selective!r} is not one of {', '.join(SelectivePolicy)}") from None
    if zero3_live_parameters is not None and zero3_live_parameters <= 0:
        raise ValueError(f"zero3_live_parameters={zero3_live_parameters!r} must be a positive parameter "
                         "count, or None for whole layers")
    if not 0 <= allocator_margin < 1:
        raise ValueError(f"allocator_margin={allocator_margin!r} must be a fraction in [0, 1) of the "
                         f"allocated bytes (default {ALLOCATOR_MARGIN})")
    if sharding not in ("ilp", "all"):
        raise ValueError(f"sharding={sharding!r} is not one of 'ilp', 'all'")
    return policy


class Evaluator(NodePricing, ExecutionPricing, StepSummary):
    """Prices ParallelConfigs of one ModelGraph on one Cluster."""

    def __init__(self, graph: ModelGraph, cluster: Cluster, *, efficiency: Efficiency | None = None,
                 fused_attention: bool = True, overlap: Overlap | None = None,
                 overlap_grad_reduce: bool | None = None, grad_reduce_bytes: int | None = None,
                 sharding: str = "ilp", allocator_margin: float = ALLOCATOR_MARGIN,
                 zero3_live_parameters: float | None = None, execution: Execution | None = None,
                 setup: StepSetup | None = None,
                 selective: SelectivePolicy | str = SelectivePolicy.ATTENTION_CORE) -> None:
        """
        Args:
            efficiency: per-kind efficiencies (default: published facts for the device kind).
            fused_attention: attention kernels keep no (T x T) score matrix (flash-style).
            overlap: what the training stack overlaps (cost_models/overlap.py; default: the
                "meshplan" preset, what meshplan's own runtime does).
            overlap_grad_reduce: where given, replaces `overlap.grad_reduce` (the data-parallel
                gradient sync overlaps each stage's last backward passes).
            grad_reduce_bytes: bytes per gradient element in the data-parallel sync
                (default: `overlap.grad_reduce_dtype`'s, else the compute dtype's).
            sharding: how tensor-parallel regions are chosen: "ilp" (per layer, by the
                integer program: shard where it pays), "all" (every region, Megatron's layout).
            allocator_margin: what the caching allocator reserves beyond the bytes allocated, as a
                fraction of them (fragmentation; cost_models/memory.py ALLOCATOR_MARGIN cites the default).
            zero3_live_parameters: the most parameters ZeRO-3 holds gathered at once (DeepSpeed's
                stage3_max_live_parameters, 1e9 by default in DeepSpeed's docs/_pages/config-json.md);
                None: the current and the prefetched layer whole (FSDP, one unit per layer).
            execution: how the runtime executes the stages (runtime/execution.py: compiled or eager, the
                full or the fused chunked loss, vocabulary padding; default eager, full loss).
            setup: the step besides the model (cost_models/step_costs.StepSetup: optimizer and its
                implementation, clipping, how gradients are zeroed; default AdamW, auto, no clipping).
            selective: what the stack's selective recomputation keeps of a block
                (cost_models/activations.SelectivePolicy; default Megatron's and meshplan's: all but the
                attention core).
        """
        self.selective = _checked_options(selective, zero3_live_parameters, allocator_margin, sharding)
        self.zero3_live_parameters = zero3_live_parameters
        self.allocator_margin = allocator_margin
        self.sharding_mode = sharding
        # Bytes per device the stage partition must respect (optimize lowers it for
        # max_memory_fraction).
        self.memory_cap = float(cluster.device.memory_bytes)
        self.graph = graph
        self.cluster = cluster
        # A GPU's kernel, host and optimizer constants: a calibrated file's or a preset's fit.gpu.*, else the
        # published defaults (cost_models/gpu_costs.py); None on a CPU.
        self.gpu_costs = gpu_costs(cluster) if cluster.device.kind == DeviceKind.GPU else None
        # A calibrated cluster file carries its measured efficiencies (meshplan calibrate).
        self.eff = efficiency or calibrated_efficiency(cluster) or (
            efficiency_of(self.gpu_costs) if self.gpu_costs is not None else Efficiency.default_for(cluster.device))
        self.execution = execution or Execution()
        self.setup = setup or StepSetup()
        self.curves = op_curves(cluster) if efficiency is None else {}  # ... and its op curves (fp32)
        self.curve_mix = curve_mix(cluster)
        # a node's time in a training run over its per-op price (1, 1 unless calibrated with the probe run)
        self.in_run = in_run_factors(cluster) if efficiency is None else (1.0, 1.0)
        # what the tensor-parallel runtime adds around an in-layer all-reduce (0 when not calibrated)
        self.tp_wrapper = per_element_cost(cluster, "tensor_wrapper.")
        self.tp_embedding = per_element_cost(cluster, "tensor_embedding.")
        self.fused_attention = fused_attention
        self.overlap = overlap or Overlap.preset(OverlapPreset.MESHPLAN)
        if overlap_grad_reduce is not None:
            self.overlap = replace(self.overlap, grad_reduce=overlap_grad_reduce)
        self.grad_reduce_bytes = grad_reduce_bytes or (
            DType(self.overlap.grad_reduce_dtype).bytes if self.overlap.grad_reduce_dtype else None)
        self.strategies: tuple[Strategy, ...] = STRATEGIES
        self.splitter = node_splitter(self.strategies)   # the strategy whose split roles divide nodes
        self.sharding: GraphSplits = self.splitter.graph_splits(graph)
        # On a GPU: the dtype every value runs in (autocast), the casts, the host's dispatch per node
        self.gpu_graph = GpuGraph(graph.nodes, autocast=self.overlap.autocast) if self.gpu_costs is not None else None
        fp32 = frozenset(k for k, v in self.gpu_graph.dtypes.items() if v == FLOAT32) \
            if self.gpu_graph is not None and self.overlap.autocast else frozenset()
        self.saved = SavedActivations(graph, self.sharding, fp32)   # what each op keeps for backward
        self._nodes = {n.name: n for n in graph.nodes}
        self._state: dict[str, Any] = {}   # per strategy, what it keeps for this graph (see state())
        self._start_caches()
        self._fwd_flops_per_sample = graph.total_fwd_flops / graph.batch_size
        self._layer_inputs = self._input_bytes_per_layer()
        self.tokens_per_sample = input_tokens_per_sample(graph)
        self.ties = tied_weights(graph)
        self._logits = self._find_logits()
        self._compiled_layers = compiled_layers(graph)
        self._logits_layer = next((layer.index for layer in graph.layers if self._logits in layer.nodes), -1)

    def _start_caches(self) -> None:
        # the search prices thousands of configs x hundreds of layers: what repeats is kept
        self._layer_cache: dict[tuple, LayerCost] = {}
        self._bounds_cache: dict[tuple, list[tuple[int, int]]] = {}
        self._active_cache: dict[ParallelConfig, tuple[Strategy, ...]] = {}
        self._key_cache: dict[ParallelConfig, tuple] = {}
        self._adjusters_cache: dict[ParallelConfig, tuple[Strategy, ...]] = {}
        self._boundary_cache: dict[tuple, float] = {}
        self._axis_cache: dict[tuple, float] = {}
        self._roles_cache: dict[tuple, dict[str, str]] = {}
        self._costs_cache: dict[tuple, tuple[LayerCost, ...]] = {}

    # ---- public ---------------------------------------------------------
    def evaluate(self, config: ParallelConfig, global_batch_size: int) -> Prediction:
        self.check(config, global_batch_size)
        m = config.micro_batches(global_batch_size)
        costs = self.layer_costs(config)
        bounds = self.stage_bounds(config, costs, global_batch_size)
        return self.placement(config).step(self, config, global_batch_size, m, costs, bounds)

    def active(self, config: ParallelConfig) -> tuple[Strategy, ...]:
        """The registered strategies `config` uses, in composition order."""
        hit = self._active_cache.get(config)
        if hit is None:
            hit = self._active_cache[config] = tuple(s for s in self.strategies if s.active(config))
        return hit

    def placement(self, config: ParallelConfig) -> Placement:
        """The strategy that lays out `config`'s stages and prices its step: the last active Placement."""
        return [s for s in self.active(config) if isinstance(s, Placement)][-1]

    def state(self, key: str, make: Callable[[], T]) -> T:
        """What strategy `key` keeps for this graph on this cluster, made by `make()` on first use."""
        if key not in self._state:
            self._state[key] = make()
        return self._state[key]

    def grad_replicas(self, config: ParallelConfig) -> int:
        """Ranks that hold the same weights and sum their gradients at run time: the product of the degrees
        of the strategies that replicate weights (Strategy.replicates_weights)."""
        return math.prod(getattr(config, s.name) for s in self.strategies if s.replicates_weights)

    def grad_sync(self, config: ParallelConfig, params: float, work: DeviceWork, m: int) -> tuple[float, float]:
        """(exposed seconds, on-path seconds) per step of every active strategy's gradient and weight
        traffic, for the device holding `params` parameters whose compute per micro-batch is `work`."""
        exposed = on_path = 0.0
        for s in self.active(config):
            e, o = s.grad_sync(self, config, params, work, m)
            exposed += e
            on_path += o
        return exposed, on_path

    def node(self, name: str) -> OpInfo:
        """The graph node named `name` (fx node name)."""
        return self._nodes[name]

    def tie_costs(self, config: ParallelConfig, bounds: list[tuple[int, int]]) -> tuple[dict[int, float], float]:
        """Tied weights whose readers fall in several stages: the extra copies' parameters per
        pipeline position (the graph counts one, at the first reader) and the seconds of the
        all-reduces that sum the copies' gradients over the positions holding them."""
        p = config.pipeline
        stage_of = {layer: k for k, (lo, hi) in enumerate(bounds) for layer in range(lo, hi)}
        extra: dict[int, float] = {}
        seconds = 0.0
        for tie in self.ties:
            held = sorted({stage_of[layer] for layer in tie.layers if layer in stage_of})
            if len(held) < 2:
                continue
            shards = [self.sharding.roles[n] for n in tie.nodes if self.sharding.roles[n].sharded]
            per_rank = tie.numel / (shards[0].divisor(self.split_ranks(config)) if shards else 1.0)
            for s in held[1:]:
                extra[s % p] = extra.get(s % p, 0.0) + per_rank
            positions = sorted({s % p for s in held})
            if len(positions) > 1:
                stride = config.num_devices // p
                nbytes = per_rank * (self.grad_reduce_bytes or DType(config.dtype).bytes)
                seconds += collective_time(self.cluster, Collective.ALL_REDUCE, nbytes,
                                           [pos * stride for pos in positions]).seconds
        return extra, seconds

    def check(self, config: ParallelConfig, global_batch_size: int) -> None:
        """ValueError naming the numbers when `config` cannot run this model on this cluster."""
        if config.num_devices != self.cluster.num_devices:
            factors = (f for s in self.strategies if (f := s.mesh_factor(config)) is not None)
            raise ConfigError(
                " x ".join(f"{name} {degree}" for name, degree in factors) + " = "
                f"{config.num_devices} devices, but cluster {self.cluster.name!r} has "
                f"{self.cluster.num_devices}; choose degrees whose product is {self.cluster.num_devices}"
            )
        config.micro_batches(global_batch_size)
        try:
            for s in self.active(config):
                s.check(self, config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            self.cluster.device.peak(config.dtype)
        except ValueError as e:
            raise ConfigError(f"{e}; choose a dtype this device supports") from None

    def layer_cost(self, layer: Layer, config: ParallelConfig) -> LayerCost:
        """One layer on one device for one micro-batch under `config` (see LayerCost)."""
        return self._layer_cost(layer, config, self._layer_key(config), self._adjusters(config))

    def layer_costs(self, config: ParallelConfig) -> list[LayerCost]:
        """`layer_cost` of every layer of the graph, in order (the search's inner loop: what depends only on
        the config is worked out once)."""
        key, adjusters = self._layer_key(config), self._adjusters(config)
        if not adjusters:   # then the costs depend on the key alone: data, pipeline and ZeRO share them
            hit = self._costs_cache.get(key)
            if hit is None:
                hit = self._costs_cache[key] = tuple(self._layer_cost(layer, config, key, ())
                                                     for layer in self.graph.layers)
            return list(hit)
        if all(s.layer_cost_by_signature for s in adjusters):   # repeated blocks: each distinct layer once
            seen: dict[tuple, LayerCost] = {}
            out = []
            for layer in self.graph.layers:
                k = (layer.signature, layer.index == 0, self._boundary(layer, config))
                hit = seen.get(k)
                if hit is None:
                    hit = seen[k] = self._layer_cost(layer, config, key, adjusters)
                out.append(hit)
            return out
        return [self._layer_cost(layer, config, key, adjusters) for layer in self.graph.layers]

    def _layer_key(self, config: ParallelConfig) -> tuple:
        return (self.split_ranks(config), config.micro_batch_size, config.dtype, config.recompute,
                self.adds_into_buckets(config),
                *self._strategy_key(config))

    def _strategy_key(self, config: ParallelConfig) -> tuple:
        """What the strategies' node hooks read of `config` beyond the degrees (Strategy.cache_key), worked
        out once per config (the per-layer caches ask for it on every layer)."""
        hit = self._key_cache.get(config)
        if hit is None:
            hit = self._key_cache[config] = tuple(k for s in self.strategies for k in s.cache_key(config))
        return hit

    def _token_share(self, name: str, role: str, config: ParallelConfig,
                     active: tuple[Strategy, ...] | None = None) -> float:
        """What node `name`'s tokens are divided by on one device (Strategy.token_share of the active ones;
        `active`: those strategies, where the caller has them)."""
        share = 1
        for s in self.active(config) if active is None else active:
            share *= s.token_share(self, name, role, config)
        return share

    def _layer_cost(self, layer: Layer, config: ParallelConfig, key: tuple,
                    adjusters: tuple[Strategy, ...]) -> LayerCost:
        key = (layer.signature, layer.index == 0, *key)
        hit = self._layer_cache.get(key)
        if hit is None:
            hit = self._layer_cache[key] = self._cost_layer(layer, config)
        if hit.boundary != self._boundary(layer, config):  # same body, different cut (last layer)
            hit = self._cost_layer(layer, config)
        for s in adjusters:   # per tile, per sub-grid, ...
            hit = s.layer_cost(self, layer, hit, config)
        return hit

    def _adjusters(self, config: ParallelConfig) -> tuple[Strategy, ...]:
        """The active strategies that adjust a layer's cost (override Strategy.layer_cost)."""
        hit = self._adjusters_cache.get(config)
        if hit is None:
            hit = self._adjusters_cache[config] = tuple(s for s in self.active(config)
                                                        if type(s).layer_cost is not Strategy.layer_cost)
        return hit

    def stage_bounds(self, config: ParallelConfig, costs: list[LayerCost],
                     global_batch_size: int) -> list[tuple[int, int]]:
        """[lo, hi) layer ranges of the pipeline stages (chunks): given, or as the last active strategy
        with bounds of its own cuts them (the placement's: balanced by time under each device's memory)."""
        n, s = len(costs), config.num_stages
        names = [layer.name for layer in self.graph.layers]
        if config.stage_boundaries is not None:
            idx = []
            for name in config.stage_boundaries:
                if name not in names:
                    raise ConfigError(f"stage boundary {name!r} is not a layer of this model; "
                                      f"layers are: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
                idx.append(names.index(name))
            if idx != sorted(set(idx)) or (idx and idx[0] == 0):
                raise ConfigError("stage_boundaries must name distinct layers in model order, "
                                  "none of them the first layer")
            cuts = [0, *idx, n]
            return [(cuts[k], cuts[k + 1]) for k in range(s)]
        key = (config, global_batch_size)
        hit = self._bounds_cache.get(key)
        if hit is None:
            weights = [c.forward + c.backward + c.recompute + c.comm_forward + c.comm_backward for c in costs]
            fits = self.placement(config).stage_fits(self, config, costs, global_batch_size) if s > 1 else None
            for strategy in reversed(self.active(config)):
                hit = strategy.stage_bounds(self, config, costs, weights, fits)
                if hit is not None:
                    break
            self._bounds_cache[key] = hit
        return hit

    # ---- internals ------------------------------------------------------
    def axis_seconds(self, mesh: dict[str, int], axis: str, op: str, nbytes: float) -> float:
        """Seconds of collective `op` ("all_reduce", "p2p", ...) of `nbytes` bytes over mesh axis `axis`
        (0 on an axis of size 1)."""
        if mesh[axis] <= 1 or nbytes <= 0:
            return 0.0
        key = (tuple(mesh.items()), axis, op, nbytes)
        hit = self._axis_cache.get(key)
        if hit is None:
            hit = self._axis_cache[key] = axis_collective_time(self.cluster, mesh, axis, op, nbytes).seconds
        return hit

    def p2p_seconds(self, config: ParallelConfig):
        """p2p seconds for n bytes between neighbouring pipeline ranks."""
        intra, inter = link_models(self.cluster)
        stride = config.num_devices // config.pipeline  # pipeline is the outermost mesh axis
        link = intra if stride < self.cluster.devices_per_node else inter
        return lambda n: link.alpha + n * link.beta

    def _input_bytes_per_layer(self) -> list[int]:
        layers = self.graph.layers
        first = sum(n.output_bytes for n in self.graph.nodes if n.kind == OpKind.INPUT)
        return [first] + [layers[k - 1].boundary_bytes for k in range(1, len(layers))]

    def _boundary(self, layer: Layer, config: ParallelConfig) -> float:
        key = (layer.index, config.micro_batch_size, config.dtype, self.split_ranks(config),
               *self._strategy_key(config))
        hit = self._boundary_cache.get(key)
        if hit is None:
            hit = self._boundary_cache[key] = self._boundary_bytes(layer, config)
        return hit

    def _boundary_bytes(self, layer: Layer, config: ParallelConfig) -> float:
        share = 1
        for s in self.active(config):
            share *= s.boundary_share(self, layer, config)
        return layer.boundary_bytes * config.micro_batch_size / self.graph.batch_size * \
            DType(config.dtype).bytes / 4 / share

    def node_roles(self, config: ParallelConfig) -> dict[str, str]:
        """Split role of every non-replicated node under `config` (fx node name -> role).

        Cached on what the tensor strategy's choice depends on (planner/strategies/tensor/strategy.py keys its
        per-layer decision the same way); the search asks once per mesh shape."""
        key = ("roles", self.split_ranks(config), config.micro_batch_size, config.dtype, *self._strategy_key(config))
        hit = self._roles_cache.get(key)
        if hit is None:
            hit = self._roles_cache[key] = {name: role for layer in self.graph.layers
                                            for name, role in self.layer_roles(layer, config).items()}
        return dict(hit)

    def layer_roles(self, layer: Layer, config: ParallelConfig) -> dict[str, str]:
        """The split roles the active strategies give `layer`'s nodes (the others are replicated)."""
        out: dict[str, str] = {}
        for s in self.active(config):
            out.update(s.node_roles(self, layer, config))
        return out

    def _cost_layer(self, layer: Layer, config: ParallelConfig) -> LayerCost:
        roles = self.layer_roles(layer, config)
        head = self._fused_head(config)
        compiled = self.execution.whole_stage or (self.execution.compile and layer.index in self._compiled_layers)
        costs = [self.node_cost(self._nodes[name], roles.get(name, ShardRole.REPLICATE), config, fused_head=name == head,
                                compiled=compiled) for name in layer.nodes]
        fwd = sum(c.fwd for c in costs)
        # The stack may run the tensor-parallel communication under the split GEMMs it feeds.
        gemms = [c for name, c in zip(layer.nodes, costs) if name in roles and self._nodes[name].kind in _GEMM_KINDS]
        ov = self.overlap
        gemm_f, gemm_b = sum(c.fwd for c in gemms), sum(c.bwd for c in gemms)
        comm = []   # per axis, what the GEMMs do not hide (and, under full recompute, the forward's again)
        for axis in dict.fromkeys(a.axis for c in costs for a in c.comm):
            f_a = tp_exposed(sum(c.on(axis).forward for c in costs), gemm_f, ov.tp_comm, ov.contention)
            b_a = tp_exposed(sum(c.on(axis).backward for c in costs), gemm_b, ov.tp_comm, ov.contention)
            comm.append(AxisComm(axis, f_a, b_a + (f_a if config.recompute == RecomputeMode.FULL else 0.0)))
        params = sum(c.params for c in costs)
        scale = config.micro_batch_size / self.graph.batch_size
        layer_in = self._layer_inputs[layer.index] * scale * DType(config.dtype).bytes / 4
        acts = self.saved.layer(layer, roles, config, ranks=self.split_ranks(config),
                                sequence=self.splitter.sequence_ranks(config), fused_attention=self.fused_attention,
                                layer_input=layer_in, policy=self.selective)
        recompute = sum(c.fwd for name, c in zip(layer.nodes, costs) if name in acts.recomputed)
        bwd = sum(c.bwd for c in costs)
        host_f = sum(c.host_fwd for c in costs)
        host_b = sum(c.host_bwd for c in costs) + sum(c.host_fwd for name, c in zip(layer.nodes, costs)
                                                      if name in acts.recomputed)
        temp = max((c.temp for c in costs), default=0.0)
        loss = self._loss_cost(config, roles) if layer.index == self._logits_layer else None
        extra = self._batch_copies(layer, config)
        fwd, host_f = fwd + extra.device, host_f + extra.host
        if loss is not None:
            fwd, bwd = fwd + loss.forward.device, bwd + loss.backward.device
            host_f, host_b = host_f + loss.forward.host, host_b + loss.backward.host
        return LayerCost(forward=fwd, backward=bwd, recompute=recompute,
                         comm=tuple(comm),
                         saved=acts.kept + (loss.kept_bytes if loss is not None else 0.0), working=acts.working,
                         params=params, largest_param_layer=params, temporary=temp,
                         boundary=self._boundary(layer, config), host_forward=host_f, host_backward=host_b,
                         loss_forward=loss.forward.device if loss is not None else 0.0,
                         loss_backward=loss.backward.device if loss is not None else 0.0,
                         loss_peak=max(loss.peak_bytes - loss.kept_bytes, 0.0) if loss is not None else 0.0,
                         weight_copies=sum(c.weight_copies for c in costs), tensors=sum(c.tensors for c in costs))


def evaluate(model_or_graph: Any, cluster: Cluster, config: ParallelConfig, *, global_batch_size: int,
             example_inputs: Any = None, efficiency: Efficiency | None = None,
             fused_attention: bool = True, **evaluator_options: Any) -> Prediction:
    """Predicted step time, memory and throughput of `config` for a model on `cluster`.

    Args:
        model_or_graph: a ModelGraph from planner.capture, or an nn.Module (then
            `example_inputs` giving one sample's shape, or a small batch, is required).
        cluster: the Cluster; its device count must equal the config's degree product.
        config: the ParallelConfig to price.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        efficiency: per-kind efficiencies replacing the published defaults (calibration).
        fused_attention: attention keeps no (T x T) scores (flash-style kernels).
        evaluator_options: further Evaluator options (sharding, overlap_grad_reduce, ...).

    Raises:
        ConfigError (a ValueError) naming the numbers when the config cannot run.
    """
    graph = as_graph(model_or_graph, example_inputs)
    return Evaluator(graph, cluster, efficiency=efficiency, fused_attention=fused_attention,
                     **evaluator_options).evaluate(config, global_batch_size)


def as_graph(model_or_graph: Any, example_inputs: Any) -> ModelGraph:
    if isinstance(model_or_graph, ModelGraph):
        return model_or_graph
    if example_inputs is None:
        raise ValueError("pass example_inputs (one sample's inputs, or a small batch) with a model, "
                         "or a ModelGraph from planner.capture")
    from planner.graph.capture import capture

    return capture(model_or_graph, example_inputs)

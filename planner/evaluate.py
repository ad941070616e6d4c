"""`planner.evaluate`: predicted step time, memory and throughput of one ParallelConfig.

The `Evaluator` holds what does not change between configurations of one
model on one cluster (the tensor-parallel roles, per-layer cost tables keyed
by layer signature), so the search can price thousands of configurations:
a repeated transformer block is costed once per (tensor degree,
micro-batch, dtype, recompute) and reused for every copy.

Per micro-batch and device, a layer costs its ops' roofline times (FLOPs
and bytes divided by the tensor degree where the op is sharded) plus its
tensor-parallel all-reduces. Stages are contiguous layer ranges balanced by
time; the slowest device sets the pipeline slot; fill and drain follow the
schedule; the data-parallel gradient sync overlaps the last micro-batch's
backward; ZeRO-3 parameter gathers sit on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cost_models import gems
from cost_models.comm import collective_time, link_models
from cost_models.mesh_axes import axis_collective_time
from cost_models.calibrated import calibrated_efficiency, curve_mix, in_run_factors, op_curves, per_element_cost
from cost_models.compute import Efficiency, op_time, wave_efficiency
from cost_models.op_curves import node_curve_times
from cost_models.hardware import Cluster
from cost_models.memory import adam_step_bytes, live_micro_batches, param_bytes
from cost_models.prediction import MemoryBreakdown, Prediction, StagePrediction, TimeBreakdown
from cost_models.schedule import pipeline_time
from planner.config import ConfigError, ParallelConfig
from planner.graph import Layer, ModelGraph, OpInfo
from planner.gems_memory import bidirectional_bounds
from planner.ilp import Edge, RegionOption, choose_shardings
from planner.subgraph_cost import subgraph_layer_cost
from planner.sharding import ShardingPlan, find_sharding
from planner.stage_split import balanced_partition
from planner.ties import tied_weights
from planner.spatial import SpatialPricer
from runtime.vocab import DType, ShardRole, element_bytes

# Data-parallel gradients are reduced in buckets as backward produces them;
# only the last bucket's reduction is always exposed (PyTorch DDP's default bucket).
GRAD_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class LayerCost:
    """One layer on one device for one micro-batch. Seconds and bytes."""

    forward: float          # compute only
    backward: float         # compute only
    recompute: float        # extra forward work in backward (per recompute mode)
    tp_forward: float       # tensor-parallel collectives in forward
    tp_backward: float      # ... in backward (and in the recomputed forward)
    saved: float            # activation bytes kept for backward (per recompute mode)
    working: float          # bytes live while this layer's backward runs under full recompute
    params: float           # parameters held per device (count)
    largest_param_layer: float  # same as params (kept for ZeRO-3 gather buffers)
    temporary: float        # largest single output (+ its gradient) in bytes
    boundary: float         # bytes crossing the cut after this layer


class Evaluator:
    """Prices ParallelConfigs of one ModelGraph on one Cluster."""

    def __init__(self, graph: ModelGraph, cluster: Cluster, *, efficiency: Efficiency | None = None,
                 fused_attention: bool = True, overlap_grad_reduce: bool = True,
                 grad_reduce_bytes: int | None = None, sharding: str = "ilp") -> None:
        """
        Args:
            efficiency: per-kind efficiencies (default: published facts for the device kind).
            fused_attention: attention kernels keep no (T x T) score matrix (flash-style).
            overlap_grad_reduce: the data-parallel gradient sync overlaps the last
                micro-batch's backward (meshplan's runtime and PyTorch DDP do; Megatron-LM
                2021 reduced after the pipeline flush).
            grad_reduce_bytes: bytes per gradient element in the data-parallel sync
                (default: the compute dtype's; 4 where fp32 main gradients are reduced).
            sharding: how tensor-parallel regions are chosen: "ilp" (per layer, by the
                integer program: shard where it pays), "all" (every region, Megatron's layout).
        """
        if sharding not in ("ilp", "all"):
            raise ValueError(f"sharding={sharding!r} is not one of 'ilp', 'all'")
        self.sharding_mode = sharding
        # Bytes per device the stage partition must respect (optimize lowers it for
        # max_memory_fraction).
        self.memory_cap = float(cluster.device.memory_bytes)
        self.graph = graph
        self.cluster = cluster
        # A calibrated cluster file carries its measured efficiencies (meshplan calibrate).
        self.eff = efficiency or calibrated_efficiency(cluster) or Efficiency.default_for(cluster.device)
        self.curves = op_curves(cluster) if efficiency is None else {}  # ... and its op curves (fp32)
        self.curve_mix = curve_mix(cluster)
        # a node's time in a training run over its per-op price (1, 1 unless calibrated with the probe run)
        self.in_run = in_run_factors(cluster) if efficiency is None else (1.0, 1.0)
        # what the tensor-parallel runtime adds around an in-layer all-reduce (0 when not calibrated)
        self.tp_wrapper = per_element_cost(cluster, "tensor_wrapper.")
        self.tp_embedding = per_element_cost(cluster, "tensor_embedding.")
        self.fused_attention = fused_attention
        self.overlap_grad_reduce = overlap_grad_reduce
        self.grad_reduce_bytes = grad_reduce_bytes
        self.sharding: ShardingPlan = find_sharding(graph)
        self._nodes = {n.name: n for n in graph.nodes}
        self._layer_cache: dict[tuple, LayerCost] = {}
        self.subgraph_regions: dict[int, tuple] = {}   # sub-grids -> split regions (planner/subgraph_cost.py)
        self._region_cache: dict[tuple, frozenset[int]] = {}  # positions within the layer
        self._bounds_cache: dict[tuple, list[tuple[int, int]]] = {}
        self._fwd_flops_per_sample = graph.total_fwd_flops / graph.batch_size
        self._layer_inputs = self._input_bytes_per_layer()
        self.tokens_per_sample = _tokens_per_sample(graph)
        self.spatial = SpatialPricer(graph)
        self.ties = tied_weights(graph)

    # ---- public ---------------------------------------------------------
    def evaluate(self, config: ParallelConfig, global_batch_size: int) -> Prediction:
        self.check(config, global_batch_size)
        m = config.micro_batches(global_batch_size)
        p, v, d = config.pipeline, config.virtual_stages, config.data
        costs = [self.layer_cost(layer, config) for layer in self.graph.layers]
        bounds = self.stage_bounds(config, costs, global_batch_size)
        if config.bidirectional:
            return self._evaluate_bidirectional(config, global_batch_size, m, costs, bounds)
        dev = self.cluster.device
        mesh = config.mesh

        # Per device (pipeline position i holds chunks i, i+p, ...).
        slots, parts, mems, stages = [], [], [], []
        pb = param_bytes(config.dtype, config.zero, d)
        p2p = self.p2p_seconds(config)
        tie_params, tie_seconds = self._tie_costs(config, bounds)
        for i in range(p):
            chunks = [bounds[c] for c in range(i, config.num_stages, p)]
            cs = [c for lo, hi in chunks for c in costs[lo:hi]]
            fwd = sum(c.forward for c in cs)
            bwd = sum(c.backward for c in cs)
            rc = sum(c.recompute for c in cs)
            tp = sum(c.tp_forward + c.tp_backward for c in cs)
            pp = sum(2 * p2p(costs[hi - 1].boundary) for lo, hi in chunks if p > 1)
            slots.append(fwd + bwd + rc + tp + pp)
            parts.append((fwd, bwd, rc, tp, pp))
            params = sum(c.params for c in cs) + tie_params.get(i, 0.0)
            live = live_micro_batches(config.schedule, i, p, m, v)
            if config.recompute == "full":
                acts = live * sum(c.saved for c in cs) + max((c.working for c in cs), default=0.0)
            else:
                acts = live * sum(c.saved for c in cs)
            gather = 0.0
            if config.zero == 3:  # the gathered weights of the current and the prefetched layer
                gather = 2 * max((c.params for c in cs), default=0.0) * DType(config.dtype).bytes
            comm_buf = (2 * min(GRAD_BUCKET_BYTES, params * pb.gradients) if d > 1 else 0.0) + \
                (2 * costs[chunks[-1][1] - 1].boundary if p > 1 else 0.0)
            mem = MemoryBreakdown(
                parameters=params * pb.weights + gather, gradients=params * pb.gradients,
                optimizer=params * pb.optimizer, activations=acts, comm_buffers=comm_buf,
                temporary=max((c.temporary for c in cs), default=0.0),
            )
            mems.append((mem, params))
            for (lo, hi) in chunks:
                stages.append((lo, hi, i, mem))

        crit = max(range(p), key=lambda i: slots[i])
        fwd, bwd, rc, tp, pp = parts[crit]
        total, bubble = pipeline_time(config.schedule, p, m, slots[crit], v)

        # Data-parallel gradient sync / ZeRO traffic for the critical device.
        params_crit = mems[crit][1]
        data_comm = zero_comm = 0.0
        if d > 1:
            grad_bytes = params_crit * (self.grad_reduce_bytes or DType(config.dtype).bytes)
            weight_bytes = params_crit * DType(config.dtype).bytes
            # The last micro-batch's backward on this device hides the sync, bucket by bucket.
            window = bwd + rc if self.overlap_grad_reduce else 0.0
            if config.zero <= 1:
                ar = self._axis(mesh, "data", "all_reduce", grad_bytes)
                tail = self._axis(mesh, "data", "all_reduce", min(GRAD_BUCKET_BYTES, grad_bytes))
                data_comm = max(tail, ar - window)
                if config.zero == 1:  # updated weight shards are gathered after the step
                    data_comm += self._axis(mesh, "data", "all_gather", weight_bytes)
            elif config.zero == 2:
                rs = self._axis(mesh, "data", "reduce_scatter", grad_bytes)
                tail = self._axis(mesh, "data", "reduce_scatter", min(GRAD_BUCKET_BYTES, grad_bytes))
                data_comm = max(tail, rs - window) + self._axis(mesh, "data", "all_gather", weight_bytes)
            else:
                # ZeRO-3 gathers the weights before each micro-batch's forward and
                # again before its backward (the recomputed forward reuses that
                # gather) and reduce-scatters the gradients: the next layer's
                # compute waits on its gather, so these are charged in full.
                per_mb = 2 * self._axis(mesh, "data", "all_gather", weight_bytes) + \
                    self._axis(mesh, "data", "reduce_scatter", grad_bytes)
                zero_comm = m * per_mb
        data_comm += self.spatial.grad_sync_seconds(config, self)  # tile weight gradients summed
        data_comm += tie_seconds  # a tied weight's copies summed after the gradient sync
        opt_params = params_crit / (d if config.zero >= 1 else 1)
        optimizer = opt_params * adam_step_bytes(config.dtype) / (dev.memory_bandwidth * self.eff.memory)

        time = TimeBreakdown(forward=m * fwd, backward=m * bwd, recompute=m * rc, tensor_comm=m * tp,
                             pipeline_comm=m * pp, bubble=bubble, data_comm=data_comm,
                             zero_comm=zero_comm, optimizer=optimizer)
        return self._prediction(config, global_batch_size, m, costs, stages, time,
                                max((mem for mem, _ in mems), key=lambda x: x.total),
                                busy=m * (fwd + bwd + rc) + optimizer)

    def _prediction(self, config: ParallelConfig, global_batch_size: int, m: int, costs: list[LayerCost],
                    stages: list, time: TimeBreakdown, peak_mem: MemoryBreakdown, busy: float) -> Prediction:
        """Assemble a Prediction from the step's time breakdown and the largest device footprint."""
        dev = self.cluster.device
        step = time.total
        samples = global_batch_size / step
        model_flops = 3 * self._fwd_flops_per_sample * samples / config.num_devices
        peak_flops = dev.peak(config.dtype)
        stage_preds = tuple(
            StagePrediction(
                index=k, first_layer=self.graph.layers[lo].name, last_layer=self.graph.layers[hi - 1].name,
                num_layers=hi - lo,
                forward=sum(c.forward + c.tp_forward for c in costs[lo:hi]),
                backward=sum(c.backward + c.recompute + c.tp_backward for c in costs[lo:hi]),
                memory=mem,
            )
            for k, (lo, hi, _i, mem) in enumerate(sorted(stages, key=lambda s: s[0]))
        )
        return Prediction(
            step_time=step, time=time, peak_memory=peak_mem.total, memory=peak_mem,
            memory_capacity=float(dev.memory_bytes), fits=peak_mem.total <= dev.memory_bytes,
            samples_per_s=samples,
            tokens_per_s=samples * self.tokens_per_sample if self.tokens_per_sample else None,
            model_flops_per_device=model_flops, mfu=model_flops / peak_flops,
            num_micro_batches=m, stages=stage_preds,
            step_energy=self._energy(step, busy, config.num_devices),
        )

    def _evaluate_bidirectional(self, config: ParallelConfig, global_batch_size: int, m: int,
                                costs: list[LayerCost], bounds: list[tuple[int, int]]) -> Prediction:
        """GEMS: device r runs stage r of replica A and stage p-1-r of replica B (cost_models.gems)."""
        p, d, T = config.pipeline, config.data, config.replicas_per_direction
        dev = self.cluster.device
        per_stage = [costs[lo:hi] for lo, hi in bounds]
        fc = [sum(c.forward for c in cs) for cs in per_stage]
        bc = [sum(c.backward for c in cs) for cs in per_stage]
        rc = [sum(c.recompute for c in cs) for cs in per_stage]
        tp = [sum(c.tp_forward + c.tp_backward for c in cs) for cs in per_stage]
        f = [fc[k] + sum(c.tp_forward for c in per_stage[k]) for k in range(p)]
        b = [bc[k] + rc[k] + sum(c.tp_backward for c in per_stage[k]) for k in range(p)]
        link = self.p2p_seconds(config)
        hop = max(link(costs[hi - 1].boundary) for lo, hi in bounds[:-1])
        with_p2p, _ = gems.simulate(f, b, T, hop)
        without_p2p, busy = gems.simulate(f, b, T, 0.0)
        crit = max(range(p), key=lambda i: busy[i])
        pair = gems.pair_of(crit, p)
        both = (crit, pair)  # the middle device of an odd pipeline runs its stage for both replicas
        pb = param_bytes(config.dtype, 0, d)
        mems, stages = [], []
        for i in range(p):
            j = gems.pair_of(i, p)
            held = per_stage[i] + (per_stage[j] if j != i else [])
            params = sum(c.params for c in held)
            # One micro-batch in flight per device: A's backward ends before B's forward starts.
            if config.recompute == "full":
                acts = max(sum(c.saved for c in per_stage[k]) + max((c.working for c in per_stage[k]), default=0.0)
                           for k in {i, j})
            else:
                acts = max(sum(c.saved for c in per_stage[k]) for k in {i, j})
            mem = MemoryBreakdown(parameters=params * pb.weights, gradients=params * pb.gradients,
                                  optimizer=params * pb.optimizer, activations=acts,
                                  comm_buffers=2 * max(costs[hi - 1].boundary for lo, hi in bounds),
                                  temporary=max((c.temporary for c in held), default=0.0))
            mems.append((mem, params))
        for k, (lo, hi) in enumerate(bounds):
            stages.append((lo, hi, k, mems[k][0]))
        # Devices r and p-1-r (in every data replica) hold copies of the same two stages and
        # all-reduce their flattened gradients after the step, higher stage first.
        data_comm = max(self._pair_allreduce(config, i, mems[i][1]) for i in range(p))
        optimizer = mems[crit][1] * adam_step_bytes(config.dtype) / (dev.memory_bandwidth * self.eff.memory)
        time = TimeBreakdown(
            forward=T * sum(fc[k] for k in both), backward=T * sum(bc[k] for k in both),
            recompute=T * sum(rc[k] for k in both), tensor_comm=T * sum(tp[k] for k in both),
            pipeline_comm=with_p2p - without_p2p, bubble=without_p2p - busy[crit],
            data_comm=data_comm, optimizer=optimizer)
        return self._prediction(config, global_batch_size, m, costs, stages, time,
                                max((mem for mem, _ in mems), key=lambda x: x.total),
                                busy=busy[crit] + optimizer)

    def _tie_costs(self, config: ParallelConfig, bounds: list[tuple[int, int]]) -> tuple[dict[int, float], float]:
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
            per_rank = tie.numel / (shards[0].divisor(config.tensor) if shards else 1.0)
            for s in held[1:]:
                extra[s % p] = extra.get(s % p, 0.0) + per_rank
            positions = sorted({s % p for s in held})
            if len(positions) > 1:
                stride = config.num_devices // p
                nbytes = per_rank * (self.grad_reduce_bytes or DType(config.dtype).bytes)
                seconds += collective_time(self.cluster, "all_reduce", nbytes,
                                           [pos * stride for pos in positions]).seconds
        return extra, seconds

    def _pair_allreduce(self, config: ParallelConfig, device: int, params: float) -> float:
        """Seconds to all-reduce a device's gradients with its pair over every data replica."""
        # Spatial lanes (data x spatial coordinates) sum their tile gradients in the same all-reduce.
        p, d, t = config.pipeline, config.data * config.spatial, config.tensor
        pair = gems.pair_of(device, p)
        ranks = sorted({(pos * d + j) * t for pos in (device, pair) for j in range(d)})
        if len(ranks) < 2:
            return 0.0
        nbytes = params * (self.grad_reduce_bytes or DType(config.dtype).bytes)
        return collective_time(self.cluster, "all_reduce", nbytes, ranks).seconds

    def _energy(self, step: float, busy: float, devices: int) -> float:
        """Joules per step: every device busy for `busy` s at active power, idle the rest."""
        dev = self.cluster.device
        busy = min(busy, step)
        return devices * (busy * dev.active_watts + (step - busy) * dev.idle_watts)

    def check(self, config: ParallelConfig, global_batch_size: int) -> None:
        """ValueError naming the numbers when `config` cannot run this model on this cluster."""
        if config.num_devices != self.cluster.num_devices:
            raise ConfigError(
                f"data {config.data} x tensor {config.tensor} x pipeline {config.pipeline}"
                + (f" x spatial {config.spatial}" if config.spatial > 1 else "") + " = "
                f"{config.num_devices} devices, but cluster {self.cluster.name!r} has "
                f"{self.cluster.num_devices}; choose degrees whose product is {self.cluster.num_devices}"
            )
        config.micro_batches(global_batch_size)
        try:
            self.sharding.check(config.tensor)
            if config.spatial > 1:
                self.spatial.until_index(config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if config.num_stages > len(self.graph.layers):
            raise ConfigError(f"{config.num_stages} pipeline stages but the model has only "
                              f"{len(self.graph.layers)} layers to cut; use at most {len(self.graph.layers)}")
        try:
            self.cluster.device.peak(config.dtype)
        except ValueError as e:
            raise ConfigError(f"{e}; choose a dtype this device supports") from None

    def layer_cost(self, layer: Layer, config: ParallelConfig) -> LayerCost:
        key = (layer.signature, layer.index == 0, config.tensor, config.micro_batch_size,
               config.dtype, config.recompute)
        hit = self._layer_cache.get(key)
        if hit is None:
            hit = self._layer_cache[key] = self._cost_layer(layer, config)
        if hit.boundary != self._boundary(layer, config):  # same body, different cut (last layer)
            hit = self._cost_layer(layer, config)
        if config.spatial > 1:  # per tile (planner/spatial.py)
            hit = self.spatial.adjust(layer, hit, config, self)
        if config.subgraph > 1:  # per sub-grid (planner/subgraph_cost.py)
            hit = subgraph_layer_cost(self, layer, hit, config)
        return hit

    def stage_bounds(self, config: ParallelConfig, costs: list[LayerCost],
                     global_batch_size: int) -> list[tuple[int, int]]:
        """[lo, hi) layer ranges of the pipeline stages (chunks): given, or balanced by time
        under each device's memory (see balanced_partition)."""
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
        key = (config.tensor, config.micro_batch_size, config.dtype, config.recompute, s, config.pipeline,
               config.schedule, config.zero, config.data, global_batch_size, config.bidirectional,
               config.spatial, config.spatial_split, config.spatial_until, config.spatial_batchnorm, config.subgraph)
        hit = self._bounds_cache.get(key)
        if hit is None:
            weights = [c.forward + c.backward + c.recompute + c.tp_forward + c.tp_backward for c in costs]
            fits = self._stage_memory_check(config, costs, global_batch_size) \
                if s > 1 and not config.bidirectional else None
            if config.spatial > 1 and s > 1:  # the tiles are gathered before the first cut (also bidirectional)
                hit = self._bounds_cache[key] = self.spatial.partition(config, weights, s, fits, balanced_partition)
            elif config.bidirectional:   # stage r fits together with stage p-1-r (planner/gems_memory.py)
                hit = self._bounds_cache[key] = bidirectional_bounds(config, costs, weights, self.memory_cap,
                                                                     balanced_partition)
            else:
                hit = self._bounds_cache[key] = balanced_partition(weights, s, fits)
        return hit

    def _stage_memory_check(self, config: ParallelConfig, costs: list[LayerCost], global_batch_size: int):
        """fits(stage, lo, hi): whether layers [lo, hi) fit on the device that runs that stage.

        Weights, gradients and optimizer state per parameter, plus activations
        times the micro-batches the schedule keeps live on that device; under
        the interleaved schedule each of the v chunks gets 1/v of the memory.
        """
        pb = param_bytes(config.dtype, config.zero, config.data).total
        m = config.micro_batches(global_batch_size)
        v = config.virtual_stages
        par, act = [0.0], [0.0]
        for c in costs:
            par.append(par[-1] + c.params * pb)
            act.append(act[-1] + c.saved)
        extra = max((c.working for c in costs), default=0.0) + max((c.temporary for c in costs), default=0.0)
        cap = self.memory_cap / v
        live = [live_micro_batches(config.schedule, i, config.pipeline, m, v) for i in range(config.pipeline)]

        def fits(stage: int, lo: int, hi: int) -> bool:
            i = stage % config.pipeline
            return (par[hi] - par[lo]) + live[i] * (act[hi] - act[lo]) + extra / v <= cap

        return fits

    # ---- internals ------------------------------------------------------
    def _axis(self, mesh: dict, axis: str, op: str, nbytes: float) -> float:
        if mesh[axis] <= 1 or nbytes <= 0:
            return 0.0
        return axis_collective_time(self.cluster, mesh, axis, op, nbytes).seconds

    def p2p_seconds(self, config: ParallelConfig):
        """p2p seconds for n bytes between neighbouring pipeline ranks."""
        intra, inter = link_models(self.cluster)
        stride = config.num_devices // config.pipeline  # pipeline is the outermost mesh axis
        link = intra if stride < self.cluster.devices_per_node else inter
        return lambda n: link.alpha + n * link.beta

    def _wave_efficiency(self, n: OpInfo, role: str, scale: float, t: int) -> float:
        """Wave quantization of a Linear/conv GEMM on this device, for its per-rank shape."""
        units = self.cluster.device.compute_units
        if not units or n.kind not in ("linear", "conv") or not n.output_meta:
            return 1.0
        shape = n.output_meta[0].shape
        split = t if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT) else 1
        cols = shape[1] if n.kind == "conv" and len(shape) >= 3 else shape[-1]  # conv: (B*H*W) x out_channels
        rows = n.output_meta[0].numel // max(cols, 1)
        return wave_efficiency(max(int(rows * scale), 1), max(cols // split, 1), units)

    def _input_bytes_per_layer(self) -> list[int]:
        layers = self.graph.layers
        first = sum(n.output_bytes for n in self.graph.nodes if n.kind == "input")
        return [first] + [layers[k - 1].boundary_bytes for k in range(1, len(layers))]

    def _boundary(self, layer: Layer, config: ParallelConfig) -> float:
        return layer.boundary_bytes * config.micro_batch_size / self.graph.batch_size * \
            DType(config.dtype).bytes / 4

    def _node_cost(self, n: OpInfo, role: str, config: ParallelConfig) -> _NodeCost:
        """One node on one device for one micro-batch, with `role` ("replicate" or its split role)."""
        dev = self.cluster.device
        t = config.tensor
        sharded = role != "replicate" and t > 1
        # a padded split (a vocabulary t does not divide) leaves each rank ceil(size / t) of it
        div = self.sharding.roles[n.name].divisor(t) if sharded else 1
        scale = config.micro_batch_size / self.graph.batch_size
        ds = _dtype_scale(n, config.dtype)
        peak, bw = dev.peak(config.dtype), dev.memory_bandwidth
        act_in = sum(mm.nbytes for mm in n.input_meta)
        param_read = max(n.bytes_read - act_in, 0)
        nbytes = ((act_in + n.bytes_written) * scale + param_read) * ds / div
        f_bytes, b_bytes = nbytes, 2 * nbytes
        if n.kind == "attention" and not self.fused_attention:
            # Unfused attention materializes the scores: Q@K^T writes them, softmax
            # reads and writes them, P@V reads them (4 passes; backward 6). Dropout
            # on the probabilities adds a read, a write and a 1-byte mask each way.
            scores = _score_bytes(n) * scale * ds / div
            drop = 2.5 if (n.attr("dropout_p") or 0) > 0 else 0.0
            f_bytes += (4 + drop) * scores
            b_bytes += (6 + drop) * scores
        measured = self._curve_times(n, scale / div, config.dtype, n.param_count / div)
        if measured is not None:
            f, b = measured[0], measured[1] if n.requires_grad else 0.0
        else:
            waves = self._wave_efficiency(n, role if sharded else "replicate", scale, t)
            f = op_time(n.kind, n.fwd_flops * scale / div, f_bytes, peak, bw, self.eff, shape_efficiency=waves)
            b = op_time(n.kind, n.bwd_flops * scale / div, b_bytes, peak, bw, self.eff,
                        kernels=2 if n.param_count or param_read else 1,
                        shape_efficiency=waves, backward=True) if n.requires_grad else 0.0
        f, b = f * self.in_run[0], b * self.in_run[1]
        tp_f = tp_b = 0.0
        if sharded:
            shard = self.sharding.roles[n.name]
            mesh = config.mesh
            if shard.fwd_allreduce:
                tp_f = self._axis(mesh, "tensor", "all_reduce", shard.fwd_allreduce * scale * ds)
            if shard.bwd_allreduce:
                tp_b = self._axis(mesh, "tensor", "all_reduce", shard.bwd_allreduce * scale * ds)
            if shard.fwd_allreduce or shard.bwd_allreduce:
                # What the runtime adds around the all-reduce (calibrated; 0 otherwise): a vocabulary-
                # parallel embedding masks the ids it does not hold and zeroes their outputs; a layer's
                # autograd function costs both ways and copies the values it reduces.
                elements = max(shard.fwd_allreduce, shard.bwd_allreduce) * scale / 4  # fp32 bytes
                wf, wb = (self.tp_embedding if role == ShardRole.VOCAB else self.tp_wrapper).at(elements)
                tp_f, tp_b = tp_f + wf, tp_b + wb
        saved = n.saved_bytes
        if n.kind == "attention":
            # Fused (flash) attention keeps q, k, v, the output and a row statistic;
            # unfused attention also keeps the (T x T) probabilities.
            saved = act_in + n.output_bytes + (0 if self.fused_attention else _score_bytes(n))
        if config.recompute == "selective" and n.kind in ("attention", "softmax"):
            saved = 0
        params = _params_per_rank(n, role if sharded else "replicate", div) if n.param_count else 0.0
        return _NodeCost(fwd=f, bwd=b, attn_fwd=f if n.kind in ("attention", "softmax") else 0.0,
                         tp_fwd=tp_f, tp_bwd=tp_b, saved=saved * scale * ds / div, params=params,
                         temp=2 * n.output_bytes * scale * ds / div)

    def _curve_times(self, n: OpInfo, share: float, dtype: str, weights: float) -> tuple[float, float] | None:
        """(forward s, backward s) of `n` off the calibrated op curves (fp32 only), or None."""
        return node_curve_times(n, self.curves, self.curve_mix, share, weights) if dtype == "fp32" else None

    def sharded_regions(self, layer: Layer, config: ParallelConfig) -> frozenset[int]:
        """Regions of `layer` the ILP shards at this tensor degree.

        The decision is cached per layer signature, as the positions of the chosen
        regions within the layer (first, second, ...): repeated blocks share the
        decision but each has its own region ids.
        """
        if config.tensor == 1:
            return frozenset()
        roles = self.sharding.roles
        by_region: dict[int, list[OpInfo]] = {}  # in order of first appearance in the layer
        for name in layer.nodes:
            r = roles[name].region
            if r >= 0:
                by_region.setdefault(r, []).append(self._nodes[name])
        ordered = list(by_region)
        key = (layer.signature, config.tensor, config.micro_batch_size, config.dtype)
        hit = self._region_cache.get(key)
        if hit is not None:
            return frozenset(ordered[i] for i in hit if i < len(ordered))
        pb = param_bytes(config.dtype, config.zero, config.data).total
        options, edges = [], []
        for r, nodes in by_region.items():
            rep = [self._node_cost(n, "replicate", config) for n in nodes]
            sh = [self._node_cost(n, roles[n.name].role, config) for n in nodes]
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
        if self.sharding_mode == "all":
            chosen = frozenset(by_region)
        else:
            chosen, _ = choose_shardings(options, edges, memory_cap=self.cluster.device.memory_bytes)
        self._region_cache[key] = frozenset(i for i, r in enumerate(ordered) if r in chosen)
        return chosen

    def node_roles(self, config: ParallelConfig) -> dict[str, str]:
        """Tensor-parallel role of every non-replicated node under `config` (fx node name -> role)."""
        out: dict[str, str] = {}
        for layer in self.graph.layers:
            chosen = self.sharded_regions(layer, config)
            for name in layer.nodes:
                shard = self.sharding.roles[name]
                if shard.region in chosen:
                    out[name] = shard.role
        return out

    def _cost_layer(self, layer: Layer, config: ParallelConfig) -> LayerCost:
        chosen = self.sharded_regions(layer, config)
        roles = self.sharding.roles
        costs = [self._node_cost(self._nodes[name],
                                 roles[name].role if roles[name].region in chosen else "replicate", config)
                 for name in layer.nodes]
        fwd = sum(c.fwd for c in costs)
        tp_f = sum(c.tp_fwd for c in costs)
        tp_b = sum(c.tp_bwd for c in costs)
        saved = sum(c.saved for c in costs)
        params = sum(c.params for c in costs)
        scale = config.micro_batch_size / self.graph.batch_size
        layer_in = self._layer_inputs[layer.index] * scale * DType(config.dtype).bytes / 4
        if config.recompute == "full":
            recompute, working, kept = fwd, saved, layer_in
            tp_b += tp_f  # the recomputed forward repeats its all-reduces
        elif config.recompute == "selective":
            recompute, working, kept = sum(c.attn_fwd for c in costs), 0.0, saved
        else:
            recompute, working, kept = 0.0, 0.0, saved
        return LayerCost(forward=fwd, backward=sum(c.bwd for c in costs), recompute=recompute,
                         tp_forward=tp_f, tp_backward=tp_b, saved=kept, working=working, params=params,
                         largest_param_layer=params, temporary=max((c.temp for c in costs), default=0.0),
                         boundary=self._boundary(layer, config))


@dataclass(frozen=True)
class _NodeCost:
    fwd: float
    bwd: float
    attn_fwd: float
    tp_fwd: float
    tp_bwd: float
    saved: float
    params: float
    temp: float


def _params_per_rank(n: OpInfo, role: str, t: float) -> float:
    """Parameters of one node held by one tensor-parallel rank.

    Split ops hold 1/t of their weights (t: the divisor, below the tensor degree where a split
    is padded); a row-parallel op's bias is added after the all-reduce and stays whole on every
    rank (Megatron's layout).
    """
    if role == "replicate" or t == 1:
        return float(n.param_count)
    if role == ShardRole.ROW and any(name.endswith("bias") for name in n.param_names) and n.output_meta:
        bias = n.output_meta[0].shape[1] if n.kind == "conv" else n.output_meta[0].shape[-1]
        return (n.param_count - bias) / t + bias
    return n.param_count / t


def _score_bytes(n: OpInfo) -> int:
    """Bytes of the (B, H, Tq, Tk) attention score matrix an unfused attention materializes."""
    if len(n.input_meta) < 2 or len(n.input_meta[0].shape) != 4:
        return 0
    b, h, tq, _ = n.input_meta[0].shape
    tk = n.input_meta[1].shape[2]
    return b * h * tq * tk * element_bytes(n.input_meta[0].dtype)


def _dtype_scale(n: OpInfo, dtype: str) -> float:
    """Bytes scale from the captured dtype to the run's compute dtype (floats only)."""
    meta = n.output_meta[0] if n.output_meta else (n.input_meta[0] if n.input_meta else None)
    if meta is None or not meta.dtype.startswith(("float", "bfloat")):
        return 1.0
    return DType(dtype).bytes / element_bytes(meta.dtype)


def _tokens_per_sample(graph: ModelGraph) -> int | None:
    """Sequence length when the model's first input is token ids, else None."""
    for n in graph.nodes:
        if n.kind == "input" and n.output_meta:
            m = n.output_meta[0]
            if m.dtype.startswith(("int", "uint")) and len(m.shape) >= 2:
                return m.numel // graph.batch_size
            return None
    return None


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
    from planner.capture import capture

    return capture(model_or_graph, example_inputs)

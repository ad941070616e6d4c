"""Pipeline parallelism (p stages, GPipe / 1F1B / interleaved 1F1B), planner side.

Stages are contiguous layer ranges balanced by time under each device's memory
(planner/stage_split.py); pipeline position i holds chunks i, i+p, ... The slowest
device sets the pipeline slot; fill and drain follow the schedule
(cost_models/schedule.py); every micro-batch's activation and its gradient cross each
cut once, in full inside the slot or, where the stack overlaps sends (`Overlap.p2p`), only
what outlasts the next compute, plus the fill and drain hops. The data-parallel gradient
sync and the other strategies' gradient traffic are added after the slot, less what the
device's compute hides (`Evaluator.grad_sync` with its `DeviceWork`); tied weights held by
several positions have their copies' gradients summed after it.
"""

from __future__ import annotations

from dataclasses import replace

from cost_models.memory import adam_step_bytes, autocast_param_bytes, live_micro_batches, param_bytes
from cost_models.mesh_axes import axis_spans_nodes
from cost_models.overlap import DeviceWork, p2p_exposed
from cost_models.prediction import MemoryBreakdown, Prediction, TimeBreakdown
from cost_models.schedule import pipeline_time
from cost_models.step_costs import Work, optimizer_cost
from planner.config import ConfigError, ParallelConfig
from planner.stage_split import balanced_partition
from planner.strategies.base import Bounds, Fits, MeshShape, Placement
from planner.strategies.data.strategy import GRAD_BUCKET_BYTES
from runtime.vocab import DType, MeshAxis, Schedule, StrategyName


class PipelineStrategy(Placement):
    """Every config is a pipeline (p = 1: one stage); see module docstring."""

    name = StrategyName.PIPELINE
    named_at_one = True

    def active(self, config: ParallelConfig) -> bool:
        return True

    def check(self, ev, config: ParallelConfig) -> None:
        layers = len(ev.graph.layers)
        if config.num_stages > layers:
            raise ConfigError(f"{config.num_stages} pipeline stages but the model has only "
                              f"{layers} layers to cut; use at most {layers}")

    def shape_configs(self, shape: MeshShape, constraints: dict) -> list[ParallelConfig]:
        """Every micro-batch size with 1F1B and, where there are layers enough, interleaved 1F1B with 2
        or 4 chunks per device (or the pinned schedule)."""
        if constraints.get("bidirectional") is True:
            return []
        p, layers = shape.pipeline, shape.num_layers
        if p == 1:
            scheds = [(Schedule.ONE_F_ONE_B, 1)]
        else:
            scheds = [(Schedule.ONE_F_ONE_B, 1)] + [(Schedule.INTERLEAVED, v) for v in (2, 4) if p * v <= layers]
        if "schedule" in constraints:
            want = constraints["schedule"]
            vs = (constraints["virtual_stages"],) if "virtual_stages" in constraints else \
                (2, 4) if want == Schedule.INTERLEAVED else (1,)
            scheds = [(want, v) for v in vs if want != Schedule.INTERLEAVED or p * v <= layers]
        out = []
        for mb in shape.micro_batch_sizes:
            for sched, v in scheds:
                try:
                    out.append(ParallelConfig(**shape.fields(micro_batch_size=mb, schedule=sched, virtual_stages=v)))
                except ConfigError:
                    continue
        return out

    def lower_bound(self, ev, config: ParallelConfig, costs: list, m: int, slot: float) -> float:
        """Each micro-batch crosses each of the p*v - 1 cuts once forward and once backward (at the cheapest
        cut's price; nothing where the stack hides the sends), and the schedule's fill and drain come
        on top."""
        if config.pipeline > 1 and not ev.overlap.p2p:
            p2p = ev.p2p_seconds(config)
            cuts = config.pipeline * config.virtual_stages - 1
            slot += 2 * cuts / config.pipeline * p2p(min(c.boundary for c in costs[:-1]))
        return pipeline_time(config.schedule, config.pipeline, m, slot, config.virtual_stages)[0]

    def stage_fits(self, ev, config: ParallelConfig, costs: list, global_batch_size: int) -> Fits:
        """fits(stage, lo, hi): whether layers [lo, hi) fit on the device that runs that stage.

        Weights, gradients and optimizer state per parameter, plus activations
        times the micro-batches the schedule keeps live on that device, within the
        memory the allocator's fragmentation margin leaves; under the interleaved
        schedule each of the v chunks gets 1/v of the memory.
        """
        pb = param_bytes_for(ev, config).total
        m = config.micro_batches(global_batch_size)
        v = config.virtual_stages
        par, act = [0.0], [0.0]
        for c in costs:
            par.append(par[-1] + c.params * pb)
            act.append(act[-1] + c.saved + c.weight_copies)
        extra = max((c.working for c in costs), default=0.0) + \
            max((max(c.temporary, c.loss_peak) for c in costs), default=0.0)
        cap = ev.memory_cap / (1 + ev.allocator_margin) / v
        live = [live_micro_batches(config.schedule, i, config.pipeline, m, v) for i in range(config.pipeline)]

        def fits(stage: int, lo: int, hi: int) -> bool:
            i = stage % config.pipeline
            return (par[hi] - par[lo]) + live[i] * (act[hi] - act[lo]) + extra / v <= cap

        return fits

    def stage_bounds(self, ev, config: ParallelConfig, costs: list, weights: list[float],
                     fits: Fits | None) -> Bounds:
        return balanced_partition(weights, config.num_stages, fits)

    def step(self, ev, config: ParallelConfig, global_batch_size: int, m: int, costs: list,
             bounds: Bounds) -> Prediction:
        p, v, d = config.pipeline, config.virtual_stages, config.data
        slots, hosts, halves, parts, mems, stages, works = [], [], [], [], [], [], []
        pb = param_bytes_for(ev, config)
        autocast = _autocast_memory(ev, config)
        p2p = ev.p2p_seconds(config)
        tie_params, tie_seconds = ev.tie_costs(config, bounds)
        # Gradient and weight traffic on the data axis shares its link with an axis's in-layer
        # collectives when both axes run on the same link level: they take turns, so only compute
        # hides it. On different levels (tensor in a node, data across) they run at once.
        dpn = ev.cluster.devices_per_node
        data_spans = axis_spans_nodes(config.mesh, MeshAxis.DATA, dpn)
        apart = {a: data_spans != axis_spans_nodes(config.mesh, a, dpn) for a in config.mesh}
        for i in range(p):
            chunks = [bounds[c] for c in range(i, config.num_stages, p)]
            cs = [c for lo, hi in chunks for c in costs[lo:hi]]
            fwd = sum(c.forward for c in cs)
            bwd = sum(c.backward for c in cs)
            rc = sum(c.recompute for c in cs)
            tp = sum(c.comm_forward + c.comm_backward for c in cs)
            pp = sum(_sends_exposed(ev, p2p(costs[hi - 1].boundary), costs[lo:hi]) for lo, hi in chunks if p > 1)
            slots.append(fwd + bwd + rc + tp + pp)
            # on a GPU the host dispatches every kernel: each forward and backward instruction (a chunk's, for
            # one micro-batch) takes whichever of the device's kernels and the host's dispatching them is
            # longer, as the simulator prices it (StagePrediction.forward / backward hold the same)
            excess = [_host_excess(costs[lo:hi]) for lo, hi in chunks]
            hosts.append(sum(f + b for f, b in excess))
            halves.append((fwd + sum(c.comm_forward for c in cs) + pp / 2 + sum(f for f, _ in excess),
                           bwd + rc + sum(c.comm_backward for c in cs) + pp / 2 + sum(b for _, b in excess)))
            parts.append((fwd, bwd, rc, tp, pp, sum(c.loss_forward for c in cs), sum(c.loss_backward for c in cs)))
            works.append(DeviceWork(
                layers=tuple((c.params, c.forward + sum(apart[a.axis] * a.forward for a in c.comm),
                              c.backward + c.recompute + sum(apart[a.axis] * a.backward for a in c.comm))
                             for c in cs),
                chunk_sizes=tuple(hi - lo for lo, hi in chunks), later_passes=min(p, m) if v > 1 else 1))
            params = sum(c.params for c in cs) + tie_params.get(i, 0.0)
            live = live_micro_batches(config.schedule, i, p, m, v)
            mem = _device_memory(ev, config, cs, params, live, costs[chunks[-1][1] - 1].boundary, pb, autocast)
            mems.append((mem, params, sum(c.tensors for c in cs)))
            for (lo, hi) in chunks:
                stages.append((lo, hi, i, mem))

        effective = [slot + host for slot, host in zip(slots, hosts)]
        crit = max(range(p), key=lambda i: effective[i])
        fwd, bwd, rc, tp, pp, loss_f, loss_b = parts[crit]
        pace = effective[crit]
        if config.schedule == Schedule.GPIPE and p > 1:
            # every forward runs before any backward: the slowest forward and the slowest backward set the
            # pace apart (they differ where the devices' host and device times weigh differently)
            pace = max(f for f, _ in halves) + max(b for _, b in halves)
        total, bubble = pipeline_time(config.schedule, p, m, pace, v)
        bubble += m * (pace - effective[crit])

        # Gradient sync and ZeRO traffic for the critical device, hidden behind its compute as the
        # stack's overlap allows (planner/strategies/data/strategy.py).
        params_crit = mems[crit][1]
        data_comm, zero_comm = ev.grad_sync(config, params_crit, works[crit], m)
        pp_fill = _fill_sends(ev, p, p2p, costs, bounds)
        data_comm += tie_seconds  # a tied weight's copies summed after the gradient sync
        opt_params = params_crit / (d if config.zero >= 1 else 1)
        opt = optimizer_work(ev, config, opt_params, mems[crit][2], params_crit)
        # the device waits for the host where it dispatches a slot's kernels slower than they run
        host = m * (effective[crit] - slots[crit])
        # the step's end: the optimizer phase (its kernels, or the host's dispatching them if longer) and,
        # after each sync (meshplan's runtime reads the step's loss and norm together once; fp16 loss scaling
        # reads the norm before the optimizer too), the time to dispatch the next kernel
        optimizer = max(opt.device, opt.host)
        if ev.gpu_costs is not None:
            optimizer += (1 + ev.setup.loss_scaling) * ev.gpu_costs.host_op

        # the loss runs inside the last stage's forward and backward; the breakdown shows it apart
        time = TimeBreakdown(forward=m * (fwd - loss_f), backward=m * (bwd - loss_b), recompute=m * rc,
                             tensor_comm=m * tp, pipeline_comm=m * pp + pp_fill, bubble=bubble, data_comm=data_comm,
                             zero_comm=zero_comm, optimizer=optimizer, loss=m * (loss_f + loss_b), host=host)
        return ev.prediction(config, global_batch_size, m, costs, stages, time,
                             max((mem for mem, _, _ in mems), key=lambda x: x.total),
                             busy=m * (fwd + bwd + rc) + optimizer)


def _fill_sends(ev, p: int, p2p, costs: list, bounds: Bounds) -> float:
    """Seconds of sends no compute hides: overlapped sends still cross the cuts one after another while
    the pipeline fills and drains (the first micro-batch's activation and the last one's gradient)."""
    if ev.overlap.p2p and p > 1:
        return 2 * (p - 1) * max(p2p(costs[hi - 1].boundary) for lo, hi in bounds[:-1])
    return 0.0


def _device_memory(ev, config: ParallelConfig, cs: list, params: float, live: int, boundary: float, pb,
                   autocast: bool) -> MemoryBreakdown:
    """What one pipeline device holds at its peak (bytes): its layers `cs` (their `params` with the tied
    weights it holds), `live` micro-batches' saved activations, the gradient buckets and the activation
    crossing its last cut (`boundary` bytes), and the allocator's margin on top. pb: bytes per parameter;
    autocast: meshplan's own runtime (its fp32 gathers and in-place gradient buckets)."""
    p, d = config.pipeline, config.data
    # what each live micro-batch keeps, and one layer's recomputed activations in its backward
    acts = live * sum(c.saved for c in cs) + max((c.working for c in cs), default=0.0)
    gather = 0.0
    if config.zero == 3 and autocast:   # meshplan's runtime gathers a stage's parameters whole (fp32)
        gather = sum(c.params for c in cs) * 4.0
    elif config.zero == 3:  # the gathered weights of the current and the prefetched layer, or the stack's bound
        gathered = 2 * max((c.params for c in cs), default=0.0)
        if ev.zero3_live_parameters is not None:
            gathered = min(gathered, ev.zero3_live_parameters)
        gather = gathered * (4 if ev.overlap.autocast and ev.gpu_costs is not None else DType(config.dtype).bytes)
    # gradient buckets: meshplan's runtime reduces the gradients in place (they are views of its
    # buckets, runtime/execute/grads.py); other stacks copy a bucket out and back
    buckets = 0.0 if autocast else 2 * min(GRAD_BUCKET_BYTES, params * pb.gradients)
    comm_buf = (buckets if d > 1 else 0.0) + (2 * boundary if p > 1 else 0.0)
    loss_peak = max((c.loss_peak for c in cs), default=0.0)
    allocated = MemoryBreakdown(
        parameters=params * pb.weights + gather, gradients=params * pb.gradients,
        optimizer=params * pb.optimizer, activations=acts, comm_buffers=comm_buf,
        temporary=max(max((c.temporary for c in cs), default=0.0) - loss_peak, 0.0),
        weight_copies=live * sum(c.weight_copies for c in cs), loss=loss_peak,
    )
    return replace(allocated, fragmentation=allocated.total * ev.allocator_margin)


def _host_excess(chunk: list) -> tuple[float, float]:
    """Seconds a chunk's forward and its backward instruction wait for the host beyond their device time
    (GPU; 0 where the host keeps ahead)."""
    f = sum(c.forward + c.comm_forward for c in chunk)
    b = sum(c.backward + c.recompute + c.comm_backward for c in chunk)
    return max(sum(c.host_forward for c in chunk) - f, 0.0), max(sum(c.host_backward for c in chunk) - b, 0.0)


def _autocast_memory(ev, config: ParallelConfig) -> bool:
    """Whether a rank holds what meshplan's own runtime allocates under torch.autocast (fp32 weights and
    gradients in its buckets, a stage gathered whole under ZeRO-3: cost_models/memory.autocast_param_bytes)."""
    return ev.gpu_costs is not None and ev.overlap.autocast and not ev.overlap.param_gather


def param_bytes_for(ev, config: ParallelConfig):
    """Bytes per parameter a rank holds for `config` on this stack (cost_models/memory.py): meshplan's runtime
    as it allocates them; a stack training fp32 parameters under autocast with FSDP (the torch target) 4-byte
    weights and gradients sharded as ZeRO says; a 16-bit stack its 16-bit weights and fp32 optimizer state."""
    if _autocast_memory(ev, config):
        return autocast_param_bytes(config.zero, config.data, ev.setup.state_bytes)
    if ev.gpu_costs is not None and ev.overlap.autocast:
        return param_bytes(DType.FP32, config.zero, config.data, 4)
    return param_bytes(config.dtype, config.zero, config.data, ev.grad_reduce_bytes)


def optimizer_work(ev, config: ParallelConfig, opt_params: float, tensors: int, params: float) -> Work:
    """The optimizer phase of the critical device: on a GPU the step by implementation, the gradient norm
    where the step clips, and zeroing the gradients (cost_models/step_costs.optimizer_cost); elsewhere the
    step's bytes at the memory bandwidth (a calibrated CPU cluster's simulator adds the measured fixed
    costs)."""
    if ev.gpu_costs is None:
        return Work(opt_params * adam_step_bytes(config.dtype) / (ev.cluster.device.memory_bandwidth * ev.eff.memory))
    if config.zero >= 1:   # the optimizer steps one flat shard per gradient bucket
        tensors = max(int(-(-params * 4 // GRAD_BUCKET_BYTES)), 1)
    runtime = ev.overlap.autocast   # meshplan's own runtime (other stacks fuse the norm and free their gradients)
    bucketed = runtime and ev.grad_replicas(config) > 1   # gradients kept in buckets, zeroed in place
    return optimizer_cost(ev.gpu(config.dtype), opt_params, tensors, impl=ev.setup.impl_on_gpu(),
                          clip=ev.setup.clip_grad, zero_in_place=bucketed, norm=ev.setup.grad_norm and runtime,
                          groups=2, buckets=max(int(-(-params * 4 // GRAD_BUCKET_BYTES)), 1))


def _sends_exposed(ev, send: float, chunk: list) -> float:
    """Exposed seconds of one chunk's two sends per micro-batch (its activation forward, its input
    gradient backward), `send` s each: in full, or under the chunk's next compute of that
    direction where the stack overlaps pipeline sends."""
    ov = ev.overlap
    if not ov.p2p:
        return 2 * send
    return p2p_exposed(send, sum(c.forward for c in chunk), ov.contention) + \
        p2p_exposed(send, sum(c.backward + c.recompute for c in chunk), ov.contention)

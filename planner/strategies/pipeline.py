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

from cost_models.memory import adam_step_bytes, live_micro_batches, param_bytes
from cost_models.mesh_axes import axis_spans_nodes
from cost_models.overlap import DeviceWork, p2p_exposed
from cost_models.prediction import MemoryBreakdown, Prediction, TimeBreakdown
from cost_models.schedule import pipeline_time
from planner.config import ConfigError, ParallelConfig
from planner.stage_split import balanced_partition
from planner.strategies.base import Bounds, Fits, MeshShape, Placement
from planner.strategies.data import GRAD_BUCKET_BYTES
from runtime.vocab import DType, MeshAxis, Recompute, Schedule, StrategyName


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
                    out.append(ParallelConfig(data=shape.data, tensor=shape.tensor, pipeline=p, micro_batch_size=mb,
                                              schedule=sched, virtual_stages=v, dtype=shape.dtype))
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
        cap = ev.memory_cap / v
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
        slots, parts, mems, stages, works = [], [], [], [], []
        pb = param_bytes(config.dtype, config.zero, d)
        p2p = ev.p2p_seconds(config)
        tie_params, tie_seconds = ev.tie_costs(config, bounds)
        # Gradient and weight traffic on the data axis shares its link with the tensor-parallel
        # collectives when both axes run on the same link level: they take turns, so only compute
        # hides it. On different levels (tensor in a node, data across) they run at once.
        dpn = ev.cluster.devices_per_node
        apart = axis_spans_nodes(config.mesh, MeshAxis.DATA, dpn) != axis_spans_nodes(config.mesh, MeshAxis.TENSOR, dpn)
        for i in range(p):
            chunks = [bounds[c] for c in range(i, config.num_stages, p)]
            cs = [c for lo, hi in chunks for c in costs[lo:hi]]
            fwd = sum(c.forward for c in cs)
            bwd = sum(c.backward for c in cs)
            rc = sum(c.recompute for c in cs)
            tp = sum(c.comm_forward + c.comm_backward for c in cs)
            pp = sum(_sends_exposed(ev, p2p(costs[hi - 1].boundary), costs[lo:hi]) for lo, hi in chunks if p > 1)
            slots.append(fwd + bwd + rc + tp + pp)
            parts.append((fwd, bwd, rc, tp, pp))
            works.append(DeviceWork(
                layers=tuple((c.params, c.forward + apart * c.tp_forward,
                              c.backward + c.recompute + apart * c.tp_backward) for c in cs),
                chunk_sizes=tuple(hi - lo for lo, hi in chunks), later_passes=min(p, m) if v > 1 else 1))
            params = sum(c.params for c in cs) + tie_params.get(i, 0.0)
            live = live_micro_batches(config.schedule, i, p, m, v)
            if config.recompute == Recompute.FULL:
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

        # Gradient sync and ZeRO traffic for the critical device, hidden behind its compute as the
        # stack's overlap allows (planner/strategies/data.py).
        params_crit = mems[crit][1]
        data_comm, zero_comm = ev.grad_sync(config, params_crit, works[crit], m)
        if ev.overlap.p2p and p > 1:
            # Overlapped sends still cross the cuts one after another while the pipeline fills
            # and drains: the first micro-batch's activation and the last one's gradient.
            pp_fill = 2 * (p - 1) * max(p2p(costs[hi - 1].boundary) for lo, hi in bounds[:-1])
        else:
            pp_fill = 0.0
        data_comm += tie_seconds  # a tied weight's copies summed after the gradient sync
        opt_params = params_crit / (d if config.zero >= 1 else 1)
        optimizer = opt_params * adam_step_bytes(config.dtype) / (ev.cluster.device.memory_bandwidth * ev.eff.memory)

        time = TimeBreakdown(forward=m * fwd, backward=m * bwd, recompute=m * rc, tensor_comm=m * tp,
                             pipeline_comm=m * pp + pp_fill, bubble=bubble, data_comm=data_comm,
                             zero_comm=zero_comm, optimizer=optimizer)
        return ev.prediction(config, global_batch_size, m, costs, stages, time,
                             max((mem for mem, _ in mems), key=lambda x: x.total),
                             busy=m * (fwd + bwd + rc) + optimizer)


def _sends_exposed(ev, send: float, chunk: list) -> float:
    """Exposed seconds of one chunk's two sends per micro-batch (its activation forward, its input
    gradient backward), `send` s each: in full, or under the chunk's next compute of that
    direction where the stack overlaps pipeline sends."""
    ov = ev.overlap
    if not ov.p2p:
        return 2 * send
    return p2p_exposed(send, sum(c.forward for c in chunk), ov.contention) + \
        p2p_exposed(send, sum(c.backward + c.recompute for c in chunk), ov.contention)

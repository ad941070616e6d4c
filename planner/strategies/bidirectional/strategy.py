"""Bi-directional pipelines (GEMS: MAST, and MASTER with T replicas per direction), planner side.

Two replicas of the model share the p pipeline devices in opposite directions: device r
holds stage r of replica A and stage p-1-r of replica B, runs replica A's micro-batches,
then replica B's (planner/strategies/bidirectional/costs.py simulates the step). Devices r and p-1-r (in every
data replica) hold copies of the same two stages and all-reduce their gradients after
the step.

Memory: device k holds stage k and stage p-1-k, so stages fit in pairs: the weights,
gradients and optimizer state of both, plus the activations of the larger of
the two (one micro-batch is in flight per device: replica A's backward ends
before replica B's forward starts), plus the largest working set and temporary.

`bidirectional_bounds` keeps the time-balanced split when every pair fits.
Otherwise it minimizes the slowest stage under the pair constraint: a binary
search on that time limit L, and for each L a sweep over the pairs from the
outside in. After k pairs the layers left are [a, b); choosing pair k's cuts
(a', b') costs memory only on device k, and the rest of the problem depends
on (a', b') alone, needing fewer layers the larger a' and the smaller b' are.
So only the Pareto frontier of reachable (a', b') is kept, and for each a'
the smallest b' that keeps device k within memory and stage p-1-k within L is
found by bisection (both are monotone in b').
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import replace
from typing import Callable

from planner.strategies.bidirectional import costs as gems
from cost_models.comm import collective_time
from cost_models.memory import param_bytes
from cost_models.mesh_axes import lane_ranks
from cost_models.prediction import MemoryBreakdown, Prediction, TimeBreakdown
from planner.config import ParallelConfig
from planner.stage_split import balanced_partition
from planner.strategies.base import Bounds, Fits, MeshShape, Placement
from planner.strategies.pipeline.strategy import optimizer_work, param_bytes_for
from runtime.vocab import Collective, DType, StrategyName


class _Sizes:
    """Prefix sums over layers: time, parameter bytes, saved activation bytes."""

    def __init__(self, config: ParallelConfig, costs: list, weights: list[float], grad_bytes: int | None = None,
                 per_param: float | None = None):
        """`per_param`: bytes a device holds per parameter (default: cost_models.memory.param_bytes of the
        config without ZeRO, gradients `grad_bytes` wide)."""
        pb = per_param if per_param is not None else param_bytes(config.dtype, 0, config.data, grad_bytes).total
        self.w, self.par, self.act = [0.0], [0.0], [0.0]
        for c, wt in zip(costs, weights):
            self.w.append(self.w[-1] + wt)
            self.par.append(self.par[-1] + c.params * pb)
            self.act.append(self.act[-1] + c.saved + getattr(c, "weight_copies", 0.0))
        self.extra = max((c.working for c in costs), default=0.0) + \
            max((max(c.temporary, getattr(c, "loss_peak", 0.0)) for c in costs), default=0.0)

    def time(self, lo: int, hi: int) -> float:
        return self.w[hi] - self.w[lo]

    def device(self, first: tuple[int, int], second: tuple[int, int] | None) -> float:
        """Bytes on a device holding these layer ranges (second None: one stage for both replicas)."""
        par, act = self.par, self.act
        lo, hi = first
        if second is None:
            return par[hi] - par[lo] + act[hi] - act[lo] + self.extra
        lo2, hi2 = second   # the search calls this in its innermost loop: no lists, no generators
        return par[hi] - par[lo] + par[hi2] - par[lo2] + max(act[hi] - act[lo], act[hi2] - act[lo2]) + self.extra


def pairs_fit(bounds: list[tuple[int, int]], sizes: _Sizes, cap: float) -> bool:
    p = len(bounds)
    return all(sizes.device(bounds[k], bounds[p - 1 - k] if p - 1 - k != k else None) <= cap
               for k in range((p + 1) // 2))


def bidirectional_bounds(config: ParallelConfig, costs: list, weights: list[float], cap: float,
                         balanced: Callable, grad_bytes: int | None = None,
                         per_param: float | None = None) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges of the p stages: time-balanced (`balanced(weights, p, None)`) when
    every pair fits in `cap` bytes, else the pair-feasible split with the smallest slowest stage
    (the time-balanced one if none fits)."""
    p = config.pipeline
    sizes = _Sizes(config, costs, weights, grad_bytes, per_param)
    plain = balanced(weights, p, None)
    if pairs_fit(plain, sizes, cap):
        return plain
    lo, hi = max(weights), sizes.w[-1]
    best = _feasible(hi * (1 + 1e-12), p, sizes, cap)
    if best is None:
        return plain
    for _ in range(50):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        got = _feasible(mid, p, sizes, cap)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def _feasible(limit: float, p: int, s: _Sizes, cap: float) -> list[tuple[int, int]] | None:
    """Stage ranges with every stage's time <= limit and every pair within cap, or None."""
    n = len(s.w) - 1
    frontier = [(0, n, ())]            # (a, b, cuts so far: ((lo, hi) left, (lo, hi) right) per pair)
    for k in range(p // 2):
        rest = p - 2 * (k + 1)          # stages still to place inside [a', b')
        final = rest == 0
        nxt: dict[int, tuple[int, tuple]] = {}
        for a, b, chosen in frontier:
            for a2 in range(a + 1, b):
                if s.time(a, a2) > limit:
                    break
                if final:                # the last pair splits [a, b) itself: b' = a'
                    if s.time(a2, b) <= limit and s.device((a, a2), (a2, b)) <= cap:
                        return _ranges(chosen + (((a, a2), (a2, b)),), p)
                    continue
                # smallest b2 (most layers to stage p-1-k) within time and memory, leaving rest layers
                t_min = bisect_left(s.w, s.w[b] - limit, a2 + rest, b)
                b2 = _smallest(lambda x: s.device((a, a2), (x, b)) <= cap, max(t_min, a2 + rest), b - 1)
                if b2 is None or s.time(b2, b) > limit:
                    continue
                if a2 not in nxt or b2 < nxt[a2][0]:
                    nxt[a2] = (b2, chosen + (((a, a2), (b2, b)),))
        # Pareto: keep (a2, b2) unless another state has a2' >= a2 and b2' <= b2
        frontier, low = [], None
        for a2 in sorted(nxt, reverse=True):
            b2, chosen = nxt[a2]
            if low is None or b2 < low:
                frontier.append((a2, b2, chosen))
                low = b2
        if not frontier:
            return None
    if p % 2:                            # the middle stage runs on one device for both replicas
        for a, b, chosen in frontier:
            if s.time(a, b) <= limit and s.device((a, b), None) <= cap:
                return _ranges(chosen, p, middle=(a, b))
    return None


def _smallest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Smallest x in [lo, hi] with ok(x), for ok monotone (False ... False True ... True)."""
    if lo > hi or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _ranges(chosen: tuple, p: int, middle: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    left = [c[0] for c in chosen]
    right = [c[1] for c in reversed(chosen)]
    return left + ([middle] if middle is not None else []) + right


class BidirectionalStrategy(Placement):
    """See module docstring; refines the pipeline where `config.bidirectional`."""

    name = StrategyName.BIDIRECTIONAL

    def active(self, config: ParallelConfig) -> bool:
        return config.bidirectional

    def mesh_factor(self, config: ParallelConfig) -> None:
        return None   # no factor of its own: the two directions share the pipeline's devices

    def shape_configs(self, shape: MeshShape, constraints: dict) -> list[ParallelConfig]:
        """2T micro-batches per step (T per direction, T in 1, 2, 4, 8), so T fixes the micro-batch size."""
        p, d = shape.pipeline, shape.data
        if p == 1 or constraints.get("bidirectional") is False or "schedule" in constraints:
            return []
        per_replica = shape.global_batch_size // d
        out = []
        for T in (constraints["replicas_per_direction"],) if "replicas_per_direction" in constraints else (1, 2, 4, 8):
            if per_replica % (2 * T) or per_replica // (2 * T) > shape.max_micro_batch_size:
                continue
            mb = per_replica // (2 * T)
            if "micro_batch_size" in constraints and constraints["micro_batch_size"] != mb:
                continue
            out.append(ParallelConfig(**shape.fields(micro_batch_size=mb, bidirectional=True, replicas_per_direction=T)))
        return out

    def lower_bound(self, ev, config: ParallelConfig, costs: list, m: int, slot: float) -> float:
        """The busiest device does at least the average share of the 2T passes, and one micro-batch
        alone must pass forward and backward through every stage."""
        compute = sum(c.forward + c.backward for c in costs)
        comm = sum(c.comm_forward + c.comm_backward for c in costs)
        return max(m * slot, compute + comm)

    def stage_fits(self, ev, config: ParallelConfig, costs: list, global_batch_size: int) -> Fits | None:
        return None   # the bounds check each device's pair of stages themselves

    def stage_bounds(self, ev, config: ParallelConfig, costs: list, weights: list[float],
                     fits: Fits | None) -> Bounds:
        """Stage r fits together with stage p-1-r."""
        # the pairs fit within what the allocator's fragmentation margin leaves
        return bidirectional_bounds(config, costs, weights, ev.memory_cap / (1 + ev.allocator_margin),
                                    balanced_partition, ev.grad_reduce_bytes,
                                    per_param=param_bytes_for(ev, replace(config, zero=0)).total)

    def step(self, ev, config: ParallelConfig, global_batch_size: int, m: int, costs: list,
             bounds: Bounds) -> Prediction:
        """Device r runs stage r of replica A and stage p-1-r of replica B (planner.strategies.bidirectional.costs)."""
        p, T = config.pipeline, config.replicas_per_direction
        per_stage = [costs[lo:hi] for lo, hi in bounds]
        fc = [sum(c.forward for c in cs) for cs in per_stage]
        bc = [sum(c.backward for c in cs) for cs in per_stage]
        rc = [sum(c.recompute for c in cs) for cs in per_stage]
        tp = [sum(c.comm_forward + c.comm_backward for c in cs) for cs in per_stage]
        f_dev = [fc[k] + sum(c.comm_forward for c in per_stage[k]) for k in range(p)]
        b_dev = [bc[k] + rc[k] + sum(c.comm_backward for c in per_stage[k]) for k in range(p)]
        # on a GPU a pass takes the host's dispatching its kernels where that is longer (planner/strategies/pipeline/strategy.py)
        f = [max(f_dev[k], sum(c.host_forward for c in per_stage[k])) for k in range(p)]
        b = [max(b_dev[k], sum(c.host_backward for c in per_stage[k])) for k in range(p)]
        link = ev.p2p_seconds(config)
        hop = max(link(costs[hi - 1].boundary) for lo, hi in bounds[:-1])
        with_p2p, _ = gems.step_time(f, b, T, hop)
        without_p2p, busy = gems.step_time(f, b, T, 0.0)
        crit = max(range(p), key=lambda i: busy[i])
        pair = gems.pair_of(crit, p)
        both = (crit, pair)  # the middle device of an odd pipeline runs its stage for both replicas
        pb = param_bytes_for(ev, replace(config, zero=0))
        mems, stages = [], []
        for i in range(p):
            j = gems.pair_of(i, p)
            held = per_stage[i] + (per_stage[j] if j != i else [])
            params = sum(c.params for c in held)
            # One micro-batch in flight per device: A's backward ends before B's forward starts; one
            # layer's recomputed activations are live in its backward.
            acts = max(sum(c.saved for c in per_stage[k]) + max((c.working for c in per_stage[k]), default=0.0)
                       for k in {i, j})
            loss_peak = max((c.loss_peak for c in held), default=0.0)
            allocated = MemoryBreakdown(parameters=params * pb.weights, gradients=params * pb.gradients,
                                        optimizer=params * pb.optimizer, activations=acts,
                                        comm_buffers=2 * max(costs[hi - 1].boundary for lo, hi in bounds),
                                        temporary=max(max((c.temporary for c in held), default=0.0) - loss_peak, 0.0),
                                        weight_copies=sum(c.weight_copies for c in held), loss=loss_peak)
            mem = replace(allocated, fragmentation=allocated.total * ev.allocator_margin)
            mems.append((mem, params, sum(c.tensors for c in held)))
        for k, (lo, hi) in enumerate(bounds):
            stages.append((lo, hi, k, mems[k][0]))
        # Devices r and p-1-r (in every data replica) hold copies of the same two stages and
        # all-reduce their flattened gradients after the step, higher stage first.
        data_comm = max(_pair_allreduce(ev, config, i, mems[i][1]) for i in range(p))
        opt = optimizer_work(ev, config, mems[crit][1], mems[crit][2], mems[crit][1])
        optimizer = max(opt.device, opt.host)
        host = T * sum(f[k] - f_dev[k] + b[k] - b_dev[k] for k in both)   # busy[crit]'s wait for the host
        time = TimeBreakdown(
            forward=T * sum(fc[k] for k in both), backward=T * sum(bc[k] for k in both),
            recompute=T * sum(rc[k] for k in both), tensor_comm=T * sum(tp[k] for k in both),
            pipeline_comm=with_p2p - without_p2p, bubble=without_p2p - busy[crit],
            data_comm=data_comm, optimizer=optimizer, host=host)
        return ev.prediction(config, global_batch_size, m, costs, stages, time,
                             max((mem for mem, _, _ in mems), key=lambda x: x.total),
                             busy=busy[crit] + optimizer)


def _pair_allreduce(ev, config: ParallelConfig, device: int, params: float) -> float:
    """Seconds to all-reduce a device's gradients with its pair over every data replica."""
    # Every rank of a position's data coordinate sums in the same all-reduce (spatial lanes, data x spatial,
    # their tiles' gradients; bidirectional pipelines combine with no other axis there).
    ranks = lane_ranks(config.mesh, (device, gems.pair_of(device, config.pipeline)))
    if len(ranks) < 2:
        return 0.0
    nbytes = params * (ev.grad_reduce_bytes or DType(config.dtype).bytes)
    return collective_time(ev.cluster, Collective.ALL_REDUCE, nbytes, ranks).seconds

"""Data parallelism (d replicas) with ZeRO stages 0-3, planner side: the gradient sync.

ZeRO 0/1 all-reduce the gradients, ZeRO-2 reduce-scatters them (half the traffic); where
the stack overlaps the gradient reduce (`Overlap.grad_reduce`) the buckets go out during
each model chunk's last backward pass, so only what outlasts those passes is exposed (at
least the last bucket; cost_models/overlap.py `chunked_sync_exposed`), else all of it after
the flush. ZeRO-1/2 then gather the updated weight shards: exposed in full, or under the
next step's forward when the stack overlaps the parameter gather. ZeRO-3 gathers the
weights before each micro-batch's forward and again before its backward (the recomputed
forward reuses that gather) and reduce-scatters each micro-batch's gradients: on the
critical path in full, or layer by layer behind the previous layer's compute where the
stack prefetches the gathers and overlaps the reduce (`prefetched_exposed`). Memory per
parameter (weights, gradients, optimizer state over d) is cost_models.memory.param_bytes.
"""

from __future__ import annotations

import dataclasses

from cost_models.overlap import DeviceWork, bucketed_exposed, chunked_sync_exposed, prefetched_exposed
from planner.config import ParallelConfig
from planner.strategies.base import Strategy
from runtime.vocab import Collective, DType, MeshAxis, StrategyName

# Data-parallel gradients are reduced in buckets as backward produces them;
# only the last bucket's reduction is always exposed (PyTorch DDP's default bucket).
GRAD_BUCKET_BYTES = 25 * 2**20


class DataStrategy(Strategy):
    """See module docstring."""

    name = StrategyName.DATA
    replicates_weights = True
    named_at_one = True

    def grad_sync(self, ev, config: ParallelConfig, params: float, work: DeviceWork,
                  m: int) -> tuple[float, float]:
        ov = ev.overlap
        if ev.execution.whole_stage:   # the stage's gradients all come at the end of its one compiled backward
            ov = dataclasses.replace(ov, grad_reduce=False)
        grad_elem = ev.grad_reduce_bytes or DType(config.dtype).bytes
        weight_elem = DType(config.dtype).bytes
        mesh = config.mesh

        def data(op: str, nbytes: float) -> float:
            return ev.axis_seconds(mesh, MeshAxis.DATA, op, nbytes)

        if config.zero <= 2:
            op = Collective.ALL_REDUCE if config.zero <= 1 else Collective.REDUCE_SCATTER
            if ov.grad_reduce:
                exposed = chunked_sync_exposed(
                    [(b, data(op, n * grad_elem), data(op, min(GRAD_BUCKET_BYTES, n * grad_elem)))
                     for b, n in work.chunks(params)], work.later_passes, ov.contention)
            else:
                exposed = data(op, params * grad_elem)
            if config.zero >= 1:  # the updated weight shards are gathered after the step
                weight_bytes = params * weight_elem
                exposed += bucketed_exposed(data(Collective.ALL_GATHER, weight_bytes),
                                            data(Collective.ALL_GATHER, min(GRAD_BUCKET_BYTES, weight_bytes)),
                                            work.forward if ov.param_gather else 0.0, ov.contention)
            return exposed, 0.0
        if not (ov.param_gather or ov.grad_reduce):
            return 0.0, m * (2 * data(Collective.ALL_GATHER, params * weight_elem)
                             + data(Collective.REDUCE_SCATTER, params * grad_elem))
        held = sum(n for n, _, _ in work.layers)
        share = params / held if held else 0.0
        gathers = [data(Collective.ALL_GATHER, n * share * weight_elem) for n, _, _ in work.layers]
        reduces = [data(Collective.REDUCE_SCATTER, n * share * grad_elem) for n, _, _ in work.layers]
        forwards = [f for _, f, _ in work.layers]
        backwards = [b for _, _, b in work.layers]
        if ov.param_gather:  # forward in layer order, backward in reverse, one layer ahead
            # up to the stack's prefetch bound ahead; the rest of a layer is gathered when it starts
            cap = ov.prefetch_params
            ahead = gathers if cap is None else \
                [data(Collective.ALL_GATHER, min(n * share, cap) * weight_elem) for n, _, _ in work.layers]
            late = sum(g - a for g, a in zip(gathers, ahead))
            gather = prefetched_exposed(ahead, forwards, ov.contention) + \
                prefetched_exposed(ahead[::-1], backwards[::-1], ov.contention) + 2 * late
        else:  # each pass gathers all of the device's weights at once and waits
            gather = 2 * data(Collective.ALL_GATHER, params * weight_elem)
        # layer k's gradients are reduced while layer k-1's backward runs; layer 0's is exposed
        reduce = prefetched_exposed(reduces, backwards, ov.contention) if ov.grad_reduce else sum(reduces)
        return 0.0, m * (gather + reduce)

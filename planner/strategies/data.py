"""Data parallelism (d replicas) with ZeRO stages 0-3, planner side: the gradient sync.

ZeRO 0/1 all-reduce the gradients bucket by bucket while backward still runs, so only the
part longer than the hiding window (at least the last bucket) is exposed; ZeRO-1 then
gathers the updated weight shards. ZeRO-2 reduce-scatters instead (half the traffic) and
gathers the weights. ZeRO-3 gathers the weights before each micro-batch's forward and
again before its backward (the recomputed forward reuses that gather) and reduce-scatters
the gradients: the next layer's compute waits on its gather, so these sit on the
critical path in full. Memory per parameter (weights, gradients, optimizer state over d)
is cost_models.memory.param_bytes.
"""

from __future__ import annotations

from planner.config import ParallelConfig
from planner.strategies.base import Strategy
from runtime.vocab import DType, MeshAxis, StrategyName

# Data-parallel gradients are reduced in buckets as backward produces them;
# only the last bucket's reduction is always exposed (PyTorch DDP's default bucket).
GRAD_BUCKET_BYTES = 25 * 2**20


class DataStrategy(Strategy):
    """See module docstring."""

    name = StrategyName.DATA
    named_at_one = True

    def grad_sync(self, ev, config: ParallelConfig, params: float, window: float, m: int) -> tuple[float, float]:
        grad_bytes = params * (ev.grad_reduce_bytes or DType(config.dtype).bytes)
        weight_bytes = params * DType(config.dtype).bytes
        mesh = config.mesh

        def data(op: str, nbytes: float) -> float:
            return ev.axis_seconds(mesh, MeshAxis.DATA, op, nbytes)

        if config.zero <= 1:
            exposed = max(data("all_reduce", min(GRAD_BUCKET_BYTES, grad_bytes)),
                          data("all_reduce", grad_bytes) - window)
            if config.zero == 1:  # updated weight shards are gathered after the step
                exposed += data("all_gather", weight_bytes)
            return exposed, 0.0
        if config.zero == 2:
            return max(data("reduce_scatter", min(GRAD_BUCKET_BYTES, grad_bytes)),
                       data("reduce_scatter", grad_bytes) - window) + data("all_gather", weight_bytes), 0.0
        return 0.0, m * (2 * data("all_gather", weight_bytes) + data("reduce_scatter", grad_bytes))

"""What one training step of a plan computes (runtime.program.step_work.StepWork), recorded in the build so that
the ranks turn a step's seconds into samples/s, tokens/s and MFU without counting anything."""

from __future__ import annotations

import math

from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.program.step_work import StepWork
from runtime.vocab import OpKind


def step_work(plan: Plan, graph: ModelGraph) -> StepWork:
    """FLOPs of one optimizer step (the graph's forward + backward per sample x the global batch; the
    graph is captured at the micro-batch size), the plan's devices' summed peak FLOP/s for its dtype
    (None when the cluster gives none for it), and tokens per sample (see StepWork)."""
    per_sample = (graph.total_fwd_flops + graph.total_bwd_flops) / graph.batch_size
    try:
        peak = plan.cluster.device.peak(plan.config.dtype) * plan.config.num_devices
    except ValueError:   # the cluster has no peak for this dtype: MFU is left out, the rest is written
        peak = None
    return StepWork(per_sample * plan.global_batch_size, peak, tokens_per_sample(graph))


def tokens_per_sample(graph: ModelGraph) -> int:
    """The model output's elements per sample over its last dimension: T of (B, T, V) logits, 1 of (B, C).
    The first output tensor is the one the loss reads (runtime.losses.model_output)."""
    outputs = [m for n in graph.nodes if n.kind == OpKind.OUTPUT for m in n.input_meta]
    if not outputs:
        return 1
    shape = list(outputs[0].shape)
    if graph.batch_dim < len(shape):
        del shape[graph.batch_dim]
    return math.prod(shape[:-1]) if shape else 1

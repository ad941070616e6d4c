"""Memory formulas: bytes per parameter by dtype and ZeRO stage, live micro-batches per schedule.

Mixed precision with Adam (docs/STRATEGIES.md, "Data parallelism"): 2 bytes of bf16/fp16 weights, 2 of
gradients, 12 of fp32 master weights, momentum and variance per parameter.
Plain fp32: 4 + 4 + 8 (momentum and variance; the weights are the master).
ZeRO shards over the data axis: stage 1 the optimizer state, stage 2 also
the gradients, stage 3 also the weights. Gradients are held in the width they are reduced
in: 4 bytes where a stack accumulates fp32 main gradients (Megatron-LM's
--accumulate-allreduce-grads-in-fp32).

What the PyTorch caching allocator reserves beyond the bytes allocated (fragmentation) is a
stated fraction of the allocated bytes, `ALLOCATOR_MARGIN` by default.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.program.schedules import forwards_in_flight
from runtime.vocab import DType, Schedule


# Reserved over allocated at the peak of large-model training runs: 1.01-1.07 in the
# published nanotron benchmark logs of Llama-1B on 8-64 H100s (huggingface.co/nanotron/old_bench,
# log_metrics.csv peak_allocated_MiB vs peak_reserved_MiB, e.g. dp-2 tp-4 pp-1: 25808 vs 27166 MiB),
# and 1.83 GiB reserved-but-unallocated at 75.31 GiB allocated in vllm-project/compressed-tensors
# PR #587 (2.4%; the PR then reserves 5% of model memory for fragmentation). 5% lies inside the
# nanotron range and above the vllm case.
ALLOCATOR_MARGIN = 0.05


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter held on one device for weights, gradients and optimizer state."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def param_bytes(dtype: str, zero: int, data: int, grad_bytes: int | None = None) -> ParamBytes:
    """Per-parameter bytes on one device for a compute dtype, ZeRO stage and data degree; gradients
    `grad_bytes` wide (default: the compute dtype's)."""
    try:
        w = g = DType(dtype).bytes
    except ValueError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DType)}") from None
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero!r}")
    if data < 1:
        raise ValueError(f"data degree must be >= 1, got {data!r}")
    if grad_bytes is not None:
        if grad_bytes not in (2, 4):
            raise ValueError(f"gradient width must be 2 or 4 bytes, got {grad_bytes!r}")
        g = grad_bytes
    opt = 12.0 if dtype != DType.FP32 else 8.0
    return ParamBytes(
        weights=w / data if zero >= 3 else w,
        gradients=g / data if zero >= 2 else g,
        optimizer=opt / data if zero >= 1 else opt,
    )


def autocast_param_bytes(zero: int, data: int, state_bytes: int = 8) -> ParamBytes:
    """Per-parameter bytes on one device as meshplan's runtime allocates them under torch.autocast
    (runtime/execute/grads.py): fp32 parameters (ZeRO-3 keeps a 1/d shard between uses), fp32 gradients in full
    (ZeRO-1/2 reduce-scatter into a shard gradient of 1/d besides them), and `state_bytes` of fp32
    optimizer state (AdamW's m and v: 8) sharded by ZeRO-1 and up. The 16-bit copies autocast makes of
    the weights are per micro-batch in flight, counted apart (MemoryBreakdown.weight_copies)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero!r}")
    if data < 1:
        raise ValueError(f"data degree must be >= 1, got {data!r}")
    return ParamBytes(weights=4.0 / data if zero >= 3 else 4.0,
                      gradients=4.0 + (4.0 / data if zero >= 1 else 0.0),
                      optimizer=state_bytes / data if zero >= 1 else float(state_bytes))


def adam_step_bytes(dtype: str) -> int:
    """Bytes moved per parameter by one fused Adam step (memory-bound).

    Mixed precision reads master, m, v (fp32) and the 2-byte gradient and
    writes master, m, v and the 2-byte weight: 14 + 14. fp32 reads weight,
    m, v, gradient and writes weight, m, v: 16 + 12.
    """
    return 28


def live_micro_batches(schedule: str, stage: int, pipeline: int, micro_batches: int,
                       virtual_stages: int = 1) -> float:
    """Micro-batches whose activations a device on pipeline position `stage` holds at its peak.

    GPipe and 1F1B: the peak of forwards not yet backwarded in the schedule's own action
    list (runtime/program/schedules.py): all m for GPipe, min(p - stage, m) for 1F1B. Interleaved
    1F1B with v chunks: Megatron-LM's estimate (Narayanan et al. SC'21, section 2.2), the
    (p - 1) extra warm-up chunk forwards spread over v chunks: (p - stage) + (p - 1) / v
    micro-batches' worth of one position's activations. It equals the action list's peak
    (forwards_in_flight / v) on position 0 and for v = 2; for v > 2 the list holds
    (stage) (1 - 2 / v) more on the later positions, which the planner's figures leave out.
    """
    if schedule == Schedule.INTERLEAVED:
        return float(min(pipeline - stage + (pipeline - 1) / virtual_stages, micro_batches))
    return float(forwards_in_flight(schedule, stage, pipeline, micro_batches))


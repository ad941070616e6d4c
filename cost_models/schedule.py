"""Pipeline schedule formulas (docs/STRATEGIES.md, "Pipeline parallelism"): the step time of the
schedules runtime/program/schedules.py defines.

p stages, m micro-batches, v virtual chunks per device. A "slot" is one
micro-batch's forward plus backward on the slowest stage.
"""

from __future__ import annotations

from runtime.vocab import Schedule


def bubble_fraction(schedule: str, pipeline: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of the step: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved."""
    p, m, v = pipeline, micro_batches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline, micro_batches and virtual_stages must be >= 1, got {p}, {m}, {v}")
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return (p - 1) / (m + p - 1)
    if schedule == Schedule.INTERLEAVED:
        return (p - 1) / (v * m + p - 1)
    raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(Schedule)}")


def pipeline_time(schedule: str, pipeline: int, micro_batches: int, slot: float,
                  virtual_stages: int = 1) -> tuple[float, float]:
    """(total, bubble) seconds for the pipelined part of a step.

    `slot` is the forward+backward time of one micro-batch on one device
    (all of its chunks). GPipe/1F1B: (m + p - 1) slots; interleaved: each
    chunk is slot/v, and fill/drain shrink to (p - 1) chunks.
    """
    frac = bubble_fraction(schedule, pipeline, micro_batches, virtual_stages)
    busy = micro_batches * slot
    total = busy / (1 - frac) if frac < 1 else busy
    return total, total - busy

"""Pipeline parallelism's ParallelConfig fields (planner/strategies/field_hooks.py): the schedule and
its chunks per device (virtual_stages), and the stages' places in a plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from planner.strategies.field_hooks import FieldFlag, PlanView, Problem, StrategyFields
from runtime.vocab import Schedule, StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


class PipelineFields(StrategyFields):
    name = StrategyName.PIPELINE
    flags = (FieldFlag("pipeline", "pipeline degree (default 1)"), FieldFlag("schedule"),
             FieldFlag("virtual_stages", "chunks per device (interleaved)"))

    def refusal(self, c: "ConfigFields") -> str | None:
        """Interleaved 1F1B (and only it) runs virtual_stages >= 2 chunks per device."""
        if c.schedule == Schedule.INTERLEAVED:
            if c.virtual_stages < 2:
                return ("the interleaved schedule needs virtual_stages >= 2 "
                        f"(got {c.virtual_stages}); use 1f1b for one chunk per device")
            if c.pipeline < 2:
                return "the interleaved schedule needs pipeline >= 2"
        elif c.virtual_stages != 1:
            return f"virtual_stages={c.virtual_stages} needs schedule='interleaved' (schedule is {c.schedule!r})"
        return None

    def micro_batch_refusal(self, c: "ConfigFields", global_batch_size: int, m: int) -> str | None:
        """Interleaved 1F1B runs micro-batches in groups of the pipeline size."""
        if c.schedule == Schedule.INTERLEAVED and m % c.pipeline:
            return (f"the interleaved schedule runs micro-batches in groups of the pipeline size: {m} micro-batches "
                    f"(global batch {global_batch_size} / (micro_batch_size {c.micro_batch_size} x data "
                    f"{c.data})) is not a multiple of pipeline {c.pipeline}; use 1f1b or change the batch")
        return None

    def label(self, c: "ConfigFields") -> str:
        return f"x{c.virtual_stages}" if c.schedule == Schedule.INTERLEAVED else ""

    def schedule_detail(self, c: "ConfigFields") -> str:
        return f" (v={c.virtual_stages})" if c.schedule == Schedule.INTERLEAVED else ""

    def plan_problems(self, plan: PlanView) -> Iterator[Problem]:
        for k, st in enumerate(plan.stages):
            if st.device_index >= plan.config.pipeline:
                yield f"stages[{k}].device_index", f"is {st.device_index}; the pipeline has {plan.config.pipeline} devices"


__all__ = ["PipelineFields"]

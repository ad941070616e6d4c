"""Bi-directional (GEMS) pipelines' ParallelConfig fields (planner/strategies/field_hooks.py):
`bidirectional` and `replicas_per_direction`, and the schedule and stage places they give a plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.strategies.field_hooks import FieldFlag, StageView, StrategyFields
from runtime.vocab import StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


class BidirectionalFields(StrategyFields):
    name = StrategyName.BIDIRECTIONAL
    flags = (FieldFlag("bidirectional", "GEMS bi-directional pipeline (device r holds stages r and p-1-r)"),
             FieldFlag("replicas_per_direction", "MASTER's T with --bidirectional: 2T micro-batches per step",
                       samples=True))
    title = "bidirectional (GEMS) pipelines"
    off_setting = "bidirectional=False"
    torch_gap = ("torch.distributed.pipelining has no schedule that runs a second pipeline replica's stages in "
                 "reverse over the same devices")

    def refusal(self, c: "ConfigFields") -> str | None:
        if not isinstance(c.bidirectional, bool):
            return f"ParallelConfig.bidirectional must be true or false, got {c.bidirectional!r}"
        if c.bidirectional:
            if c.pipeline < 2:
                return "a bidirectional pipeline needs pipeline >= 2 (device r holds stages r and p-1-r)"
        elif c.replicas_per_direction != 1:
            return f"replicas_per_direction={c.replicas_per_direction} needs bidirectional=True"
        return None

    def micro_batch_refusal(self, c: "ConfigFields", global_batch_size: int, m: int) -> str | None:
        """A step runs exactly 2T micro-batches per data replica (T = replicas_per_direction per direction)."""
        if c.bidirectional and m != 2 * c.replicas_per_direction:
            return (f"a bidirectional step runs 2 x replicas_per_direction = {2 * c.replicas_per_direction} "
                    f"micro-batches per data replica, but global batch {global_batch_size} / (micro_batch_size "
                    f"{c.micro_batch_size} x data {c.data}) = {m}; set micro_batch_size to "
                    f"{global_batch_size / (c.data * 2 * c.replicas_per_direction):g}")
        return None

    def schedule_label(self, c: "ConfigFields") -> str | None:
        return f"bidi T{c.replicas_per_direction}" if c.bidirectional else None

    def schedule_name(self, c: "ConfigFields") -> str | None:
        if not c.bidirectional:
            return None
        return f"bidirectional (GEMS, {c.replicas_per_direction} pair(s): device r runs stages r and p-1-r)"

    def stage_device(self, c: "ConfigFields", s: StageView) -> str | None:
        """Device r runs stage r of one direction and stage p-1-r of the other."""
        return f"{s.device_index}/{c.pipeline - 1 - s.device_index}" if c.bidirectional else None


__all__ = ["BidirectionalFields"]

"""Data parallelism's ParallelConfig fields (planner/strategies/field_hooks.py): the ZeRO stage."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.strategies.field_hooks import FieldFlag, StrategyFields
from runtime.vocab import StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


class DataFields(StrategyFields):
    name = StrategyName.DATA
    flags = (FieldFlag("data", "data degree (default 1)"), FieldFlag("zero", choices=(0, 1, 2, 3)))

    def refusal(self, c: "ConfigFields") -> str | None:
        if c.zero not in (0, 1, 2, 3) or isinstance(c.zero, bool):
            return f"ParallelConfig.zero must be 0, 1, 2 or 3, got {c.zero!r}"
        return None


__all__ = ["DataFields"]

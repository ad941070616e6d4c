"""The one list of the strategies' fields modules (planner/strategies/field_hooks.py), in registry order,
and what ParallelConfig asks of them: the checks of each strategy's own fields and of the micro-batches
per step, the strategies' part of ParallelConfig.short()'s label, and the fields a document leaves
out while their strategy is off. A plan's summary and load-time checks read the same list through
planner/strategies/describe.py.

How strategies combine is planner/strategies/combinations.py. ParallelConfig imports this module (the
strategies' own modules import ParallelConfig, so their fields live apart, in `fields`). Adding a
strategy: write planner/strategies/<name>/fields.py and list it here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.strategies.bidirectional.fields import BidirectionalFields
from planner.strategies.context.fields import ContextFields
from planner.strategies.data.fields import DataFields
from planner.strategies.field_hooks import StrategyFields
from planner.strategies.pipeline.fields import PipelineFields
from planner.strategies.spatial.fields import SpatialFields
from planner.strategies.subgraph.fields import SubgraphFields
from planner.strategies.tensor.fields import TensorFields

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields

# registry order (planner/strategies/registry.py): refusals are reported, and labels written, in it
FIELDS: tuple[StrategyFields, ...] = (DataFields(), TensorFields(), PipelineFields(), BidirectionalFields(),
                                      SpatialFields(), SubgraphFields(), ContextFields())


def label(config: "ConfigFields") -> str:
    """The schedule and the strategies' parts of ParallelConfig.short(), e.g. "interleavedx2 g2"."""
    schedule = next((s for f in FIELDS if (s := f.schedule_label(config))), config.schedule)
    return schedule + "".join(f.label(config) for f in FIELDS)


def unused_fields(config: "ConfigFields") -> tuple[str, ...]:
    """The ParallelConfig fields that `config`'s document leaves out (their strategy is off)."""
    return tuple(name for f in FIELDS for name in f.unused(config))


def field_refusal(config: "ConfigFields") -> str | None:
    """The first strategy's refusal of its own fields in `config`, or None."""
    return next((why for f in FIELDS if (why := f.refusal(config))), None)


def micro_batch_refusal(config: "ConfigFields", global_batch_size: int, m: int) -> str | None:
    """The first strategy's refusal of `m` micro-batches per step (global batch `global_batch_size`), or None."""
    return next((why for f in FIELDS if (why := f.micro_batch_refusal(config, global_batch_size, m))), None)


def node_split_fields() -> StrategyFields:
    """The fields of the one strategy that splits nodes (StrategyFields.node_splits): what a plan stores of
    the split, and the degree a split node spreads over."""
    return next(f for f in FIELDS if f.node_splits is not None)


__all__ = ["FIELDS", "field_refusal", "label", "micro_batch_refusal", "node_split_fields", "unused_fields"]

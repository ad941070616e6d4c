"""Each strategy's own ParallelConfig fields: the checks ParallelConfig runs on them, the
strategy's part of ParallelConfig.short()'s label, and the fields a document leaves out while
the strategy is off.

How strategies combine is planner/strategies/combinations.py; this module holds what one
strategy alone requires of its fields and of the micro-batches per step. Like that table it
needs the config only at run time, so ParallelConfig imports it (the strategy modules import
ParallelConfig). Every check returns a sentence saying what to change, or None; ParallelConfig
raises the first one, in registry order, as a ConfigError. A plan's own per-strategy text and
checks are planner/strategies/describe.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from runtime.vocab import Schedule, SpatialBatchNorm, StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


def _data(c: "ConfigFields") -> str | None:
    if c.zero not in (0, 1, 2, 3) or isinstance(c.zero, bool):
        return f"ParallelConfig.zero must be 0, 1, 2 or 3, got {c.zero!r}"
    return None


def _pipeline(c: "ConfigFields") -> str | None:
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


def _bidirectional(c: "ConfigFields") -> str | None:
    if not isinstance(c.bidirectional, bool):
        return f"ParallelConfig.bidirectional must be true or false, got {c.bidirectional!r}"
    if c.bidirectional:
        if c.pipeline < 2:
            return "a bidirectional pipeline needs pipeline >= 2 (device r holds stages r and p-1-r)"
    elif c.replicas_per_direction != 1:
        return f"replicas_per_direction={c.replicas_per_direction} needs bidirectional=True"
    return None


def _tensor(c: "ConfigFields") -> str | None:
    """Sequence parallelism shards the stream between tensor-parallel regions over the tensor ranks."""
    if not isinstance(c.sequence_parallel, bool):
        return f"ParallelConfig.sequence_parallel must be true or false, got {c.sequence_parallel!r}"
    if c.sequence_parallel and c.tensor < 2:
        return "sequence_parallel needs tensor >= 2 (it splits the sequence over the tensor-parallel ranks)"
    return None


def _context(c: "ConfigFields") -> str | None:
    """The attention exchange is chosen only where there is a context axis."""
    if c.context == 1 and c.context_attention != "ring":
        return f"context_attention={c.context_attention!r} needs context >= 2 (ranks per sequence)"
    return None


def _spatial(c: "ConfigFields") -> str | None:
    """The spatial degree and `spatial_until` (the last tiled layer) come together."""
    if c.spatial > 1 and not (isinstance(c.spatial_until, str) and c.spatial_until):
        return f"spatial={c.spatial} needs spatial_until, the name of the last layer that runs on image tiles"
    if c.spatial == 1 and c.spatial_until is not None:
        return f"spatial_until={c.spatial_until!r} needs spatial >= 2 (tiles per image)"
    return None


def _interleaved_batches(c: "ConfigFields", global_batch_size: int, m: int) -> str | None:
    """Interleaved 1F1B runs micro-batches in groups of the pipeline size."""
    if c.schedule == Schedule.INTERLEAVED and m % c.pipeline:
        return (f"the interleaved schedule runs micro-batches in groups of the pipeline size: {m} micro-batches "
                f"(global batch {global_batch_size} / (micro_batch_size {c.micro_batch_size} x data "
                f"{c.data})) is not a multiple of pipeline {c.pipeline}; use 1f1b or change the batch")
    return None


def _bidirectional_batches(c: "ConfigFields", global_batch_size: int, m: int) -> str | None:
    """A step runs exactly 2T micro-batches per data replica (T = replicas_per_direction per direction)."""
    if c.bidirectional and m != 2 * c.replicas_per_direction:
        return (f"a bidirectional step runs 2 x replicas_per_direction = {2 * c.replicas_per_direction} "
                f"micro-batches per data replica, but global batch {global_batch_size} / (micro_batch_size "
                f"{c.micro_batch_size} x data {c.data}) = {m}; set micro_batch_size to "
                f"{global_batch_size / (c.data * 2 * c.replicas_per_direction):g}")
    return None


# registry order (planner/strategies/registry.py); strategies without checks of their own are left out
FIELD_CHECKS: tuple[tuple[StrategyName, Callable[["ConfigFields"], str | None]], ...] = (
    (StrategyName.DATA, _data),
    (StrategyName.TENSOR, _tensor),
    (StrategyName.PIPELINE, _pipeline),
    (StrategyName.BIDIRECTIONAL, _bidirectional),
    (StrategyName.SPATIAL, _spatial),
    (StrategyName.CONTEXT, _context),
)

# (config, global batch in samples, micro-batches per step on each pipeline) -> refusal or None
MICRO_BATCH_CHECKS: tuple[tuple[StrategyName, Callable[["ConfigFields", int, int], str | None]], ...] = (
    (StrategyName.PIPELINE, _interleaved_batches),
    (StrategyName.BIDIRECTIONAL, _bidirectional_batches),
)


def _bidirectional_schedule(c: "ConfigFields") -> str | None:
    return f"bidi T{c.replicas_per_direction}" if c.bidirectional else None


def _interleaved_label(c: "ConfigFields") -> str:
    return f"x{c.virtual_stages}" if c.schedule == Schedule.INTERLEAVED else ""


def _spatial_label(c: "ConfigFields") -> str:
    if c.spatial == 1:
        return ""
    local = " bn=local" if c.spatial_batchnorm == SpatialBatchNorm.LOCAL else ""
    return f" s{c.spatial} {c.spatial_split}..{c.spatial_until}{local}"


def _subgraph_label(c: "ConfigFields") -> str:
    return f" g{c.subgraph}" if c.subgraph > 1 else ""


def _sequence_label(c: "ConfigFields") -> str:
    return " sp" if c.sequence_parallel else ""


def _context_label(c: "ConfigFields") -> str:
    return f" c{c.context} {c.context_attention}" if c.context > 1 else ""


# ParallelConfig.short(): strategies that run a schedule of their own name it in place of
# ParallelConfig.schedule; then each strategy's label text follows, in registry order
SCHEDULE_LABELS: tuple[tuple[StrategyName, Callable[["ConfigFields"], str | None]], ...] = (
    (StrategyName.BIDIRECTIONAL, _bidirectional_schedule),
)
LABELS: tuple[tuple[StrategyName, Callable[["ConfigFields"], str]], ...] = (
    (StrategyName.TENSOR, _sequence_label),
    (StrategyName.PIPELINE, _interleaved_label),
    (StrategyName.SPATIAL, _spatial_label),
    (StrategyName.SUBGRAPH, _subgraph_label),
    (StrategyName.CONTEXT, _context_label),
)


def label(config: "ConfigFields") -> str:
    """The schedule and the strategies' parts of ParallelConfig.short(), e.g. "interleavedx2 g2"."""
    schedule = next((s for _, name in SCHEDULE_LABELS if (s := name(config))), config.schedule)
    return schedule + "".join(part(config) for _, part in LABELS)


# ParallelConfig.to_dict(): fields a strategy that is off leaves out of the document, so that
# documents of configs without it stay as they were before the strategy existed
UNUSED_FIELDS: tuple[tuple[StrategyName, Callable[["ConfigFields"], bool], tuple[str, ...]], ...] = (
    (StrategyName.SPATIAL, lambda c: c.spatial == 1,
     ("spatial", "spatial_split", "spatial_until", "spatial_batchnorm")),
    (StrategyName.SUBGRAPH, lambda c: c.subgraph == 1, ("subgraph",)),
    (StrategyName.TENSOR, lambda c: not c.sequence_parallel, ("sequence_parallel",)),
    (StrategyName.CONTEXT, lambda c: c.context == 1, ("context", "context_attention")),
)


def unused_fields(config: "ConfigFields") -> tuple[str, ...]:
    """The ParallelConfig fields that `config`'s document leaves out (their strategy is off)."""
    return tuple(name for _, off, names in UNUSED_FIELDS if off(config) for name in names)


def field_refusal(config: "ConfigFields") -> str | None:
    """The first strategy's refusal of its own fields in `config`, or None."""
    return next((why for _, check in FIELD_CHECKS if (why := check(config))), None)


def micro_batch_refusal(config: "ConfigFields", global_batch_size: int, m: int) -> str | None:
    """The first strategy's refusal of `m` micro-batches per step (global batch `global_batch_size`), or None."""
    return next((why for _, check in MICRO_BATCH_CHECKS if (why := check(config, global_batch_size, m))), None)

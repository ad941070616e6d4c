"""Which parallel strategies combine: the one table that ParallelConfig, the search and codegen read.

Each `Rule` says that a strategy, where a config uses it, does not combine with some other
settings, at one `Level`:

- CONFIG: the combination describes no valid run; ParallelConfig refuses it (ConfigError), so
  neither the cost model nor the search ever sees it.
- RUNTIME: the cost model prices it but meshplan's runtime does not run it (yet);
  planner.capabilities.RuntimeSupport refuses it, so the search skips it and codegen will not
  lower it.

A refusal names every conflicting setting of the config at once and says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Callable

from runtime.vocab import RecomputeMode, Schedule, StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


class Level(StrEnum):
    """Where a combination stops (see module docstring)."""

    CONFIG = "config"
    RUNTIME = "runtime"


@dataclass(frozen=True)
class Conflict:
    """One setting a strategy does not combine with: `present(config)`, named by `label(config)`."""

    label: Callable[["ConfigFields"], str]
    present: Callable[["ConfigFields"], bool]


@dataclass(frozen=True)
class Rule:
    """`strategy` (where `uses(config)`) refuses `conflicts` at `level`; `refusal(config, names)` is the
    sentence, given the names of the conflicts present, joined by commas."""

    strategy: StrategyName
    level: Level
    uses: Callable[["ConfigFields"], bool]
    conflicts: tuple[Conflict, ...]
    refusal: Callable[["ConfigFields", str], str]

    def why_not(self, config: "ConfigFields") -> str | None:
        if not self.uses(config):
            return None
        found = [c.label(config) for c in self.conflicts if c.present(config)]
        return self.refusal(config, ", ".join(found)) if found else None


def _bidirectional(c: "ConfigFields") -> bool:
    return c.bidirectional


def _spatial(c: "ConfigFields") -> bool:
    return c.spatial > 1


def _subgraph(c: "ConfigFields") -> bool:
    return c.subgraph > 1


def _context(c: "ConfigFields") -> bool:
    return c.context > 1


RULES: tuple[Rule, ...] = (
    # GEMS runs its own schedule: replica A's stages forward, replica B's in reverse.
    Rule(StrategyName.BIDIRECTIONAL, Level.CONFIG, _bidirectional,
         (Conflict(lambda c: f"schedule {c.schedule!r}",
                   lambda c: c.schedule != Schedule.ONE_F_ONE_B or c.virtual_stages != 1),),
         lambda c, _: "a bidirectional pipeline runs its own (GEMS) schedule; leave schedule='1f1b' "
                      "and virtual_stages=1"),
    # Devices r and p-1-r hold the same two stages and all-reduce their whole gradients.
    Rule(StrategyName.BIDIRECTIONAL, Level.CONFIG, _bidirectional,
         (Conflict(lambda c: f"ZeRO {c.zero}", lambda c: c.zero != 0),),
         lambda c, _: f"a bidirectional pipeline supports ZeRO stage 0 only (got {c.zero})"),
    # The sub-graph cost model and lowering place whole paths on sub-grids of replicated ops.
    Rule(StrategyName.SUBGRAPH, Level.CONFIG, _subgraph,
         (Conflict(lambda c: "tensor > 1", lambda c: c.tensor > 1),
          Conflict(lambda c: "bidirectional", _bidirectional),
          Conflict(lambda c: "spatial > 1", _spatial),
          Conflict(lambda c: f"recompute={c.recompute!r}", lambda c: c.recompute != RecomputeMode.NONE)),
         lambda c, names: f"subgraph={c.subgraph} does not combine with {names} yet; use subgraph=1 or drop those"),
    # Context parallelism splits token sequences; spatial tiles and sub-grids split images and branches,
    # and GEMS's reversed replica would need a second ring.
    Rule(StrategyName.CONTEXT, Level.CONFIG, _context,
         (Conflict(lambda c: "bidirectional", _bidirectional),
          Conflict(lambda c: "spatial > 1", _spatial),
          Conflict(lambda c: "subgraph > 1", _subgraph)),
         lambda c, names: f"context={c.context} does not combine with {names}; use context=1 or drop those"),
    # codegen/strategies/spatial/program.py lowers tiles with the first stage holding the spatial part, untensored and stored.
    Rule(StrategyName.SPATIAL, Level.RUNTIME, _spatial,
         (Conflict(lambda c: f"the {c.schedule} schedule",
                   lambda c: c.schedule not in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)),
          Conflict(lambda c: f"tensor {c.tensor}", lambda c: c.tensor != 1),
          Conflict(lambda c: f"recompute {c.recompute!r}", lambda c: c.recompute != RecomputeMode.NONE)),
         lambda c, names: "the runtime runs spatial tiles with gpipe/1f1b/bidirectional pipelines, tensor 1 and no "
                          f"recompute, not with {names}"),
    # codegen/strategies/context/stage_code.py rewrites the captured graph for the chunks before the tensor-parallel split; sequence
    # parallelism's split of the stream over the tensor ranks is not proven on those chunks (Megatron runs both).
    Rule(StrategyName.CONTEXT, Level.RUNTIME, _context,
         (Conflict(lambda c: "sequence parallelism", lambda c: c.sequence_parallel),),
         lambda c, names: f"the runtime runs context parallelism (context={c.context}) without {names} "
                          "(sequence_parallel=False) so far"),
    # runtime/parallel/subgraph/regions.py keeps each path's parameters whole on its sub-grid.
    Rule(StrategyName.SUBGRAPH, Level.RUNTIME, _subgraph,
         (Conflict(lambda c: f"ZeRO stage {c.zero}", lambda c: c.zero != 0),),
         lambda c, _: f"the runtime runs sub-graph parallelism with ZeRO 0, not ZeRO stage {c.zero}"),
)


def why_not(config: "ConfigFields", level: Level) -> str | None:
    """The first refusal of `config` at `level` (a sentence naming what to change), or None."""
    return next((why for rule in RULES if rule.level == level and (why := rule.why_not(config))), None)

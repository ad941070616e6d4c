"""What a strategy says about its own ParallelConfig fields and its part of a plan: the hooks of
`StrategyFields`, which each strategy's home implements in its `fields` module
(planner/strategies/<name>/fields.py) and planner/strategies/fields.py lists in registry order.

ParallelConfig runs the field checks and writes the label and document through that list
(planner/strategies/fields.py); a Plan's summary and its load-time checks read it through
planner/strategies/describe.py. The hooks see a config as `ConfigFields` and a plan as `PlanView`
(a protocol of the Plan's fields they read, which the Plan satisfies), so no fields module imports
ParallelConfig or the Plan, both of which read these modules.

Every hook has a neutral default; a strategy overrides what it has to say. Checks return a
sentence saying what to change, or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence, runtime_checkable

from runtime.vocab import StrategyName

if TYPE_CHECKING:
    from cost_models.hardware import Cluster
    from planner.config_fields import ConfigFields
    from planner.strategies.subgraph.regions import Region

# (field of the plan document, sentence saying what is wrong and what to do)
Problem = tuple[str, str]


@runtime_checkable
class StageView(Protocol):
    """What the hooks read of a planner.plan.Stage."""

    device_index: int
    layers: tuple[str, ...]


class SplitsView(Protocol):
    """What the hooks read of a plan's tensor splits (planner.strategies.tensor.split.splits.TensorSplits,
    which imports ParallelConfig): the tensor degree they were made for."""

    tensor: int


@runtime_checkable
class PlanView(Protocol):
    """What the hooks read of a planner.plan.Plan (which satisfies it)."""

    config: "ConfigFields"
    cluster: "Cluster"
    stages: Sequence[StageView]
    shardings: tuple[tuple[str, str], ...]
    subgraph: tuple["Region", ...]
    tensor_splits: SplitsView | None


@dataclass(frozen=True)
class FieldFlag:
    """A ParallelConfig field `meshplan codegen` takes as a flag, --FIELD with dashes (planner/app/cli.py
    reads its type, default and choices from ConfigFields: a bool is a switch, an enum's default gives the
    choices, a degree is a device count). `help`: the flag's help text; `choices`: a whole number's only
    values; `samples`: a count of micro-batches rather than of devices."""

    field: str
    help: str | None = None
    choices: tuple[int, ...] = ()
    samples: bool = False


class StrategyFields:
    """One strategy's ParallelConfig fields and its part of a plan's text (see module docstring)."""

    name: StrategyName
    # its fields `meshplan codegen` takes as flags, in the order --help lists them
    flags: tuple[FieldFlag, ...] = ()
    # what a target's refusal calls this strategy ("spatial parallelism"), the setting that leaves it out
    # ("spatial=1"), and why PyTorch's stack (the torch target, planner/capabilities.py) does not run it
    # (None where it does)
    title: str = ""
    off_setting: str = ""
    torch_gap: str | None = None

    # ---- the config (ParallelConfig, planner/config.py) ---------------------------------------------
    def refusal(self, c: "ConfigFields") -> str | None:
        """What is wrong with this strategy's own fields in `c` (how strategies combine is
        planner/strategies/combinations.py), or None."""
        return None

    def micro_batch_refusal(self, c: "ConfigFields", global_batch_size: int, m: int) -> str | None:
        """What is wrong with `m` micro-batches per step on each pipeline (global batch `global_batch_size`
        samples) for this strategy, or None."""
        return None

    def unused(self, c: "ConfigFields") -> tuple[str, ...]:
        """The fields `c`'s document leaves out while this strategy is off, so that documents of configs
        without it stay as they were before the strategy existed."""
        return ()

    def schedule_label(self, c: "ConfigFields") -> str | None:
        """ParallelConfig.short()'s schedule, where this strategy runs one of its own, else None."""
        return None

    def label(self, c: "ConfigFields") -> str:
        """This strategy's text in ParallelConfig.short() after the schedule (e.g. " s4 grid..pool")."""
        return ""

    # ---- a plan's summary and load-time checks (planner/plan.py via describe.py) ------------------
    def schedule_name(self, c: "ConfigFields") -> str | None:
        """The summary's schedule, where this strategy runs one of its own, else None."""
        return None

    def schedule_detail(self, c: "ConfigFields") -> str:
        """Text right after the summary's schedule name (e.g. " (v=2)")."""
        return ""

    def config_line(self, c: "ConfigFields") -> str | None:
        """A line under the summary's mesh line, or None."""
        return None

    def stage_device(self, c: "ConfigFields", s: StageView) -> str | None:
        """The stage table's "dev" column where this strategy places a stage on more than one position."""
        return None

    def section(self, plan: PlanView) -> list[str]:
        """Lines after the summary's stage table."""
        return []

    def plan_problems(self, plan: PlanView) -> Iterator[Problem]:
        """What is wrong with this strategy's part of a plan read from a file."""
        return iter(())


__all__ = ["FieldFlag", "PlanView", "Problem", "SplitsView", "StageView", "StrategyFields"]

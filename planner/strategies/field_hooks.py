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
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol, Sequence, runtime_checkable

from runtime.vocab import StrategyName

if TYPE_CHECKING:
    from cost_models.hardware import Cluster
    from planner.config_fields import ConfigFields
    from runtime.documents import Fields

# (field of the plan document, sentence saying what is wrong and what to do)
Problem = tuple[str, str]


@runtime_checkable
class StageView(Protocol):
    """What the hooks read of a planner.plan.Stage."""

    device_index: int
    layers: tuple[str, ...]


class SplitsView(Protocol):
    """What the hooks and the Plan read of the split a plan stores for its nodes (the splitting strategy's
    StrategyFields.node_splits: planner.strategies.tensor.split.splits.TensorSplits): the degree it was made
    for, and its document."""

    tensor: int

    def to_dict(self) -> dict:
        """Its value in the plan document."""


class PlanPart(Protocol):
    """A strategy's own part of a Plan (e.g. sub-graph parallelism's split regions), stored in the plan
    document under `key` and kept in Plan.parts; a strategy declares its kind as StrategyFields.plan_part."""

    key: ClassVar[str]

    def to_json(self) -> Any:
        """Its value in the plan document."""

    @classmethod
    def read(cls, f: "Fields") -> "PlanPart | None":
        """The part in the plan document `f` (each field checked; FieldError names a bad one), or None
        where the document has none."""


@runtime_checkable
class PlanView(Protocol):
    """What the hooks read of a planner.plan.Plan (which satisfies it)."""

    config: "ConfigFields"
    cluster: "Cluster"
    stages: Sequence[StageView]
    shardings: tuple[tuple[str, str], ...]
    tensor_splits: SplitsView | None

    def part(self, key: str) -> Any:
        """The strategy part stored under `key`, or None."""


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
    # the kind of its part of a Plan (a PlanPart), where it stores one
    plan_part: type[PlanPart] | None = None
    # where this is the strategy that splits nodes (planner/strategies/base.Strategy.splits_nodes): the kind
    # of the split a plan stores for them (Plan.tensor_splits: a SplitsView with a classmethod read(Fields)),
    # and the ParallelConfig field counting the ranks a split node spreads over
    node_splits: type | None = None
    split_degree: str | None = None

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

    def explain_lines(self, plan: PlanView) -> list[str]:
        """Lines under the chosen configuration in the search's explanation (planner.search.explain)."""
        return []


__all__ = ["FieldFlag", "PlanPart", "PlanView", "Problem", "SplitsView", "StageView", "StrategyFields"]

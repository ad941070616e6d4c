"""Each strategy's part in a plan's summary and in the checks a plan file passes when it loads.

Plan (planner/plan.py) writes the parts shared by every plan and asks these functions, which ask the
strategies' fields modules (planner/strategies/fields.py lists them, in registry order), for the
rest. They read a plan as `PlanView` (planner/strategies/field_hooks.py), so this module never imports
planner/plan.py, which imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from planner.strategies.field_hooks import PlanPart, PlanView, Problem, StageView
from planner.strategies.fields import FIELDS

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


def schedule_text(c: "ConfigFields") -> str:
    """The summary's schedule: its name and details, e.g. "interleaved (v=2)"."""
    name = next((n for f in FIELDS if (n := f.schedule_name(c))), c.schedule)
    return name + "".join(f.schedule_detail(c) for f in FIELDS)


def config_lines(c: "ConfigFields") -> list[str]:
    """The strategies' lines under the summary's mesh line."""
    return [ln for f in FIELDS if (ln := f.config_line(c)) is not None]


def stage_device(c: "ConfigFields", s: StageView) -> str:
    """The pipeline position(s) that run stage `s`, as the summary's stage table shows them."""
    return next((d for f in FIELDS if (d := f.stage_device(c, s))), str(s.device_index))


def sections(plan: PlanView) -> list[str]:
    """The strategies' sections under the summary's stage table."""
    return [ln for f in FIELDS for ln in f.section(plan)]


def explain_lines(plan: PlanView) -> list[str]:
    """The strategies' lines under the chosen configuration in the search's explanation."""
    return [ln for f in FIELDS for ln in f.explain_lines(plan)]


def plan_parts() -> tuple[type[PlanPart], ...]:
    """The kinds of the strategies' parts of a Plan, in registry order (as a plan document lists them)."""
    return tuple(f.plan_part for f in FIELDS if f.plan_part is not None)


def plan_problems(plan: PlanView) -> Iterator[Problem]:
    """What each strategy finds wrong with a plan read from a file, in registry order."""
    for f in FIELDS:
        yield from f.plan_problems(plan)


__all__ = ["config_lines", "explain_lines", "plan_parts", "plan_problems", "schedule_text", "sections",
           "stage_device"]

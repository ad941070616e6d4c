"""Sub-graph parallelism's ParallelConfig field (planner/strategies/field_hooks.py): `subgraph` (sub-grids
per data replica), and the split regions a plan stores."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from planner.strategies.field_hooks import FieldFlag, PlanView, Problem, StrategyFields
from planner.strategies.subgraph.part import SubgraphRegions
from planner.strategies.subgraph.regions import describe_regions
from runtime.vocab import MeshAxis, StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


class SubgraphFields(StrategyFields):
    name = StrategyName.SUBGRAPH
    flags = (FieldFlag("subgraph", "sub-graph parallel degree B (sub-grids per replica)"),)
    title = "sub-graph parallelism"
    off_setting = "subgraph=1"
    torch_gap = "PyTorch places no fork/join branches of a model on sub-grids of one data replica"

    def unused(self, c: "ConfigFields") -> tuple[str, ...]:
        return ("subgraph",) if c.subgraph == 1 else ()

    def label(self, c: "ConfigFields") -> str:
        return f" g{c.subgraph}" if c.subgraph > 1 else ""

    plan_part = SubgraphRegions

    def section(self, plan: PlanView) -> list[str]:
        regions = _regions(plan)
        if not regions:
            return []
        c = plan.config
        return ["", f"  sub-graph parallelism: {c.subgraph} sub-grids per data replica (mesh axis '{MeshAxis.SUBGRAPH}')",
                *(f"    {ln}" for ln in describe_regions(regions, c.subgraph))]

    def plan_problems(self, plan: PlanView) -> Iterator[Problem]:
        c, regions = plan.config, _regions(plan)
        if (c.subgraph > 1) != bool(regions):
            yield "subgraph", (f"lists {len(regions)} split regions but config.subgraph is {c.subgraph}; "
                               "make the plan again")
        for k, r in enumerate(regions):
            if max(r.owners) >= c.subgraph:
                yield f"subgraph[{k}]", f"gives a path to sub-grid {max(r.owners)}; there are {c.subgraph}"


    def explain_lines(self, plan: PlanView) -> list[str]:
        return [f"  sub-graph {ln}" for ln in describe_regions(_regions(plan), plan.config.subgraph)]


def _regions(plan: PlanView) -> tuple:
    """The plan's split regions (() where it has none)."""
    part = plan.part(SubgraphRegions.key)
    return part.regions if part is not None else ()


__all__ = ["SubgraphFields"]

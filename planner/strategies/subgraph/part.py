"""Sub-graph parallelism's part of a Plan: the split regions and which sub-grid runs each path
(planner/strategies/subgraph/regions.py decides them), stored under the plan document's "subgraph" key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from planner.strategies.subgraph.regions import Region
from runtime.documents import Fields


@dataclass(frozen=True)
class SubgraphRegions:
    """The split regions of a plan with sub-graph parallelism (a planner.strategies.field_hooks.PlanPart)."""

    key: ClassVar[str] = "subgraph"
    regions: tuple[Region, ...]

    def to_json(self) -> list:
        return [r.to_dict() for r in self.regions]

    @classmethod
    def read(cls, f: Fields) -> "SubgraphRegions | None":
        """The part in the plan document `f` (each region checked), or None where it has none."""
        regions = tuple(f.each(cls.key, Region.read, []))
        return cls(regions) if regions else None


__all__ = ["SubgraphRegions"]

"""Spatial parallelism's ParallelConfig fields (planner/strategies/field_hooks.py): `spatial` (tiles per
image), `spatial_split`, `spatial_until` (the last tiled layer) and `spatial_batchnorm`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from planner.strategies.field_hooks import FieldFlag, PlanView, Problem, StrategyFields
from runtime.vocab import SpatialBatchNorm, StrategyName

if TYPE_CHECKING:
    from planner.config_fields import ConfigFields


class SpatialFields(StrategyFields):
    name = StrategyName.SPATIAL
    flags = (FieldFlag("spatial", "spatial degree: tiles per image (needs --spatial-until)"),
             FieldFlag("spatial_split", "how images are tiled: horizontal strips, vertical strips or a grid"),
             FieldFlag("spatial_until", "the last layer that runs on image tiles (a layer name)"),
             FieldFlag("spatial_batchnorm", "BatchNorm statistics over the whole image (sync, exact) or per tile"))
    title = "spatial parallelism"
    off_setting = "spatial=1"
    torch_gap = "PyTorch has no tiling of convolutions over devices with halo exchange"

    def refusal(self, c: "ConfigFields") -> str | None:
        """The spatial degree and `spatial_until` come together."""
        if c.spatial > 1 and not (isinstance(c.spatial_until, str) and c.spatial_until):
            return f"spatial={c.spatial} needs spatial_until, the name of the last layer that runs on image tiles"
        if c.spatial == 1 and c.spatial_until is not None:
            return f"spatial_until={c.spatial_until!r} needs spatial >= 2 (tiles per image)"
        return None

    def unused(self, c: "ConfigFields") -> tuple[str, ...]:
        return ("spatial", "spatial_split", "spatial_until", "spatial_batchnorm") if c.spatial == 1 else ()

    def label(self, c: "ConfigFields") -> str:
        if c.spatial == 1:
            return ""
        local = " bn=local" if c.spatial_batchnorm == SpatialBatchNorm.LOCAL else ""
        return f" s{c.spatial} {c.spatial_split}..{c.spatial_until}{local}"

    def config_line(self, c: "ConfigFields") -> str | None:
        if c.spatial == 1:
            return None
        return (f"  spatial: {c.spatial} tiles ({c.spatial_split}) per image through layer {c.spatial_until}, "
                f"BatchNorm statistics {c.spatial_batchnorm}; later layers replicated on the tiles' devices")

    def plan_problems(self, plan: PlanView) -> Iterator[Problem]:
        until = plan.config.spatial_until
        if until is not None and not any(until in st.layers for st in plan.stages):
            yield "config.spatial_until", f"is {until!r}, which no stage holds; name the last spatially split layer"


__all__ = ["SpatialFields"]

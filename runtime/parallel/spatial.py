"""Spatial parallelism at run time: the spatial stage's module becomes its tile version, and the
s ranks holding tiles of the same images read the same data (runtime/spatial_model.py)."""

from __future__ import annotations

from runtime import spatial_model
from runtime.context import DistContext
from runtime.parallel.base import Modules, RuntimeStrategy, Specs, StrategyName
from runtime.program import Program


class Spatial(RuntimeStrategy):
    """Image tiles over runs of s ranks on the data axis (StageSpec.spatial)."""

    name = StrategyName.SPATIAL

    def attach(self, ctx: DistContext, program: Program, specs: Specs, modules: Modules) -> None:
        spatial_model.apply_to_stages(specs, modules, ctx)

    def data_shard(self, specs: Specs, shard: tuple[int, int]) -> tuple[int, int]:
        return spatial_model.data_shard(shard[0], shard[1], specs)


__all__ = ["Spatial"]

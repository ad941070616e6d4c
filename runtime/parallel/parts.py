"""The one list of the Program parts (runtime/program/parts.py): the strategies that write a piece of
their own into a rank's Program, in the order the Program writes them. Adding such a strategy: write
runtime/parallel/<name>/part.py and list its part here. This list is apart from registry.py because
the Program reads it, and registry.py's strategies import the Program.

STAGE_PARTS: likewise the strategies' parts of a StageSpec (runtime/spec.py): what a stage's code was
written for (spatial: its tiling), each written under its key in every stage's document (null where
the stage has none, as builds have always written them)."""

from __future__ import annotations

from runtime.parallel.context.part import ContextShard
from runtime.parallel.spatial.geometry import SpatialSpec
from runtime.parallel.spatial.part import SpatialTiles
from runtime.program.parts import ProgramPart

PARTS: tuple[type[ProgramPart], ...] = (SpatialTiles, ContextShard)
STAGE_PARTS: tuple[type, ...] = (SpatialSpec,)

__all__ = ["PARTS", "STAGE_PARTS"]

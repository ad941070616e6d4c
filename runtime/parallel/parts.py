"""The one list of the Program parts (runtime/program/parts.py): the strategies that write a piece of
their own into a rank's Program, in the order the Program writes them. Adding such a strategy: write
runtime/parallel/<name>/part.py and list its part here. This list is apart from registry.py because
the Program reads it, and registry.py's strategies import the Program."""

from __future__ import annotations

from runtime.parallel.context.part import ContextShard
from runtime.parallel.spatial.part import SpatialTiles
from runtime.program.parts import ProgramPart

PARTS: tuple[type[ProgramPart], ...] = (SpatialTiles, ContextShard)

__all__ = ["PARTS"]

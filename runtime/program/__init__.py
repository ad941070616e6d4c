"""A rank's Program and what reads it: the instruction set and the Program (core.py, whose docstring
lists the instructions), the document check (check.py), the mesh layout (mesh.py), the strategies'
parts (parts.py), pipeline schedules, timelines and the step's work.

`from runtime.program import Program, Instr, ...` finds the names of core.py on first use; the package
itself imports nothing, so a strategy's part (runtime/parallel/<name>/part.py) can import the instruction
set while core.py reads the list of parts.
"""

from __future__ import annotations

from runtime.lazy import forwarding

__getattr__ = forwarding("runtime.program.core")

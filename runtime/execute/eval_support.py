"""Which plans held-out evaluation (runtime/execute/evaluation.py) runs on, checked before any rank
talks to another, so that every rank exits with the same message instead of hanging; codegen and
`meshplan run` check the same before a build is written or started. The strategies say which they
refuse (runtime/parallel/registry.not_evaluated): this module names none."""

from __future__ import annotations

from typing import Iterable

from runtime.execute.evaluation import EvalError
from runtime.parallel.registry import not_evaluated
from runtime.program import PAIR_AXIS, Program


def check_supported(mesh_axes: Iterable[str], paired: bool) -> None:
    """EvalError naming the plan feature that evaluation does not run on.

    mesh_axes: the plan's mesh axes; paired: whether its pipelines run in pairs (the Program's
    derived pair axis)."""
    feature = not_evaluated([*mesh_axes, *([PAIR_AXIS] if paired else [])])
    if feature is not None:
        raise EvalError(f"--eval-every: evaluation does not run on plans with {feature}; evaluate with a "
                        "data/tensor/pipeline plan, or leave --eval-every out")


def check_program(program: Program) -> None:
    """check_supported for the plan `program` (any rank's) runs."""
    check_supported((a for a, _ in program.mesh), PAIR_AXIS in program.derived_axes)


__all__ = ["check_program", "check_supported"]

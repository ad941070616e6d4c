"""Bi-directional (GEMS) pipelines at run time. The two replicas' instructions, their exchange over
the pair axis (pipeline positions {i, p-1-i} x data) and the gradient sums are all in the Program, so
the executor runs them like any other and there is nothing to attach to the stage modules. What this
strategy adds at run time is a refusal: held-out evaluation walks one pipeline's forward, and a
Program of two pipelines has none it could walk alone."""

from __future__ import annotations

from runtime.parallel.base import RuntimeStrategy
from runtime.program import PAIR_AXIS
from runtime.vocab import StrategyName


class Bidirectional(RuntimeStrategy):
    """Two pipelines in opposite directions over the same ranks (the Program's derived pair axis)."""

    name = StrategyName.BIDIRECTIONAL
    axis = PAIR_AXIS
    not_evaluated = "bi-directional (GEMS) pipelines"


__all__ = ["Bidirectional"]

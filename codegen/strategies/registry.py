"""The one list of the strategies codegen lowers, in the order their hooks run.

Within a phase, passes run in this order: data's loss reduction and ZeRO gathers come before
the pipeline's loss broadcast, so the last collective of a step is the pipeline's. Adding a
strategy: write codegen/strategies/<name>.py (a LoweringStrategy) and list it here.
"""

from __future__ import annotations

from codegen.strategies.base import LoweringStrategy, Placement
from codegen.strategies.bidirectional import Bidirectional
from codegen.strategies.context.strategy import Context
from codegen.strategies.data import Data
from codegen.strategies.pipeline import Pipeline
from codegen.strategies.spatial.strategy import Spatial
from codegen.strategies.subgraph.strategy import Subgraph
from codegen.strategies.tensor.strategy import Tensor
from planner.plan import Plan

STRATEGIES: tuple[LoweringStrategy, ...] = (Data(), Pipeline(), Bidirectional(), Spatial(), Tensor(), Subgraph(),
                                            Context())


def active(plan: Plan) -> tuple[LoweringStrategy, ...]:
    """The strategies `plan` uses, in registry order. Of the placements, the last active one places the
    stages (it refines those before it, as bidirectional pipelines refine the pipeline), and only it."""
    used = [s for s in STRATEGIES if s.active(plan)]
    last = [s for s in used if s.places_stages][-1]
    return tuple(s for s in used if not s.places_stages or s is last)


def placement(strategies: tuple[LoweringStrategy, ...]) -> Placement:
    """The one strategy among `strategies` that places stages on pipeline positions."""
    (found,) = [s for s in strategies if s.places_stages]
    return found  # type: ignore[return-value]


def node_split_lowering() -> LoweringStrategy:
    """The one registered strategy that splits nodes (LoweringStrategy.splits_nodes), whatever the plan's degree."""
    (found,) = [s for s in STRATEGIES if s.splits_nodes]
    return found


__all__ = ["STRATEGIES", "active", "node_split_lowering", "placement"]

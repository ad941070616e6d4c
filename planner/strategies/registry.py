"""The one list of parallel strategies the Evaluator and the search loop over.

Order is composition order (planner/strategies/base.py): a strategy listed later refines
the ones before it. Adding a dimension: its module here, one entry below, its rules in
combinations.py.
"""

from __future__ import annotations

from planner.strategies.base import Strategy
from planner.strategies.bidirectional.strategy import BidirectionalStrategy
from planner.strategies.context.strategy import ContextStrategy
from planner.strategies.data.strategy import DataStrategy
from planner.strategies.pipeline.strategy import PipelineStrategy
from planner.strategies.spatial.strategy import SpatialStrategy
from planner.strategies.subgraph.strategy import SubgraphStrategy
from planner.strategies.tensor.strategy import TensorStrategy

STRATEGIES: tuple[Strategy, ...] = (
    DataStrategy(),
    TensorStrategy(),
    PipelineStrategy(),
    BidirectionalStrategy(),
    SpatialStrategy(),
    SubgraphStrategy(),
    ContextStrategy(),
)


def node_splitter(strategies: tuple[Strategy, ...] = STRATEGIES) -> Strategy:
    """The one strategy of `strategies` that splits nodes over ranks (Strategy.splits_nodes)."""
    found = [s for s in strategies if s.splits_nodes]
    if len(found) != 1:
        raise RuntimeError(f"exactly one registered strategy must split nodes, found {[s.name for s in found]}")
    return found[0]

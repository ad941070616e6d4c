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

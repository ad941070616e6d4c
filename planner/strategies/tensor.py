"""Tensor (operator) parallelism (degree t), planner side: which degrees the model allows.

The per-op roles come from planner/sharding.py (Megatron's column/row pattern, attention
by heads, vocabulary-parallel embeddings); the integer program of planner/ilp.py picks,
per layer, which regions to shard at a degree; the Evaluator prices a node with its role
(FLOPs, bytes and weights over t, plus the role's all-reduces on the tensor axis).
"""

from __future__ import annotations

from planner.config import ParallelConfig
from planner.strategies.base import Strategy, StrategyName


class TensorStrategy(Strategy):
    """See module docstring."""

    name = StrategyName.TENSOR
    named_at_one = True

    def check(self, ev, config: ParallelConfig) -> None:
        """ValueError naming the first split size that the tensor degree must divide and does not."""
        ev.sharding.check(config.tensor)

"""Context parallelism (degree c, the "context" mesh axis), planner side.

Every layer's activations are split along the sequence over the c ranks of the axis;
attention reaches the other ranks' keys and values (ring attention or Ulysses all-to-all,
runtime.vocab.ContextAttention).
"""

from __future__ import annotations

from planner.config import ConfigError, ParallelConfig
from planner.strategies.base import Strategy
from runtime.vocab import StrategyName


class ContextStrategy(Strategy):
    """See module docstring."""

    name = StrategyName.CONTEXT

    def check(self, ev, config: ParallelConfig) -> None:
        raise ConfigError(f"context={config.context}: the cost model does not price context parallelism yet; "
                          "use context=1")

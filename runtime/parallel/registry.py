"""The one list of the strategies that act on a rank at run time, in the order their hooks run.

Spatial comes first: it replaces stage modules, and the others attach groups to the modules
that then train (context: its group and sequence chunks, and the targets' order). Strategies with nothing to attach (data, pipeline, bidirectional) run as the
Program says, through the executor, and have no entry. Adding a strategy: write
runtime/parallel/<name>.py (a RuntimeStrategy) and list it here.
"""

from __future__ import annotations

from runtime.parallel.base import RuntimeStrategy
from runtime.parallel.context.strategy import Context
from runtime.parallel.spatial.strategy import Spatial
from runtime.parallel.subgraph.strategy import Subgraph
from runtime.parallel.tensor.strategy import Tensor

STRATEGIES: tuple[RuntimeStrategy, ...] = (Spatial(), Tensor(), Subgraph(), Context())

__all__ = ["STRATEGIES"]

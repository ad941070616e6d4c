"""The one list of the strategies that act on a rank at run time, in the order their hooks run.

Spatial comes first: it replaces stage modules, and the others attach groups to the modules
that then train (context: its group and sequence chunks, and the targets' order). Data and pipeline
parallelism run as the Program says, through the executor, and have no entry; bidirectional
pipelines do too, and are listed for what the runtime refuses with them (`not_evaluated`). Adding a strategy: write
runtime/parallel/<name>.py (a RuntimeStrategy) and list it here.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from runtime.materialize import MaterializeError
from runtime.parallel.base import RuntimeStrategy
from runtime.parallel.bidirectional.strategy import Bidirectional
from runtime.parallel.context.strategy import Context
from runtime.parallel.spatial.strategy import Spatial
from runtime.parallel.subgraph.strategy import Subgraph
from runtime.parallel.tensor.strategy import Tensor
from runtime.program import Program
from runtime.program.shards import ModuleShard, ParamShard

STRATEGIES: tuple[RuntimeStrategy, ...] = (Spatial(), Tensor(), Subgraph(), Context(), Bidirectional())


def param_place(program: Program) -> tuple[int, int]:
    """(coordinate, ranks) of this rank among those holding slices of the split parameters (the strategies'
    param_place hook; (0, 1) where nothing is split)."""
    return next((place for s in STRATEGIES if (place := s.param_place(program)) is not None), (0, 1))


class StageSplits:
    """The StageSpecs' module and parameter splits as the strategies make them (their local_module and
    local_param hooks): runtime.materialize.build_stage's `splits`."""

    def module(self, module: nn.Module, shard: ModuleShard, rank: int, num: int) -> nn.Module:
        return _first(lambda s: s.local_module(module, shard, rank, num), f"module {shard.path!r}")

    def param(self, value: torch.Tensor, shard: ParamShard, rank: int, num: int) -> torch.Tensor:
        return _first(lambda s: s.local_param(value, shard, rank, num), f"tensor {shard.name!r}")


def _first(hook, what: str):
    out = next((x for s in STRATEGIES if (x := hook(s)) is not None), None)
    if out is None:
        raise MaterializeError(f"the StageSpec splits {what}, but no strategy of this runtime makes such splits; "
                         "build the plan again with this version of meshplan")
    return out


def not_evaluated(axes: Iterable[str]) -> str | None:
    """The plan feature held-out evaluation names when it cannot run on a Program with these mesh and
    derived `axes` (the first in registry order), or None where it runs."""
    found = set(axes)
    return next((s.not_evaluated for s in STRATEGIES if s.not_evaluated and s.axis in found), None)


__all__ = ["STRATEGIES", "StageSplits", "not_evaluated", "param_place"]

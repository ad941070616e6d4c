"""Tensor parallelism at run time: the stage modules' tensor-parallel layers get the tensor group.

The layers themselves are sharded when the stage modules are built (runtime.materialize with
runtime.tensor_parallel, from the StageSpec's shards); their group exists only once the ranks
are connected.
"""

from __future__ import annotations

from runtime.context import DistContext
from runtime.materialize import set_tensor_group
from runtime.parallel.base import Modules, RuntimeStrategy, Specs, StrategyName
from runtime.program import Program
from runtime.vocab import MeshAxis


class Tensor(RuntimeStrategy):
    """Megatron-style column/row parallel layers over the tensor axis."""

    name = StrategyName.TENSOR

    def attach(self, ctx: DistContext, program: Program, specs: Specs, modules: Modules) -> None:
        group = ctx.group(MeshAxis.TENSOR) if MeshAxis.TENSOR in ctx.groups else None
        for module in modules.values():
            set_tensor_group(module, group)


__all__ = ["Tensor"]

"""Tensor (and sequence) parallelism's hooks in the lowering. It changes no instruction of a Program: the
Plan's split is applied to the stage modules while codegen/partition.py writes each stage (this package's
`split`, `sequence`, `shapes`, `weight_ops`); the torch target asks it for the split modules' styles."""

from __future__ import annotations

from typing import Any

from codegen.strategies.base import LoweringStrategy
from codegen.strategies.tensor.plan_split import split_stage_graph
from codegen.strategies.tensor.split import TensorSplitResult
from codegen.strategies.tensor.torch_styles import tensor_styles
from codegen.torch_target.records import ModuleStyle
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.vocab import StrategyName


class Tensor(LoweringStrategy):
    """Megatron-style column/row splits over the tensor axis of the mesh."""

    name = StrategyName.TENSOR
    splits_nodes = True

    def active(self, plan: Plan) -> bool:
        return plan.config.tensor > 1

    def split_stage_graph(self, plan: Plan, graph: ModelGraph, inputs: dict[str, Any], rewritten: Any = None,
                          attrs: dict[str, Any] | None = None) -> TensorSplitResult:
        return split_stage_graph(plan, graph, inputs, rewritten, attrs)

    def torch_styles(self, plan: Plan, graph: ModelGraph) -> tuple[tuple[ModuleStyle, ...], int | None]:
        return tensor_styles(plan, graph)


__all__ = ["Tensor"]

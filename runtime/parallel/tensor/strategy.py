"""Tensor parallelism at run time: the stage modules' tensor-parallel layers get the tensor group,
the modules that run on this rank's block of the sequence (sequence parallelism) get their
parameters' gradients all-reduced over it, and the loss of vocabulary-parallel logits knows which
classes this rank holds.

The layers themselves are sharded when the stage modules are built (runtime.materialize with
runtime.parallel.tensor.layers, from the StageSpec's shards); their group exists only once the ranks
are connected.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.comm import Group
from runtime.comm.context import DistContext
from runtime.materialize import TENSOR_GROUP
from runtime.parallel.base import CalibrationCase, ClassSplit, Modules, RuntimeStrategy, Specs
from runtime.parallel.tensor import calibration, layers
from runtime.program import Program
from runtime.program.shards import ModuleShard, ParamShard
from runtime.spec import StageSpec
from runtime.vocab import MeshAxis, ShardRole, StrategyName


def _tensor_group(ctx: DistContext) -> Group | None:
    return ctx.group(MeshAxis.TENSOR) if MeshAxis.TENSOR in ctx.groups else None


def set_tensor_group(module: nn.Module, group) -> None:
    """Give every tensor-parallel module of `module`, and the stage itself, its communication group."""
    setattr(module, TENSOR_GROUP, group)
    for m in module.modules():
        if hasattr(m, "group") and type(m).__module__ == layers.__name__:
            m.group = group


class Tensor(RuntimeStrategy):
    """Megatron-style column/row parallel layers over the tensor axis."""

    name = StrategyName.TENSOR
    axis = MeshAxis.TENSOR
    calibration_key = "tensor_parallel"
    calibration_title = "tensor parallelism besides its all-reduces"

    def calibration_cases(self, loss_shapes: tuple[tuple[int, int], ...]) -> dict[str, list[CalibrationCase]]:
        return calibration.cases(loss_shapes)

    def param_place(self, program: Program) -> tuple[int, int] | None:
        if MeshAxis.TENSOR not in program.mesh_dict:
            return None
        return program.coord(MeshAxis.TENSOR), program.mesh_dict[MeshAxis.TENSOR]

    def attach(self, ctx: DistContext, program: Program, specs: Specs, modules: Modules) -> None:
        group = _tensor_group(ctx)
        for k, module in modules.items():
            set_tensor_group(module, group)
            for sh in specs[k].shards:
                if sh.role == ShardRole.SEQUENCE:
                    layers.sequence_grads(module.get_submodule(sh.path), group)

    def local_module(self, module: nn.Module, shard: ModuleShard, rank: int, num: int) -> nn.Module:
        return layers.shard_module(module, shard, rank, num, None)   # the group comes with attach

    def local_param(self, value: torch.Tensor, shard: ParamShard, rank: int, num: int) -> torch.Tensor:
        local = shard.split.take(value, shard.dim, rank, num)
        if isinstance(value, nn.Parameter):
            local = nn.Parameter(local, requires_grad=value.requires_grad)
            layers.mask_padding(local, shard.dim, shard.split, rank, num)
        return local

    def class_split(self, ctx: DistContext, spec: StageSpec) -> ClassSplit | None:
        """The last stage's vocabulary-parallel logits: this rank holds a slice of the classes
        (StageSpec.output_split)."""
        group = _tensor_group(ctx)
        if not spec.is_last or spec.output_split is None or group is None or group.size == 1:
            return None
        split = spec.output_split
        return (split.contiguous_start(group.rank, group.size), group, len(split.indices(group.rank, group.size)))


__all__ = ["Tensor"]

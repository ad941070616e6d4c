"""This rank's pipeline stages on torch.distributed.pipelining, holding the user's model's own tensors.

The stage classes come from meshplan's partition of the captured graph (codegen/torch_target/
pipeline.py writes them; the torch script defines them in its own source). Each stage module
holds the very modules, parameters and buffers of the user's model that its code reads (attached
under their model paths, not copied), so an optimizer over the stage modules' parameters trains
the model, and parameters compare and save under the model's names.

The loss: torch's schedules call `loss_fn(output, target)` on each micro-batch's output of the
last stage and, by default (scale_grads=True), divide the gradients by the number of
micro-batches after the step: with a loss that is a mean over its micro-batch, the gradients are
those of the mean loss over the rank's batch, as in the single-process run; the step's loss is the
mean of the micro-batch losses. Data parallelism averages over the data ranks on top
(`wrap`: replicate or fully_shard of each stage module over the data axis).

A weight two stages on different pipeline positions read (a tied input embedding and output
layer) is one tensor on each of those ranks; `PipelineRun.step` sums its gradient over them after
the schedule's step, so every copy takes the same optimizer step (the sum is the gradient of the
single-process model, which uses the one tensor in both places).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)
from torch.distributed.tensor import DTensor

from runtime.materialize import CONTEXT, RUN_DEVICE, TENSOR_GROUP, _set_path
from runtime.spec import StageSpec
from runtime.torch_stack.grad_norm import total_norm
from runtime.torch_stack.pipeline_layout import PipelineLayout
from runtime.vocab import Schedule

# one stage per rank: the schedule classes of torch.distributed.pipelining for each plan schedule
_SINGLE = {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B}


class PipelineBuildError(ValueError):
    """The stages cannot be built as asked; the message names the stage, module or number."""


def stage_module(stage_cls: type[nn.Module], spec: StageSpec, model: nn.Module,
                 device: torch.device | str = "cpu") -> nn.Module:
    """An instance of `stage_cls` holding the modules, parameters and buffers of `model` that
    stage `spec.index`'s code reads, the same objects, under their model paths."""
    stage = stage_cls()
    for path in spec.modules:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise PipelineBuildError(f"the model has no module {path!r}, which stage {spec.index}'s code calls; "
                                     "the plan was made for another model") from None
        _set_path(stage, path, module, "module")
    for path in spec.attributes:
        owner, _, name = path.rpartition(".")
        try:
            value = getattr(model.get_submodule(owner) if owner else model, name)
        except AttributeError:
            raise PipelineBuildError(f"the model has no tensor {path!r}, which stage {spec.index}'s code reads; "
                                     "the plan was made for another model") from None
        _set_path(stage, path, value, "parameter" if isinstance(value, nn.Parameter) else "buffer")
    # attributes generated code reads (runtime/materialize.py): no tensor-parallel group, no context chunks
    setattr(stage, RUN_DEVICE, torch.device(device))
    setattr(stage, TENSOR_GROUP, None)
    setattr(stage, CONTEXT, None)
    stage.train(model.training)
    return stage


def _check_unshared(modules: Mapping[int, nn.Module]) -> None:
    """PipelineBuildError when two stages of this rank hold one parameter: torch's schedules
    scale each stage's gradients by 1/micro-batches after the step, so its gradient would be
    scaled twice."""
    owner: dict[int, tuple[int, str]] = {}
    for s in sorted(modules):
        for name, p in modules[s].named_parameters():
            if id(p) in owner and owner[id(p)][0] != s:
                first, first_name = owner[id(p)]
                raise PipelineBuildError(f"stages {first} and {s} both run on this pipeline position and both read "
                                         f"the parameter {first_name} ({name} in stage {s}); place them on "
                                         "different positions (other stage boundaries) or untie the weight")
            owner[id(p)] = (s, name)


@dataclass(frozen=True)
class TiedWeight:
    """A weight stages on several pipeline positions read: its model names, the positions that hold
    it, and the process group of this rank's copies (None where this rank holds none)."""

    names: tuple[str, ...]
    positions: tuple[int, ...]
    group: Any


def tied_weights(layout: PipelineLayout, pipe_group) -> tuple[TiedWeight, ...]:
    """The weights held on several pipeline positions, each with the group of its holders along this
    rank's pipeline axis. Every rank of the pipeline group calls this (it creates the groups:
    members only, in the same order on all)."""
    held: dict[tuple[str, ...], set[int]] = {}
    for stage in layout.stages:
        for grp in stage.spec.shared:
            held.setdefault(tuple(grp), set()).add(stage.position)
    ranks = dist.get_process_group_ranks(pipe_group)
    me = dist.get_rank()
    out = []
    for names in sorted(held):
        pos = tuple(sorted(held[names]))
        if len(pos) < 2:
            continue
        members = [ranks[p] for p in pos]
        group = None
        if me in members:
            group = pipe_group if len(pos) == len(ranks) else dist.new_group(members, use_local_synchronization=True)
        out.append(TiedWeight(names, pos, group))
    return tuple(out)


def make_schedule(stages: Sequence[PipelineStage], schedule: Schedule, num_micro_batches: int,
                  loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]):
    """torch's schedule for `schedule` over this rank's stages (one, or one per chunk under the
    interleaved schedule), with `num_micro_batches` micro-batches per step."""
    schedule = Schedule(schedule)
    if schedule == Schedule.INTERLEAVED:
        return ScheduleInterleaved1F1B(list(stages), num_micro_batches, loss_fn=loss_fn)
    if len(stages) != 1:
        raise PipelineBuildError(f"schedule {schedule.value} runs one stage per pipeline position; this position "
                                 f"holds stages {[s.stage_index for s in stages]}")
    return _SINGLE[schedule](stages[0], num_micro_batches, loss_fn=loss_fn)


@dataclass
class PipelineRun:
    """This rank's part of the pipeline.

    modules: stage index -> its module (holding the model's own tensors; wrapped for data
    parallelism where `wrap` did so); stages: their PipelineStages; schedule: torch's schedule over
    them; ties: the weights shared with other positions; pipe_group: the pipeline axis's process group;
    specs: this rank's stages' specs.
    """

    modules: dict[int, nn.Module]
    stages: list[PipelineStage]
    schedule: Any
    ties: tuple[TiedWeight, ...]
    pipe_group: Any
    specs: tuple[StageSpec, ...]

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names, each once."""
        seen: set[int] = set()
        out = []
        for s in sorted(self.modules):
            for name, p in self.modules[s].named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def state_module(self, model: nn.Module) -> nn.Module:
        """A module holding this rank's stages' parameters and persistent buffers (the same tensors)
        under the names `model` gives them, a tied weight under all of its names: what its state
        dict and a Distributed Checkpoint see, so that a checkpoint of a pipeline plan holds the
        model's names and loads under any other plan (and the other way round)."""
        out = nn.Module()
        persistent = {name for name, _ in model.named_buffers()} - {
            f"{path}.{b}" if path else b for path, m in model.named_modules() for b in m._non_persistent_buffers_set}
        aliases = {name: grp for spec in self.specs for grp in spec.shared for name in grp}
        for s in sorted(self.modules):
            for name, p in self.modules[s].named_parameters(remove_duplicate=False):
                for alias in aliases.get(name, (name,)):
                    _set_path(out, alias, p, "parameter")
            for name, b in self.modules[s].named_buffers():
                if name in persistent:
                    _set_path(out, name, b, "buffer")
        return out

    def step(self, *args, target: torch.Tensor | None = None, losses: list | None = None, **inputs):
        """One training step's forwards and backwards: `schedule.step` with the model's inputs by
        name (the first stage's by position as well), then the tied weights' gradients summed."""
        out = self.schedule.step(*args, target=target, losses=losses, **inputs)
        self.sum_tied_grads()
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, eps: float = 1e-6) -> torch.Tensor:
        """Scale this rank's gradients so that the whole model's gradient norm (over every pipeline
        position, each tied weight counted once) is at most `max_norm` (torch's rule: factor
        max_norm / (norm + eps), clamped to 1); returns the norm before clipping, the same on every rank.
        Call after `step` (the tied weights' gradients summed)."""
        norm_type = float(norm_type)
        params = dict(self.named_parameters())
        me = dist.get_rank(self.pipe_group)
        # a tied weight's copies hold one summed gradient: the first position holding it counts it
        counted_elsewhere = {n for tie in self.ties if tie.positions[0] != me for n in tie.names}
        grads = [p.grad for n, p in params.items() if p.grad is not None and n not in counted_elsewhere]
        # on the stages' device: the pipeline group's backend (NCCL) reduces only tensors there
        part = total_norm(grads, norm_type).reshape(1).to(self.stages[0].device)
        inf = math.isinf(norm_type)
        if not inf:
            part = part.pow(norm_type)
        dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=self.pipe_group)
        norm = part[0] if inf else part[0].pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        for p in params.values():
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.mul_(coef.to(local.device, local.dtype))
        return norm

    def sum_tied_grads(self) -> None:
        """Sum the gradient of every weight held on several positions over its holders."""
        params = dict(self.named_parameters())
        for tie in self.ties:
            if tie.group is None:
                continue
            p = next((params[n] for n in tie.names if n in params), None)
            if p is None:
                raise PipelineBuildError(f"this rank should hold the tied weight {tie.names[0]} but its stages "
                                         f"name none of {list(tie.names)}")
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=tie.group)


def build_pipeline(layout: PipelineLayout, model: nn.Module, classes: Mapping[int, type[nn.Module]], *, pipe_group,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                   wrap: Callable[[nn.Module], None] | None = None, device: torch.device | str = "cpu") -> PipelineRun:
    """This rank's stages of `layout` over `model`, in torch.distributed.pipelining.

    Args:
        layout: the plan's pipeline (codegen.torch_target.pipeline.pipeline_layout).
        model: the user's model, whole on every rank (its tensors are shared, not copied).
        classes: stage index -> stage class, at least for this rank's stages (the layout's source).
        pipe_group: the process group along the pipeline axis (this rank's position is its rank in it).
        loss_fn(output, target): the mean loss of one micro-batch (the last stage's output).
        wrap: applied to each stage module before it becomes a PipelineStage (data parallelism:
            replicate or fully_shard over the data axis, in place).

    Collective over the pipeline group (tied-weight groups are made here). PipelineBuildError for
    stages that cannot be built.
    """
    me = dist.get_rank(pipe_group)
    if dist.get_world_size(pipe_group) != layout.pipeline:
        raise PipelineBuildError(f"the layout's pipeline has {layout.pipeline} positions, the pipeline group "
                                 f"{dist.get_world_size(pipe_group)} ranks; build the mesh from the same plan")
    mine = layout.stages_at(me)
    missing = [s.index for s in mine if s.index not in classes]
    if missing:
        raise PipelineBuildError(f"no class for stage(s) {missing}, which pipeline position {me} runs")
    modules = {s.index: stage_module(classes[s.index], s.spec, model, device) for s in mine}
    _check_unshared(modules)
    ties = tied_weights(layout, pipe_group)
    for s in sorted(modules):
        if wrap is not None:
            wrap(modules[s])
    stages = [PipelineStage(modules[s.index], s.index, layout.num_stages, torch.device(device), group=pipe_group)
              for s in mine]
    return PipelineRun(modules, stages, make_schedule(stages, layout.schedule, layout.num_micro_batches, loss_fn),
                       ties, pipe_group, tuple(s.spec for s in mine))


__all__ = ["PipelineBuildError", "PipelineRun", "TiedWeight", "build_pipeline", "make_schedule", "stage_module",
           "tied_weights"]

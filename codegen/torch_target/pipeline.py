"""`codegen.torch_target.pipeline`: a plan's pipeline as torch.distributed.pipelining runs it.

`pipeline_layout(plan, graph)` cuts the captured graph into stage modules with meshplan's own
partition (codegen/partition.py: it works on captures where torch's tracer front end,
torch.distributed.pipelining.pipeline / SplitPoint, fails) and records, as plain data, what a
rank needs to run them with torch's schedules: the schedule, the micro-batch count, and per
stage (chunk) its pipeline position, the model modules and tensors its code reads, and its
class source. `stage_classes(layout, position)` turns that source into classes; the torch script
writes the same source out instead (`PipelineLayout.source()`). runtime/torch_stack/pipeline.py
(`build_pipeline`) builds this rank's stage modules from the user's model and wraps them in
PipelineStages under the plan's schedule; `rank_pipeline(layout, model, mesh, loss_fn)` does both
for planner.parallelize.

Each stage class has the shape torch's stages call: the previous stage's outputs come
positionally (in the order that stage returns them), and every model input comes by name
(`schedule.step(input_ids=..., target=...)` hands the same keyword inputs to every stage, so
a stage that reads an input of the model, not only the first, gets it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from codegen.partition import PartitionError, StagePart, partition, stage_imports
from codegen.strategies import registry
from planner.capabilities import RuntimeSupport
from planner.graph.model import ModelGraph
from planner.plan import Plan
from runtime.torch_stack.pipeline_layout import PipelineLayout, StageLayout
from runtime.vocab import MeshAxis, Schedule, StrategyName, Target

# runtime.torch_stack.pipeline is imported where a rank builds its pipeline (rank_pipeline): it imports
# torch.distributed.pipelining and DTensor, which cost every meshplan command about 1.4 s at start-up
if TYPE_CHECKING:
    from runtime.torch_stack.pipeline import PipelineRun


class PipelineLayoutError(ValueError):
    """A plan's pipeline that torch.distributed.pipelining cannot run; the message names the numbers."""


def pipeline_layout(plan: Plan, graph: ModelGraph) -> PipelineLayout | None:
    """The pipeline of `plan` over `graph`'s captured model, or None when the plan has one stage.

    Raises PipelineLayoutError for what torch's schedules or this target do not run (the
    bidirectional pipeline, tensor parallelism inside stages, a batch dimension other than 0,
    1F1B with fewer micro-batches than stages), PartitionError where the graph cannot be cut.
    """
    cfg = plan.config
    if cfg.num_stages == 1:
        return None
    place = registry.placement(registry.active(plan))
    if place.name != StrategyName.PIPELINE:   # torch's schedules run one pipeline, one way
        raise PipelineLayoutError(f"the torch target runs one-directional pipelines; the plan's {place.title} "
                                  "runs on meshplan's own runtime: plan for target 'meshplan'")
    why = RuntimeSupport.for_target(Target.TORCH).why_not(cfg)   # tensor splits inside stages, ...
    if why is not None:
        raise PipelineLayoutError(why)
    if graph.batch_dim != 0:
        raise PipelineLayoutError(f"torch's pipeline schedules split the batch on dimension 0; the model's batch "
                                  f"dimension is {graph.batch_dim}")
    m = cfg.micro_batches(plan.global_batch_size)
    schedule = Schedule(cfg.schedule)
    if schedule == Schedule.ONE_F_ONE_B and m < cfg.num_stages:
        # torch's Schedule1F1B refuses this (torch/distributed/pipelining/schedules.py, Schedule1F1B.__init__)
        raise PipelineLayoutError(f"1F1B with {cfg.num_stages} stages needs at least {cfg.num_stages} micro-batches "
                                  f"per step, the plan has {m}; raise the global batch or use schedule 'gpipe'")
    parts = partition(plan, graph)
    inputs = tuple(str(n.target).lstrip("*") for n in graph.module.graph.nodes if n.op == "placeholder")
    stages = tuple(StageLayout(position=p.device_index, spec=p.spec, class_name=f"Pipe{p.class_name}",
                               source=p.source + "\n\n" + _call_shape(p)) for p in parts.stages)
    return PipelineLayout(schedule=schedule, pipeline=cfg.pipeline, virtual_stages=cfg.virtual_stages,
                          num_micro_batches=m, micro_batch_size=cfg.micro_batch_size, inputs=inputs,
                          imports=tuple(stage_imports(list(parts.stages))), stages=stages)


def _call_shape(part: StagePart) -> str:
    """The subclass of the stage's class that torch's schedule calls: received tensors
    positionally, the model's inputs by name, each passed on where the stage's forward takes it."""
    ins = part.spec.inputs
    received = [b.name for b in ins if b.source == "recv"]
    args = [b.name if b.source == "recv" else f"inputs[{b.data_key!r}]" for b in ins]
    params = ", ".join(["self", *received, "**inputs"])
    call = f"super().forward({', '.join(args)})"
    body = f"        return {call}\n" if part.spec.is_last else (
        f"        outputs = {call}\n"
        "        # torch's point-to-point sends take contiguous tensors only\n"
        "        return tuple(t.contiguous() for t in outputs)\n")
    return (f"class Pipe{part.class_name}({part.class_name}):\n"
            f'    """{part.class_name} as torch.distributed.pipelining calls it: the previous stage\'s outputs '
            f'positionally, the model\'s inputs by name."""\n\n'
            f"    def forward({params}):\n" + body)


def stage_classes(layout: PipelineLayout, position: int) -> dict[int, type[nn.Module]]:
    """stage index -> its class, for the stages pipeline position `position` runs (executed from
    the layout's source, as the torch script defines them)."""
    namespace: dict = {"__name__": "meshplan_torch_stages"}
    exec(compile(layout.source(), "<meshplan torch stages>", "exec"), namespace)
    return {s.index: namespace[s.class_name] for s in layout.stages_at(position)}


def rank_pipeline(layout: PipelineLayout, model: nn.Module, mesh, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                  *, wrap: Callable[[nn.Module], None] | None = None,
                  device: torch.device | str = "cpu") -> PipelineRun:
    """This rank's stages of `layout` over the user's `model` (its own tensors), in PipelineStages
    under the plan's schedule: runtime.torch_stack.pipeline.build_pipeline with the stage classes
    of this rank's position on `mesh`'s "pipeline" dimension (a torch DeviceMesh).

    loss_fn(output, target): the mean loss of one micro-batch. wrap(stage_module): data
    parallelism applied to each stage module before it is wrapped (replicate / fully_shard).
    """
    from runtime.torch_stack.pipeline import build_pipeline

    pipe = mesh[MeshAxis.PIPELINE.value]
    classes = stage_classes(layout, pipe.get_local_rank())
    return build_pipeline(layout, model, classes, pipe_group=pipe.get_group(), loss_fn=loss_fn, wrap=wrap,
                          device=device)


__all__ = ["PartitionError", "PipelineLayout", "PipelineLayoutError", "StageLayout", "pipeline_layout",
           "rank_pipeline", "stage_classes"]

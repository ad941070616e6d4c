"""The torch script's `parallelize(model, mesh, device)`: a plan's TorchLayout (codegen/torch_target/layout.py)
written out as explicit torch calls, one per module, so that a reader sees (and may edit) what is applied,
in torchtitan's order: tensor parallelism, tied weights, activation checkpointing, then data parallelism.

    tensor parallelism   parallelize_module(model, mesh["tensor"], {PATH: ColwiseParallel(), ...})
    tied weights         setattr(model.get_submodule(PATH), NAME, model.get_parameter(CANONICAL))
    recompute            checkpoint_wrapper(model.get_submodule(PATH)) in its parent's place
    ZeRO-3 / ZeRO-1,2    fully_shard(model.get_submodule(PATH), mesh=mesh["data"], reshard_after_forward=...)
                         per block, then fully_shard(model, ...)
    plain data parallel  replicate(model, mesh=mesh["data"])          (FSDP2's replicate)

Module paths come from the model: they are written as literals (repr), never as code.
"""

from __future__ import annotations

from dataclasses import dataclass

from codegen.pysrc import py_literal
from codegen.torch_target.layout import ModuleStyle, TorchLayout
from runtime.torch_stack.vocab import DataKind, TensorStyle
from runtime.vocab import RecomputeMode, Schedule


@dataclass(frozen=True)
class ParallelSource:
    """Source lines: the imports its calls need, and the functions (parallelize and the step)."""

    imports: tuple[str, ...]
    functions: list[str]


def parallelize_source(layout: TorchLayout) -> ParallelSource:
    """parallelize(model, mesh, device) -> Runner for `layout`, with the imports its calls need."""
    if layout.pipeline is not None:
        return _pipeline_source(layout)
    imports: list[str] = ["from runtime.torch_stack.grad_norm import clip_grad_norm_, total_norm"]
    body: list[str] = []
    helpers: list[str] = []
    if layout.tensor:
        body += _tensor_lines(layout, imports)
    if layout.ties:
        body += _tie_lines(layout)
    if layout.checkpoint_units:
        body += _checkpoint_lines(layout, imports, helpers)
    body += _data_lines(layout, imports, "model", units=True)
    # FSDP2's replicate and fully_shard reduce gradients after every backward unless told not to:
    # the micro-batches' gradients are summed locally and reduced once, after the last
    sync = [] if layout.data.kind is DataKind.NONE else [
        "        # gradients summed over the micro-batches here, reduced over mesh['data'] once, after the last",
        "        model.set_requires_gradient_sync(k == len(batches) - 1)"]
    functions = [
        *helpers,
        "def parallelize(model, mesh, device):",
        '    """The plan applied to the whole `model` in place; the Runner that trains it on this rank."""',
        *body,
        "    return Runner([model], model, lambda batches: forward_backward(model, batches), holds_loss=True,",
        "                  grad_norm=lambda max_norm: grad_norm(model, max_norm))",
        "",
        "",
        "def forward_backward(model, batches):",
        '    """Forward and backward of this rank\'s micro-batches (each one\'s mean loss scaled by 1/len(batches),',
        '    so that gradients average over the batch); this rank\'s mean loss (a float)."""',
        "    total = 0.0",
        "    for k, (inputs, targets) in enumerate(batches):",
        *sync,
        "        with autocast_for(TRAIN):",
        "            loss = compute_loss(TRAIN.loss, call_model(model, inputs), targets)",
        "        (loss / len(batches)).backward()",
        "        total += float(loss.detach()) / len(batches)",
        "    return total",
        "",
        "",
        "def grad_norm(model, max_norm):",
        '    """The whole model\'s gradient norm before clipping, over every mesh its gradients live on',
        '    (runtime/torch_stack/grad_norm.py); the gradients clipped to max_norm unless it is None."""',
        "    params = list(model.parameters())",
        "    if max_norm is not None:",
        "        return float(clip_grad_norm_(params, max_norm))",
        "    return float(total_norm([p.grad for p in params if p.grad is not None], 2.0))",
        "",
        "",
    ]
    return ParallelSource(tuple(dict.fromkeys(imports)), functions)


def _data_lines(layout: TorchLayout, imports: list[str], module: str, units: bool) -> list[str]:
    """The data-parallel wrapper of `module` (a name in the generated code) over mesh['data']; with
    `units`, fully_shard on each of the layout's units first."""
    if layout.data.kind is DataKind.FULLY_SHARD:
        imports.append("from torch.distributed.fsdp import fully_shard")
        reshard = layout.data.reshard_after_forward
        lines = ["    # " + ("ZeRO-3" if reshard else "ZeRO-2") + " over mesh['data'] (FSDP2): parameters, gradients "
                 "and optimizer state sharded; each unit's",
                 "    # parameters are gathered for its forward and backward, " + (
                     "and freed after its forward" if reshard else "and kept from forward to backward")]
        if units and layout.data.units:
            lines += [f"    for path in {list(layout.data.units)!r}:",
                      f"        fully_shard(model.get_submodule(path), mesh=mesh['data'], reshard_after_forward={reshard!r})"]
        return lines + [f"    fully_shard({module}, mesh=mesh['data'], reshard_after_forward={reshard!r})"]
    if layout.data.kind is DataKind.REPLICATE:
        imports.append("from torch.distributed._composable.replicate_with_fsdp import replicate")
        return ["    # data parallelism over mesh['data']: whole parameters, gradients averaged over the replicas",
                f"    replicate({module}, mesh=mesh['data'])"]
    return []


# torch.distributed.pipelining's schedule class per plan schedule
_SCHEDULES = {Schedule.GPIPE: "ScheduleGPipe", Schedule.ONE_F_ONE_B: "Schedule1F1B",
              Schedule.INTERLEAVED: "ScheduleInterleaved1F1B"}


def _pipeline_source(layout: TorchLayout) -> ParallelSource:
    """A pipeline plan: the stage classes (meshplan's partition of the captured model; each holds the
    model's own modules), this position's stage modules wrapped for the data axis, PipelineStage and
    the plan's schedule, written out; runtime/torch_stack/pipeline.py's PipelineRun steps them."""
    pipe = layout.pipeline
    schedule = _SCHEDULES[pipe.schedule]
    imports = [f"from torch.distributed.pipelining import PipelineStage, {schedule}",
               "from runtime.torch_stack.pipeline import PipelineRun, stage_module, tied_weights",
               "from runtime.torch_stack.pipeline_layout import PipelineLayout",
               *pipe.imports]
    wrap = _data_lines(layout, imports, "module", units=False)
    # the layout as data, less the classes' source (written out above it)
    data = pipe.to_dict()
    data["imports"] = []
    data["stages"] = [{**st, "source": ""} for st in data["stages"]]
    stages = "stages[0]" if pipe.schedule is not Schedule.INTERLEAVED else "stages"
    functions = [
        "# " + "=" * 78,
        f"# the pipeline's {pipe.num_stages} stages: meshplan's partition of the captured model (each calls the",
        "# model's own modules, attached under their paths by stage_module)",
        "# " + "=" * 78,
        "",
        *"\n\n".join(st.source for st in pipe.stages).rstrip().splitlines(),
        "",
        "",
        "# the plan's pipeline as data (stage specs and pipeline positions; the classes' source is above)",
        f"PIPELINE = PipelineLayout.from_dict({py_literal(data)})",
        f"STAGE_CLASSES = {{{', '.join(f'{st.index}: {st.class_name}' for st in pipe.stages)}}}",
        f"INPUTS = {pipe.inputs!r}   # the model's inputs by name, as every stage takes them",
        "",
        "",
        "def parallelize(model, mesh, device):",
        '    """This pipeline position\'s stages of the whole `model` (its own tensors), in PipelineStages under',
        f'    the plan\'s schedule ({pipe.schedule}, {pipe.num_micro_batches} micro-batches); the Runner that trains them."""',
        "    pipe = mesh['pipeline']",
        "    mine = PIPELINE.stages_at(pipe.get_local_rank())",
        "    modules = {}",
        "    for stage in mine:",
        "        module = modules[stage.index] = stage_module(STAGE_CLASSES[stage.index], stage.spec, model, device)",
        *["    " + line for line in wrap],
        f"    stages = [PipelineStage(modules[s.index], s.index, {pipe.num_stages}, device, group=pipe.get_group()) "
        "for s in mine]",
        f"    schedule = {schedule}({stages}, {pipe.num_micro_batches}, loss_fn=micro_batch_loss)",
        "    # weights stages on several positions hold (a tied embedding and head): gradients summed over them",
        "    run = PipelineRun(modules, stages, schedule, tied_weights(PIPELINE, pipe.get_group()), pipe.get_group(),",
        "                      tuple(s.spec for s in mine))",
        "    return Runner(list(modules.values()), run.state_module(model),",
        "                  lambda batches: pipeline_step(run, batches),",
        "                  holds_loss=run.has_last_stage,",
        "                  grad_norm=lambda max_norm: float(run.clip_grad_norm_(math.inf if max_norm is None else max_norm)))",
        "",
        "",
        "def micro_batch_loss(output, target):",
        '    """The mean loss of one micro-batch (the schedule averages the gradients over micro-batches)."""',
        "    return compute_loss(TRAIN.loss, output, target)",
        "",
        "",
        "def pipeline_step(run, batches):",
        '    """One step\'s forwards and backwards through the schedule: this rank\'s micro-batches joined into',
        "    its batch, which the schedule cuts into the same micro-batches again; the mean micro-batch loss",
        '    on the last stage\'s ranks (0.0 elsewhere)."""',
        "    inputs = [b[0] for b in batches]",
        "    if isinstance(inputs[0], dict):",
        "        joined = {k: torch.cat([x[k] for x in inputs]) for k in inputs[0]}",
        "    else:",
        "        joined = {name: torch.cat([x[i] for x in inputs]) for i, name in enumerate(INPUTS)}",
        "    losses = []",
        "    run.step(target=torch.cat([b[1] for b in batches]), losses=losses, **joined)",
        "    return float(torch.stack(losses).mean()) if losses else 0.0",
        "",
        "",
    ]
    return ParallelSource(tuple(dict.fromkeys(["import math", *imports])), functions)


def _tie_lines(layout: TorchLayout) -> list[str]:
    """Every name of a tied parameter a style split set to the split one (a DTensor) again, as
    runtime/torch_stack/tensor.retie does; groups no style touched are still one parameter."""
    styled = {s.path for s in layout.tensor}
    lines = []
    for group in layout.ties:
        source = next((n for n in group if n.rpartition(".")[0] in styled), None)
        for name in group if source is not None else ():
            if name != source:
                path, _, leaf = name.rpartition(".")
                lines.append(f"    setattr(model.get_submodule({path!r}), {leaf!r}, model.get_parameter({source!r}))")
    return ["    # tied weights: one parameter under several names; the styles above split one of them"] + lines \
        if lines else []


def _tensor_lines(layout: TorchLayout, imports: list[str]) -> list[str]:
    """parallelize_module over mesh['tensor'] with one torch style per module path."""
    calls = [(s.path, _style_call(s, layout.sequence_dim)) for s in layout.tensor]
    names = sorted({call.split("(", 1)[0] for _p, call in calls} - {"StridedColwiseParallel"})
    imports.append(f"from torch.distributed.tensor.parallel import {', '.join(names)}, parallelize_module")
    placements = [name for name in ("Replicate", "Shard") if any(f"{name}(" in call for _p, call in calls)]
    if placements:
        imports.append(f"from torch.distributed.tensor import {', '.join(placements)}")
    if TensorStyle.COLWISE_STRIDED in {s.style for s in layout.tensor}:
        imports.append("from runtime.torch_stack.tensor import StridedColwiseParallel")
    head = "    # tensor parallelism over mesh['tensor'] (Megatron's column/row splits"
    head += f"; sequence parallel on dim {layout.sequence_dim})" if layout.sequence_dim is not None else ")"
    return [head, "    parallelize_module(model, mesh['tensor'], {",
            *[f"        {path!r}: {call}," for path, call in calls], "    })"]


def _style_call(style: ModuleStyle, seq: int | None) -> str:
    """The torch ParallelStyle of one module, as source: runtime/torch_stack/tensor.style_of's, with
    torch's defaults left out (the activations between regions: Replicate, or Shard(seq) under
    sequence parallelism)."""
    shard_in = f"input_layouts=Shard({seq})" if seq is not None else ""
    kind = style.style
    if kind is TensorStyle.COLWISE:
        return f"ColwiseParallel({shard_in})"
    if kind is TensorStyle.COLWISE_STRIDED:
        return f"StridedColwiseParallel({style.groups}{', ' + shard_in if shard_in else ''})"
    if kind is TensorStyle.OUTPUT_COLWISE:
        return f"ColwiseParallel({shard_in + ', ' if shard_in else ''}output_layouts=Replicate())"
    if kind is TensorStyle.ROWWISE:
        return f"RowwiseParallel(output_layouts=Shard({seq}))" if seq is not None else "RowwiseParallel()"
    if kind is TensorStyle.EMBEDDING_ROWWISE:
        return "RowwiseParallel(input_layouts=Replicate()" + (f", output_layouts=Shard({seq}))" if seq is not None
                                                              else ")")
    if kind is TensorStyle.SEQUENCE:
        return f"SequenceParallel(sequence_dim={seq}, use_local_output=True)"
    if kind is TensorStyle.SEQUENCE_SCATTER:
        return f"PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard({style.dim}), " \
               "use_local_output=True)"
    return f"PrepareModuleInput(input_layouts=Shard({style.dim}), desired_input_layouts=Replicate(), " \
           "use_local_output=True)"


def _checkpoint_lines(layout: TorchLayout, imports: list[str], helpers: list[str]) -> list[str]:
    """Each checkpoint unit wrapped in checkpoint_wrapper, in its parent's place."""
    imports.append("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper")
    wrap = "checkpoint_wrapper(model.get_submodule(path))"
    if layout.recompute is RecomputeMode.SELECTIVE:
        imports += ["from functools import partial",
                    "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts"]
        helpers += [
            "# selective recompute: keep the matmul outputs, recompute the softmax, norms and elementwise work",
            "KEEP = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,",
            "        torch.ops.aten.baddbmm.default, torch.ops.aten.linear.default)",
            "",
            "",
            "def keep_matmuls(ctx, op, *args, **kwargs):",
            "    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE",
            "",
            "",
        ]
        wrap = ("checkpoint_wrapper(model.get_submodule(path), "
                "context_fn=partial(create_selective_checkpoint_contexts, keep_matmuls))")
    return [f"    # recompute ({layout.recompute}): these blocks' activations are recomputed in backward, not kept",
            f"    for path in {list(layout.checkpoint_units)!r}:",
            "        parent, _, name = path.rpartition('.')",
            f"        model.get_submodule(parent).register_module(name, {wrap})"]

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

from codegen.torch_target.layout import ModuleStyle, TorchLayout
from runtime.torch_stack.vocab import DataKind, TensorStyle
from runtime.vocab import Recompute


@dataclass(frozen=True)
class ParallelSource:
    """Source lines: the imports its calls need, and the functions (parallelize and the step)."""

    imports: tuple[str, ...]
    functions: list[str]


def parallelize_source(layout: TorchLayout) -> ParallelSource:
    """parallelize(model, mesh, device) -> Runner for `layout`, with the imports its calls need."""
    imports: list[str] = []
    body: list[str] = []
    helpers: list[str] = []
    if layout.tensor:
        body += _tensor_lines(layout, imports)
    if layout.ties:
        body += _tie_lines(layout)
    if layout.checkpoint_units:
        body += _checkpoint_lines(layout, imports, helpers)
    if layout.data.kind is DataKind.FULLY_SHARD:
        imports.append("from torch.distributed.fsdp import fully_shard")
        reshard = layout.data.reshard_after_forward
        body += ["    # " + ("ZeRO-3" if reshard else "ZeRO-2") + " over mesh['data'] (FSDP2): parameters, gradients and "
                 "optimizer state sharded; each block's",
                 "    # parameters are gathered for its forward and backward, " + (
                     "and freed after its forward" if reshard else "and kept from forward to backward"),
                 f"    for path in {list(layout.data.units)!r}:",
                 f"        fully_shard(model.get_submodule(path), mesh=mesh['data'], reshard_after_forward={reshard!r})",
                 f"    fully_shard(model, mesh=mesh['data'], reshard_after_forward={reshard!r})"]
    elif layout.data.kind is DataKind.REPLICATE:
        imports.append("from torch.distributed._composable.replicate_with_fsdp import replicate")
        body += ["    # data parallelism over mesh['data']: whole parameters, gradients averaged over the replicas",
                 "    replicate(model, mesh=mesh['data'])"]
    functions = [
        *helpers,
        "def parallelize(model, mesh, device):",
        '    """The plan applied to the whole `model` in place; the Runner that trains it on this rank."""',
        *body,
        "    return Runner([model], lambda batches: forward_backward(model, batches), holds_loss=True)",
        "",
        "",
        "def forward_backward(model, batches):",
        '    """Forward and backward of this rank\'s micro-batches (each one\'s mean loss scaled by 1/len(batches),',
        '    so that gradients average over the batch); this rank\'s mean loss (a float)."""',
        "    total = 0.0",
        "    for inputs, targets in batches:",
        "        with autocast_for(TRAIN):",
        "            loss = compute_loss(TRAIN.loss, call_model(model, inputs), targets)",
        "        (loss / len(batches)).backward()",
        "        total += float(loss.detach()) / len(batches)",
        "    return total",
        "",
        "",
    ]
    return ParallelSource(tuple(dict.fromkeys(imports)), functions)


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
    if layout.recompute is Recompute.SELECTIVE:
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

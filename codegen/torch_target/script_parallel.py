"""The torch script's `parallelize(model, mesh, device)`: a plan's TorchLayout written out as explicit
torch calls, one per module, so that a reader sees (and may edit) exactly what is applied.

    tensor parallelism   parallelize_module(model.get_submodule(PATH), mesh["tensor"], {NAME: ColwiseParallel(), ...})
    recompute            checkpoint(model.get_submodule(PATH))           (torch.distributed._composable)
    ZeRO-3 / ZeRO-2      fully_shard(model.get_submodule(PATH), mesh=..., reshard_after_forward=...)
    plain data parallel  replicate(model, device_mesh=mesh["data"])

Module paths come from the model: they are written as literals (repr), never as code.
"""

from __future__ import annotations

from dataclasses import dataclass

from codegen.torch_target.layout import TorchLayout


@dataclass(frozen=True)
class ParallelSource:
    """Source lines: torch imports, runtime imports, and the functions (parallelize and the step)."""

    imports: tuple[str, ...]
    runtime_imports: tuple[str, ...]
    functions: list[str]


def parallelize_source(layout: TorchLayout) -> ParallelSource:
    """parallelize(model, mesh, device) -> Runner for `layout`, with the imports its calls need."""
    imports: list[str] = []
    body: list[str] = []
    if layout.tensor:
        styles = sorted({style for _path, style in layout.tensor})
        imports.append(f"from torch.distributed.tensor.parallel import {', '.join(styles)}, parallelize_module")
        body += ["    # tensor parallelism over mesh['tensor']: each Linear split by columns or rows (Megatron)",
                 "    parallelize_module(model, mesh['tensor'], {"]
        body += [f"        {path!r}: {style}()," for path, style in layout.tensor]
        body += ["    })"]
    if layout.checkpoint:
        imports.append("from torch.distributed._composable import checkpoint")
        body += ["    # activation checkpointing: these modules' activations are recomputed in backward"]
        body += [f"    checkpoint(model.get_submodule({path!r}))" for path in layout.checkpoint]
    data_mesh = "mesh['data']"
    if layout.data == "fully_shard":
        imports.append("from torch.distributed.fsdp import fully_shard")
        zero = 3 if layout.reshard_after_forward else 2
        body += [f"    # ZeRO-{zero} over mesh['data']: parameters, gradients and optimizer state sharded per unit "
                 "(FSDP2); each unit's",
                 "    # parameters are gathered for its forward and backward"
                 + (", and freed after its forward" if layout.reshard_after_forward else
                    ", and kept from forward to backward"),
                 f"    reshard = {layout.reshard_after_forward!r}"]
        body += [f"    fully_shard(model.get_submodule({path!r}), mesh={data_mesh}, reshard_after_forward=reshard)"
                 for path in layout.shard_units]
        body += [f"    fully_shard(model, mesh={data_mesh}, reshard_after_forward=reshard)"]
    elif layout.data == "replicate":
        imports.append("from torch.distributed._composable import replicate")
        body += ["    # data parallelism over mesh['data']: gradients averaged across the replicas in backward (DDP)",
                 f"    replicate(model, device_mesh={data_mesh})"]
    functions = [
        "def parallelize(model, mesh, device):",
        '    """The plan applied to the whole `model` in place; the Runner that trains it on this rank."""',
        *body,
        "    return Runner([model], lambda batches: forward_backward(model, batches), holds_loss=True)",
        "",
        "",
        "def forward_backward(model, batches):",
        '    """Forward and backward of this rank\'s micro-batches (each one\'s mean loss scaled by 1/len(batches),',
        "    so that gradients average over the batch); this rank's mean loss (a float).\"\"\"",
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
    return ParallelSource(tuple(imports), ("from runtime.torch_script import Runner",), functions)

"""Activation checkpointing of a layout's blocks.

"full": each block runs under torch.utils.checkpoint (non-reentrant, via checkpoint_wrapper): only its
input is kept, its forward runs again in backward. "selective": the same blocks under a selective
checkpoint policy (torch.utils.checkpoint.create_selective_checkpoint_contexts) that keeps the outputs of
the matrix products and recomputes everything else (softmax, norms, activations, elementwise work),
the closest torch offers to Megatron's selective recompute (Korthikanti et al. 2022, section 5), which
recomputes attention's softmax and dropout and keeps the GEMM outputs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from runtime.vocab import RecomputeMode

# the matrix products whose outputs selective recompute keeps (nn.Linear reaches the policy as mm/addmm)
_KEPT = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.baddbmm.default)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def apply_recompute(model: nn.Module, layout: dict) -> nn.Module:
    """Wrap every module of the layout's `checkpoint_units` (in place) as its `recompute` says."""
    kind = RecomputeMode(layout["recompute"])
    if kind is RecomputeMode.NONE:
        return model
    extra = {} if kind is RecomputeMode.FULL else {"context_fn": _selective_contexts}
    wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
    for path in layout["checkpoint_units"]:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        parent.register_module(name, wrap(parent.get_submodule(name)))
    return model

"""Losses a build can name, computed on the last pipeline stage.

Every loss is a mean over all elements of the micro-batch, so that the
average of equal-sized micro-batch losses is the loss of the whole batch.

  cross_entropy: logits (..., C) with integer targets (...), or (N, C, d1, ...) with
                 targets (N, d1, ...); with class-split (vocabulary-parallel) logits, each rank
                 of a group holding a block of the classes, it runs without gathering them
                 (vocab_parallel_cross_entropy: max, target-logit and sum-exp all-reduces).
  mse:           mean squared error, output and targets of one shape.

`compiled_loss(name, backend)` is the same loss through torch.compile (Execution.loss "compiled"):
on whole logits the upcast, the log-softmax and the target's gather fuse into reductions that read
the 16-bit logits as they are, and the backward's softmax-minus-onehot is written straight in the
logits' dtype. What it keeps from forward to backward is the logits themselves and two fp32 values
a row (the row's max and log-sum-exp), where the eager loss keeps fp32 log-probabilities and in
backward holds two more fp32 tensors of the logits' size. Same values within fp32 rounding.
`compiled_forward_loss` compiles a last stage's whole forward and that loss as one graph (compile scope
"stage").
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.comm import Group

LOSSES = ("cross_entropy", "mse")


class LossError(ValueError):
    """A loss name or output/target pair the runtime cannot use."""


def known_loss(name: str) -> str:
    """`name` when it is one of LOSSES; LossError listing them otherwise."""
    if name not in LOSSES:
        raise LossError(f"unknown loss {name!r}; known: {', '.join(LOSSES)}")
    return name


def output_item(out, kind: type):
    """The item of a model's output structure that the loss reads, if it is a `kind` (a tensor at run
    time, an fx node in a graph's output): the output itself, the first of a tuple, or a dict's
    "logits"; else None."""
    if isinstance(out, kind):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], kind):
        return out[0]
    if isinstance(out, dict) and isinstance(out.get("logits"), kind):
        return out["logits"]
    return None


def model_output(out):
    """The tensor the loss reads: the output itself, the first of a tuple, or a dict's "logits"."""
    item = output_item(out, torch.Tensor)
    if item is not None:
        return item
    raise LossError(f"the model's output is a {type(out).__name__}; the loss needs a tensor, "
                    "a tuple whose first item is one, or a dict with 'logits'")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """16-bit logits in float32 (the loss is summed over many elements); wider ones as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def compute_loss(name: str, output, targets: torch.Tensor, *,
                 class_split: tuple[int, Group, int] | None = None) -> torch.Tensor:
    """Mean loss (a 0-dim tensor).

    class_split: (first class index held here, tensor group, how many of the classes held
    here are real) when the output's last dimension is split over the tensor axis
    (vocabulary-parallel logits; the classes past the real ones pad the vocabulary).
    """
    out = model_output(output)
    if name == "cross_entropy":
        if class_split is not None:
            if tuple(out.shape[:-1]) != tuple(targets.shape):
                raise LossError(f"vocabulary-parallel cross-entropy needs logits (..., C) and targets (...), "
                                f"got {tuple(out.shape)} and {tuple(targets.shape)}")
            start, group, valid = class_split
            return vocab_parallel_cross_entropy(out, targets, start, group, valid).mean()
        if tuple(out.shape[:-1]) == tuple(targets.shape):
            return F.cross_entropy(_wide(out.reshape(-1, out.shape[-1])), targets.reshape(-1))
        return F.cross_entropy(_wide(out), targets)
    if name == "mse":
        if class_split is not None:
            raise LossError("mse cannot read an output split over the tensor axis; the planner must "
                            "not split the last op for an mse model")
        return F.mse_loss(_wide(out), targets.to(_wide(out).dtype))
    raise LossError(f"unknown loss {name!r}; known: {', '.join(LOSSES)}")


def _whole_loss(name: str, out: torch.Tensor, targets: torch.Tensor, classes: int | None = None) -> torch.Tensor:
    if classes is not None:
        out = out.narrow(-1, 0, classes)
    return compute_loss(name, out, targets)


def compiled_loss(name: str, backend: str) -> Callable[..., torch.Tensor]:
    """fn(logits, targets, classes=None) -> compute_loss(name, logits[..., :classes], targets), compiled by
    torch.compile with `backend` (runtime/execution.py CompileBackend) at static shapes (a micro-batch's
    shape never changes in a run, so it compiles once; held-out evaluation, which runs without gradients,
    stays eager). Logits whole on this rank: the vocabulary-parallel loss (class_split) is not compiled
    (codegen refuses the option there).

    `classes`: the real classes of padded logits (Execution.vocab_multiple), given the whole padded tensor
    (`padded_base`): the narrow to them and its gradient's zero padding then fuse into the loss's kernels,
    where narrowing outside would cost a strided read and, in backward, a zero-filled padded gradient and
    a copy into it."""
    known_loss(name)
    return torch.compile(functools.partial(_whole_loss, name), dynamic=False, backend=backend)


def _forward_and_loss(forward, loss, targets: torch.Tensor, *inputs) -> torch.Tensor:
    # reads no global: compiled_forward_loss gives this code the stage module's globals (see there)
    return loss(forward(*inputs), targets)


def compiled_forward_loss(module, name: str, backend: str) -> Callable[..., torch.Tensor]:
    """fn(targets, *inputs) -> compute_loss(name, module.forward(*inputs), targets): the last stage's whole
    forward and its loss through torch.compile with `backend`, as one graph (static shapes), where the stage's
    forward is compiled whole (Execution compile scope "stage") and the loss is compiled too.

    One graph instead of two: torch.compile plans the output layer's GEMM, a padded vocabulary's narrow and
    the loss's reductions together (what it keeps for backward and what it fuses), and each micro-batch
    crosses one compiled region's guards and autograd wrapper instead of two (benchmarks/eager_ratio.py
    --compile-scope stage --loss-impl compiled measures it against the loops). `module`'s hooks are not run
    (the generated stages have none)."""
    known_loss(name)
    # the class's forward bound to `module`: the instance's own may be compile_stage's compiled wrapper of it
    forward = type(module).forward.__get__(module)
    # The compiled function's globals are the stage module's own: dynamo reaches an inlined function's
    # globals by importing its module by name unless they are the compiled frame's, and a build's rank
    # script runs under a name no import finds (runpy, codegen/emit.py).
    # (a function, not a partial: dynamo runs a partial from a frame of its own).
    joint = torch.compile(types.FunctionType(_forward_and_loss.__code__, forward.__func__.__globals__,
                                             "forward_and_loss"), dynamic=False, backend=backend)
    loss = functools.partial(compute_loss, name)
    return lambda targets, *inputs: joint(forward, loss, targets, *inputs)


def padded_base(logits: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor of which `logits` is the first classes along the last dimension (a padded
    vocabulary's logits: codegen/head.py narrow_logits), as a view (..., padded classes) of the storage's
    owner; None when `logits` is not such a view.

    The owner, not the narrowed tensor's parent: a linear layer's 3-d output is itself a view of its 2-d
    GEMM output, and `Tensor._base` names that root. It qualifies when it is contiguous, starts where
    `logits` does and holds exactly rows x padded classes, and `logits`'s strides are those of its rows
    over padded classes: then `logits` is that view narrowed, element for element, and the loss of the view
    narrowed inside the compiled function has the same value and the same gradient for the owner."""
    base = logits._base
    if base is None or logits.dim() < 2 or logits.stride(-1) != 1 or not base.is_contiguous() \
            or base.storage_offset() != logits.storage_offset():
        return None
    width = logits.stride(-2)
    shape = tuple(logits.shape[:-1]) + (width,)
    # the strides of rows over padded classes, laid out contiguously (computed: this runs every micro-batch)
    rows = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
    if width <= logits.shape[-1] or base.numel() != math.prod(shape) or tuple(logits.stride()) != rows:
        return None
    return base.view(shape)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, group, valid):
        # logits (N, V/t) this rank's classes [start, start + V/t), the first `valid` of them
        # real (the rest pad a vocabulary t does not divide); target (N,) global ids
        logits = logits.float()
        if valid < logits.shape[-1]:
            logits = logits.clone()
            logits[:, valid:] = torch.finfo(logits.dtype).min
        vmax = logits.max(dim=-1).values
        group.all_reduce(vmax, op="max")
        shifted = logits - vmax.unsqueeze(-1)
        n = logits.shape[-1]
        outside = (target < start) | (target >= start + n)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        group.all_reduce(picked)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        group.all_reduce(sum_exp)
        loss = sum_exp.log() - picked
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 group: Group, valid: int | None = None) -> torch.Tensor:
    """Per-element cross-entropy of class-split logits (..., V/t) against global targets (...).

    valid: how many of this rank's classes are real (the rest pad the vocabulary); all if None.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    n = flat.shape[-1] if valid is None else int(valid)
    loss = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), int(start), group, n)
    return loss.reshape(target.shape)

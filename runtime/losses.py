"""Losses a build can name, computed on the last pipeline stage.

Every loss is a mean over all elements of the micro-batch, so that the
average of equal-sized micro-batch losses is the loss of the whole batch.

  cross_entropy: logits (..., C) with integer targets (...), or (N, C, d1, ...) with
                 targets (N, d1, ...); with class-split (vocabulary-parallel) logits
                 the tensor-parallel loss runs without gathering them.
  mse:           mean squared error, output and targets of one shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.comm import Group
from runtime.parallel.tensor.layers import vocab_parallel_cross_entropy

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

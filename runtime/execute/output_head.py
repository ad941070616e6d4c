"""The model's output layer on the last stage, and the loss fused with it (Execution.loss "chunked").

When the model's output is the output of a final linear layer (a language model's lm_head; Hugging
Face GPT-2's, tied to the token embedding) and the loss is cross_entropy, the code generator makes
the last stage return that layer's input, the hidden state (..., C), instead of the logits (..., V),
and records the layer as the stage's `OutputHead`. The runner then computes the loss from the hidden
state and the layer's (V_local, C) weight with runtime.execute.chunked_loss, chunk by chunk of tokens: the
(tokens x V) logits and their fp32 copies never exist.

Vocabulary parallelism (tensor >= 2, the layer's rows split over the tensor ranks): this rank holds
the classes [start, start + V_local) of which `valid` are real (the tensor strategy's class split);
chunked_cross_entropy all-reduces the hidden state's gradient itself, so the hidden state is passed
as every rank holds it (under sequence parallelism gathered whole first, `gather_whole`).

A padded vocabulary (Execution.vocab_multiple) at tensor degree 1 pads the weight's rows from V to
V_pad; the loss reads the first V (vocab_valid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.execute.chunked_loss import chunked_cross_entropy, chunked_eval
from runtime.losses import model_output
from runtime.comm.autograd import gather_whole


@dataclass(frozen=True)
class OutputHead:
    """The last stage's output layer: logits = hidden @ weight.T + bias.

    weight / bias: the stage module's names of its (V_local, C) weight and (V_local,) bias (bias None:
        the layer has none).
    vocab: the real vocabulary V (the logits' last dimension as the model gives them).
    fused: the stage returns the hidden state in the logits' place and the loss is fused with the
        layer (chunked); False: the stage returns the logits.
    sequence_dim: under sequence parallelism, the dimension along which the returned hidden state
        holds this rank's block of the sequence (gathered whole for the loss), else None.
    """

    weight: str
    vocab: int
    bias: str | None = None
    fused: bool = False
    sequence_dim: int | None = None

    def to_dict(self) -> dict:
        return {"weight": self.weight, "bias": self.bias, "vocab": self.vocab, "fused": self.fused,
                "sequence_dim": self.sequence_dim}

    @classmethod
    def from_dict(cls, d: dict) -> "OutputHead":
        dim = d.get("sequence_dim")
        return cls(str(d["weight"]), int(d["vocab"]), None if d.get("bias") is None else str(d["bias"]),
                   bool(d.get("fused", False)), None if dim is None else int(dim))


def _tensors(head: OutputHead, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = module.get_parameter(head.weight)
    bias = module.get_parameter(head.bias) if head.bias is not None else None
    return weight, bias


def _arguments(head: OutputHead, module: nn.Module, output, class_split) -> tuple[torch.Tensor, dict]:
    """(hidden (..., C), chunked_cross_entropy's keyword arguments) for the stage output `output`."""
    hidden = model_output(output)
    weight, bias = _tensors(head, module)
    if class_split is not None:   # vocabulary-parallel: (first class here, tensor group, real classes here)
        start, group, valid = class_split
        if head.sequence_dim is not None:
            hidden = gather_whole(hidden, head.sequence_dim, group)
    else:
        start, group, valid = 0, None, min(head.vocab, weight.shape[0])
    return hidden, {"weight": weight, "bias": bias, "vocab_start": start, "vocab_valid": valid, "group": group}


def fused_loss(head: OutputHead, module: nn.Module, output, targets: torch.Tensor, *, class_split=None,
               chunk_tokens: int = 0) -> torch.Tensor:
    """The mean cross-entropy (0-dim fp32) of the stage's output layer applied to the hidden state in
    `output` (the stage's return value), against integer `targets` (...); chunk_tokens: tokens per
    chunk (0: runtime.execute.chunked_loss's rule)."""
    hidden, kw = _arguments(head, module, output, class_split)
    weight = kw.pop("weight")
    return chunked_cross_entropy(hidden, weight, targets, chunk_tokens=chunk_tokens, **kw)


def fused_eval(head: OutputHead, module: nn.Module, output, targets: torch.Tensor, *, class_split=None,
               chunk_tokens: int = 0) -> tuple[torch.Tensor, int, int]:
    """Without gradients: (mean loss, correct argmax predictions, targets counted) as fused_loss reads
    them (runtime.execute.chunked_loss.chunked_eval)."""
    hidden, kw = _arguments(head, module, output, class_split)
    weight = kw.pop("weight")
    return chunked_eval(hidden, weight, targets, chunk_tokens=chunk_tokens, **kw)


__all__ = ["OutputHead", "fused_eval", "fused_loss"]

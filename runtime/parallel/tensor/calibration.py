"""What tensor parallelism's runtime adds besides its all-reduces, as cases for the calibration to time
(cost_models/calibration/stage.py time_strategy_extras; the Tensor strategy's `calibration_cases`):

  wrapper          a column- then a row-parallel Linear against the same two linears unwrapped (per = 2: one
                   figure per in-layer all-reduce). Each wraps its layer in an autograd function (forward: the
                   function call, the row layer's copy of its output and its separate bias add; backward: a
                   Python backward, the column layer's copy of its gradient); elements: the layer's output.
  vocab_embedding  a vocabulary-parallel embedding (masking the ids outside its rows, zeroing their outputs,
                   the all-reduce's wrapper) against nn.Embedding; elements: its output.
  vocab_loss       runtime.losses.compute_loss with a class split (max, shifted exponentials, picked target
                   logits, each for an all-reduce) against the plain cross-entropy on the same logits;
                   elements: this rank's logits.

The group is one of two ranks whose collectives do nothing: what remains is the wrappers' own cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.losses import compute_loss
from runtime.parallel.base import CalibrationCase
from runtime.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

# (rows, features) of the wrapper and embedding cases: the elements a wrapper copies and adds (a layer's
# output, 192 and 24,576 of them) and the embedding's output. Two sizes give a fixed part and a part per element.
SHAPES = ((2, 96), (128, 192))
VOCAB = 512                  # rows of the reference embedding table (half on each of the two ranks)


class _NoCommGroup:
    """A two-rank tensor group whose collectives do nothing: what remains is the wrappers' own cost."""

    size, rank, ranks = 2, 0, (0, 1)

    def all_reduce(self, tensor, op="sum", async_op=False):
        return None


def cases(loss_shapes: tuple[tuple[int, int], ...]) -> dict[str, list[CalibrationCase]]:
    """{part: [(elements, split call, plain call, per), ...]} at SHAPES and, for the loss, `loss_shapes`
    ((rows, classes) of the logits); each call returns what backward starts from."""
    group = _NoCommGroup()
    out: dict[str, list[CalibrationCase]] = {"wrapper": [], "vocab_embedding": [], "vocab_loss": []}
    for rows, width in SHAPES:
        half = width // 2
        w1, b1, w2, b2 = torch.randn(half, width), torch.randn(half), torch.randn(width, half), torch.randn(width)
        col, row = ColumnParallelLinear(w1, b1, group), RowParallelLinear(w2, b2, group)
        plain = [torch.nn.Parameter(t.clone()) for t in (w1, b1, w2, b2)]
        x = torch.randn(rows, width, requires_grad=True)
        out["wrapper"].append((rows * width, lambda col=col, row=row, x=x: row(torch.relu(col(x))),
                               lambda p=plain, x=x: F.linear(torch.relu(F.linear(x, p[0], p[1])), p[2], p[3]), 2))
        ids = torch.randint(0, VOCAB, (rows,))
        split = VocabParallelEmbedding(torch.randn(VOCAB // 2, width), 0, group)
        table = torch.nn.Embedding(VOCAB, width)
        out["vocab_embedding"].append((rows * width, lambda s=split, i=ids: s(i), lambda t=table, i=ids: t(i), 1))
    for rows, classes in loss_shapes:
        logits = torch.randn(rows, classes, requires_grad=True)
        targets = torch.randint(0, 2 * classes, (rows,))
        local = targets % classes
        out["vocab_loss"].append((rows * classes,
                                  lambda z=logits, y=targets, c=classes: compute_loss(
                                      "cross_entropy", z, y, class_split=(0, group, c)),
                                  lambda z=logits, y=local: compute_loss("cross_entropy", z, y), 1))
    return out


__all__ = ["cases"]

"""ATen ops that read their weight directly (torch.export graphs): their input, weight, bias and feature dimensions.

An fx capture keeps nn.Linear whole (a call_module node). A torch.export capture has
`linear(x, W, b)`, `addmm(b, x, W)` (Hugging Face's Conv1D), `mm(x, W)`,
`convolution(x, W, b, ...)` and `embedding(W, ids)`, with W read by a get_attr node.
`weight_op` reads such a node: its activation input, weight and bias, and which dimension of
the weight holds the output and the input features. The tensor split analysis
(planner/strategies/tensor/split/rules.py) decides how those weights are split;
codegen/strategies/tensor/weight_ops.py rewrites the ops; codegen/head.py finds the output layer with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from planner.graph.ops import op_base

_CONV = ("conv1d", "conv2d", "conv3d", "convolution")


@dataclass(frozen=True)
class WeightOp:
    """An ATen op with a weight read by get_attr.

    kind: linear, addmm, mm, conv or embedding. x: the activation input (the ids of an
    embedding). out_dim / in_dim: the weight's dimensions of output / input features.
    feature_dim: the dimension of the op's input and output that holds the features.
    """

    kind: str
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    out_dim: int
    in_dim: int
    feature_dim: int


def _attr(a) -> fx.Node | None:
    return a if isinstance(a, fx.Node) and a.op == "get_attr" else None


def weight_op(n: fx.Node) -> WeightOp | None:
    """The WeightOp `n` is, or None (not one of the ops above, or its weight is not a get_attr)."""
    if n.op != "call_function":
        return None
    base, args = op_base(n.target), n.args
    if base == "linear" and len(args) >= 2 and _attr(args[1]):
        bias = _attr(args[2]) if len(args) > 2 else _attr(n.kwargs.get("bias"))
        return WeightOp("linear", args[0], args[1], bias, 0, 1, -1)
    if base == "addmm" and len(args) >= 3 and _attr(args[2]) and not n.kwargs:
        return WeightOp("addmm", args[1], args[2], _attr(args[0]), 1, 0, -1)
    if base in ("mm", "matmul") and len(args) == 2 and _attr(args[1]):
        return WeightOp("mm", args[0], args[1], None, 1, 0, -1)
    if base in _CONV and len(args) >= 2 and _attr(args[1]):
        groups = args[-1] if base == "convolution" else (args[6] if len(args) > 6 else 1)
        transposed = base == "convolution" and len(args) > 6 and args[6]
        if groups != 1 or transposed:
            return None
        return WeightOp("conv", args[0], args[1], _attr(args[2]) if len(args) > 2 else None, 0, 1, 1)
    if base == "embedding" and len(args) >= 2 and _attr(args[0]):
        return WeightOp("embedding", args[1], args[0], None, 0, 1, -1)
    return None

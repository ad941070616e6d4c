"""Tensor parallelism for ATen ops that read their weight directly (torch.export graphs).

An fx capture keeps nn.Linear whole: a call_module node the runtime swaps for a
ColumnParallelLinear. A torch.export capture has `linear(x, W, b)`, `addmm(b, x, W)`
(Hugging Face's Conv1D), `mm(x, W)`, `convolution(x, W, b, ...)` and `embedding(W, ids)`,
with W read by a get_attr node. `planner/graph/weight_op.py` reads such a node and
the planner decides how its weight is split; `rewrite` here changes the graph as the module
swap would: a column op reads its input through copy_to_group (one per input, shared by the
columns that read it, so backward all-reduces that input's gradient once, as for Megatron's
fused qkv), a row op drops its bias, all-reduces its partial output (reduce_from_group) and
adds the bias once, and a vocabulary-split embedding becomes vocab_parallel_embedding. The
weights themselves are split by runtime.program.shards.ParamShard.

Under sequence parallelism (`sequence`, planner/strategies/tensor/split/sequence.py) a column op whose input
is split along the sequence all-gathers it (gather_sequence) instead, a row op and a vocabulary
embedding that begin the split stream reduce-scatter their output along it
(reduce_scatter_sequence, and vocab_parallel_embedding's sequence_dim).

The generated code passes the stage module's `tensor_group` attribute (runtime.materialize
sets it when the process groups exist) to those functions.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from planner.graph.weight_op import weight_op
from planner.strategies.tensor.split.sequence import SEQUENCE_DIM
from planner.strategies.tensor.split.splits import SequenceSplit
from runtime.materialize import TENSOR_GROUP
from runtime.comm.autograd import copy_to_group, gather_sequence, reduce_from_group, reduce_scatter_sequence
from runtime.program.shards import FeatureSplit
from runtime.parallel.tensor.layers import scatter_to_group, vocab_parallel_embedding


def rewrite_weight_ops(graph: fx.Graph, columns: list[str], rows: list[str], vocabs: list[str],
            scatters: list[tuple[str, str, int, FeatureSplit]] = (), sequence: SequenceSplit | None = None) -> None:
    """Insert the tensor-parallel communication around the named nodes of `graph`, in place.

    scatters: (node, replicated input, dimension, split): `node` reads this rank's part of
    the input instead (scatter_to_group), one cut per input and split however many read it.
    sequence: the sequence split (see module docstring), or None.
    """
    gathered = set(sequence.columns) if sequence else set()
    scattered = set(sequence.starts) if sequence else set()
    nodes = {n.name: n for n in graph.nodes}
    if not (columns or rows or vocabs or scatters):
        return
    first = next(iter(graph.nodes))
    with graph.inserting_before(first):
        group = graph.get_attr(TENSOR_GROUP)
    copies: dict[str, fx.Node] = {}
    for name in columns:
        n = nodes[name]
        op = weight_op(n)
        x = op.x
        if x.name not in copies:
            with graph.inserting_after(x):
                call = (gather_sequence, (x, SEQUENCE_DIM, group)) if name in gathered else (copy_to_group, (x, group))
                copies[x.name] = _like(graph.call_function(*call), n)
        n.replace_input_with(x, copies[x.name])
    for name in rows:
        n = nodes[name]
        op = weight_op(n)
        users = list(n.users)
        if op.kind == "linear":
            n.args, n.kwargs = (op.x, op.weight), {}
        elif op.kind == "addmm":
            n.target, n.args = torch.ops.aten.mm.default, (op.x, op.weight)
        elif op.kind == "conv":
            n.args = (n.args[0], n.args[1], None, *n.args[3:])
        with graph.inserting_after(n):
            call = (reduce_scatter_sequence, (n, SEQUENCE_DIM, group)) if name in scattered \
                else (reduce_from_group, (n, group))
            total = _like(graph.call_function(*call), n)
        out = total
        if op.bias is not None:
            bias = op.bias
            if name in scattered:   # it meets this rank's tokens only: its gradient is all-reduced
                with graph.inserting_after(total):
                    bias = _like(graph.call_function(copy_to_group, (op.bias, group)), n)
            with graph.inserting_after(bias if bias is not op.bias else total):
                if op.kind == "conv":
                    spatial = len(n.meta["val"].shape) - 2 if "val" in n.meta else 2
                    bias = _like(graph.call_function(torch.ops.aten.view.default, (op.bias, [-1] + [1] * spatial)), n)
            with graph.inserting_after(bias if bias is not op.bias else total):
                out = _like(graph.call_function(torch.ops.aten.add.Tensor, (total, bias)), n)
        for u in users:
            u.replace_input_with(n, out)
    cuts: dict[tuple, fx.Node] = {}
    for name, x_name, dim, split in scatters:
        n, x = nodes[name], nodes[x_name]
        key = (x_name, dim, split)
        if key not in cuts:
            with graph.inserting_after(x):
                cuts[key] = _like(graph.call_function(
                    scatter_to_group, (x, dim, split.factors, split.split, group)), n)
        n.replace_input_with(x, cuts[key])
    for name in vocabs:
        n = nodes[name]
        op = weight_op(n)
        pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1)
        n.target, n.args, n.kwargs = vocab_parallel_embedding, (op.x, op.weight, group), {}
        if pad is not None and pad >= 0:
            n.kwargs = {"padding_idx": pad}
        if name in scattered:
            n.kwargs = {**n.kwargs, "sequence_dim": SEQUENCE_DIM}


def _like(new: fx.Node, model: fx.Node) -> fx.Node:
    """`new` with the module path and source line of `model` (for the generated code's comments)."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in model.meta:
            new.meta[key] = model.meta[key]
    return new

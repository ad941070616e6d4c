"""Sequence parallelism on the fx graph, applied (the planner decided where:
planner/strategies/tensor/split/sequence.py, stored in the Plan as `TensorSplits.sequence`).

codegen/strategies/tensor/weight_ops.py changes the split ops themselves (a column gathers its input along the
sequence, a row op reduce-scatters its output) and cuts the replicated tensors that meet the split
stream (GPT's position embeddings); here the rest is inserted: a split value that an op reads whole
is gathered first (gather_whole: each rank keeps its block of the gradient), and a parameter read
directly (get_attr) by an op on split tokens, such as a norm's weight in an ATen graph, is read
through copy_to_group, so that its gradient, a sum over this rank's tokens only, is all-reduced.
A module kept whole that runs on split tokens (nn.LayerNorm) gets the same from
runtime/parallel/tensor/strategy.py.
"""

from __future__ import annotations

import torch.fx as fx

from codegen.strategies.tensor.weight_ops import _like
from planner.strategies.tensor.split.sequence import SEQUENCE_DIM
from planner.strategies.tensor.split.splits import SequenceSplit
from runtime.materialize import TENSOR_GROUP
from runtime.program.shards import FeatureSplit
from runtime.comm.autograd import copy_to_group, gather_whole


def sequence_scatters(seq: SequenceSplit) -> list[tuple[str, str, int, FeatureSplit]]:
    """The replicated inputs cut to this rank's tokens, in the form codegen/strategies/tensor/weight_ops.py cuts them."""
    whole = FeatureSplit((seq.length,), 0)
    return [(node, x, dim, whole) for node, x, dim in seq.scatters]


def rewrite_sequence(graph: fx.Graph, seq: SequenceSplit) -> None:
    """Insert the gathers and the parameter reads of `seq` into `graph`, in place (see module docstring)."""
    nodes = {n.name: n for n in graph.nodes}
    params = set(seq.params)
    reads = [(nodes[u], a) for u in seq.nodes for a in nodes[u].all_input_nodes
             if a.op == "get_attr" and str(a.target) in params]
    if not (seq.gathers or reads):
        return
    with graph.inserting_before(next(iter(graph.nodes))):
        group = graph.get_attr(TENSOR_GROUP)
    made: dict[str, fx.Node] = {}
    for consumer, value in seq.gathers:
        n, v = nodes[consumer], nodes[value]
        if value not in made:
            with graph.inserting_after(v):
                made[value] = _like(graph.call_function(gather_whole, (v, SEQUENCE_DIM, group)), n)
        n.replace_input_with(v, made[value])
    for n, a in reads:
        key = f"param:{a.name}"
        if key not in made:
            with graph.inserting_after(a):
                made[key] = _like(graph.call_function(copy_to_group, (a, group)), n)
        n.replace_input_with(a, made[key])

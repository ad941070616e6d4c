"""Sequence parallelism (Megatron; Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, section 4.2.2): where the tensor-parallel regions meet the replicated
stream, the stream is split along the sequence (dimension 1 of (B, T, C)) instead of being held
whole by every tensor rank.

A row-parallel op (and a vocabulary-parallel embedding) reduce-scatters its partial output along
the sequence in place of the all-reduce; the replicated per-token ops that follow (norms,
dropout, residual adds, elementwise ops and same-shape views) run on this rank's T/t tokens; a
column-parallel op all-gathers its sequence-split input (backward: reduce-scatter of the input
gradient, in place of the all-reduce). Where a split value reaches an op that is not per-token
(the model output, a reshape, a replicated head), it is gathered whole (backward: each rank keeps
its part of the gradient). A replicated tensor that meets a split one along the sequence (GPT's
position embeddings) is cut to this rank's tokens, and a parameter read on split tokens (a norm's
weight) receives a partial gradient that is all-reduced over the tensor axis.

`sequence_stream` finds all of this on a captured graph (planner.graph.ModelGraph) from the
tensor-parallel roles; the cost model (planner/strategies/tensor/strategy.py) prices it and the plan stores
it (`SequenceSplit`, part of planner/strategies/tensor/split/splits.TensorSplits) for codegen to apply.
"""

from __future__ import annotations

from planner.config import ConfigError
from planner.graph.model import ModelGraph, OpInfo
from planner.strategies.tensor.split.splits import SequenceSplit
from runtime.vocab import OpKind, ShardRole

SEQUENCE_DIM = 1   # (B, T, C): the batch first, the sequence second

# Ops that act on every token alone. Names as planner.graph records the target (its last part).
_PER_TOKEN_KINDS = (OpKind.ELEMENTWISE, OpKind.NORM, OpKind.VIEW)
# elementwise-kind ops that mix tokens, which a sequence split must not pass through
_MIXING = ("cumsum", "cumprod", "diff", "flip", "roll", "index", "gather", "scatter", "sort", "cummax", "cummin",
           "arange", "new_ones", "new_zeros", "triu", "tril")
_STARTS = (ShardRole.ROW, ShardRole.VOCAB)
_COLUMNS = (ShardRole.COLUMN, ShardRole.COLUMN_OUT)


class SequenceSplitError(ConfigError):
    """The model cannot be split along the sequence as asked; the message names the node or size."""


def _base(n: OpInfo) -> str:
    return n.target.rsplit(".", 1)[-1].lower()


def _per_token(n: OpInfo, src: tuple[int, ...]) -> bool:
    """Whether replicated op `n`, reading a (B, T, C) value of shape `src`, acts on each token alone:
    a per-token kind, not a mixing op, one output that keeps (B, T) and the rank (a norm's or a
    last-dimension reduction's (B, T, 1) included; a view only when it keeps the shape)."""
    if n.kind not in _PER_TOKEN_KINDS or _base(n) in _MIXING or len(n.output_meta) != 1:
        return False
    out = tuple(n.output_meta[0].shape)
    if n.kind == OpKind.VIEW:
        return out == src
    return len(out) == len(src) and out[:2] == src[:2]


def sequence_stream(graph: ModelGraph, roles: dict[str, str], tensor: int) -> SequenceSplit:
    """The sequence split of `graph` under tensor-parallel `roles` (node name -> role; missing:
    replicated) on `tensor` ranks (see module docstring).

    Raises SequenceSplitError naming the node when a region's output is not (B, T, C), or the
    sequence length when `tensor` does not divide it.
    """
    by_name = {n.name: n for n in graph.nodes}
    shape: dict[str, tuple[int, ...]] = {}    # split node -> its full shape
    starts, nodes, columns, gathers, scatters, params = [], [], [], [], [], []
    length = 0
    for n in graph.nodes:
        role = roles.get(n.name, ShardRole.REPLICATE)
        split_in = [i for i in dict.fromkeys(n.inputs) if i in shape]
        if role in _STARTS:
            out = tuple(n.output_meta[0].shape) if len(n.output_meta) == 1 else ()
            if len(out) != 3:
                raise SequenceSplitError(
                    f"sequence parallelism splits (batch, sequence, features) values, but the output of "
                    f"{n.name!r} ({n.module_path or 'top level'}) has shape {out or 'of several tensors'}; "
                    "use sequence_parallel=False for this model")
            if length and out[SEQUENCE_DIM] != length:
                raise SequenceSplitError(f"sequence parallelism needs one sequence length, but {n.name!r} has "
                                         f"{out[SEQUENCE_DIM]} tokens and others {length}; use sequence_parallel=False")
            length = out[SEQUENCE_DIM]
            if length % tensor:
                raise SequenceSplitError(f"sequence parallelism splits the sequence of {length} tokens "
                                         f"({n.name!r}) over the tensor degree {tensor}, which does not divide it; "
                                         f"choose a tensor degree that divides {length} or sequence_parallel=False")
            starts.append(n.name)
            shape[n.name] = out
            gathers += [(n.name, i) for i in split_in]   # a row op reads its input whole (never so in Megatron)
            continue
        if not split_in:
            continue
        if role in _COLUMNS and len(split_in) == 1:
            columns.append(n.name)
            continue
        src = shape[split_in[0]]
        if role == ShardRole.REPLICATE and all(len(shape[i]) == len(src) and shape[i][:2] == src[:2] for i in split_in) \
                and _per_token(n, src):
            nodes.append(n.name)
            shape[n.name] = tuple(n.output_meta[0].shape)
            for i in dict.fromkeys(n.inputs):
                m = by_name.get(i)
                if m is None or i in shape or len(m.output_meta) != 1:
                    continue
                ms = tuple(m.output_meta[0].shape)
                dim = SEQUENCE_DIM - (len(src) - len(ms))
                if 0 <= dim < len(ms) and ms[dim] != 1:
                    scatters.append((n.name, i, dim))   # its gradient is all-reduced where it is cut
                elif m.kind == OpKind.PARAM:
                    params.append(str(m.target))
            if n.op == "call_module" and n.param_names:
                params.append(n.module_path)
            continue
        gathers += [(n.name, i) for i in split_in]
    if not starts:
        raise SequenceSplitError("sequence parallelism splits the values between tensor-parallel regions along the "
                                 "sequence, but no region here ends in a row split or a vocabulary embedding that "
                                 "would begin such a value; use sequence_parallel=False for this model")
    return SequenceSplit(length=length, starts=tuple(starts), nodes=tuple(nodes), columns=tuple(columns),
                         gathers=tuple(gathers), scatters=tuple(scatters), params=tuple(dict.fromkeys(params)))

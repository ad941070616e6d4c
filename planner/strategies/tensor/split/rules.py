"""The split rules of tensor parallelism: which dimension of every value of an fx graph is divided
over the tensor ranks, and how (planner/strategies/tensor/split/analysis.py drives them; codegen/strategies/tensor/split.py
applies what they decide).

A `Split` follows the split dimension from the column ops the plan names through views,
permutes, indexing, elementwise ops and attention, op by op (`_rule`); where a reshape offers
several factors of the split dimension, `_search` backtracks over the choices until the whole
graph analyses cleanly, or raises TensorSplitError naming the node, what it calls and where.
This module walks the graph and places the ops the plan splits; the rule of every other op is
in op_rules.py, and the Split with the analysis state in state.py.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from planner.graph.ops import module_path_of, target_name
from planner.graph.weight_op import weight_op
from planner.strategies.tensor.split.op_rules import _rule
from planner.strategies.tensor.split.state import Split, TensorSplitError, _Fail, _resolve, _State
from runtime.vocab import ShardRole


def _input_nodes(x: Any, out: list) -> list:
    """The fx Nodes among a node's arguments, in order and with repeats: the Node leaves
    torch.utils._pytree.tree_flatten finds (slices stay leaves), without its cost per node."""
    if isinstance(x, fx.Node):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for i in x:
            _input_nodes(i, out)
    elif isinstance(x, dict):
        for v in x.values():
            _input_nodes(v, out)
    return out


def _analyze(gm: fx.GraphModule, roles: dict[str, str], full: dict[str, Any], st: _State):
    """One pass over the graph; returns (value splits, module uses, output split)."""
    vals: dict[str, Any] = {}       # node -> Split | tuple of Split | None
    uses: list[tuple[str, str, str, Any]] = []   # (node, module path or node, role, Split/size)

    def split_of(a):
        if isinstance(a, fx.Node):
            v = vals.get(a.name)
            if isinstance(v, Split):
                return _resolve(v, st)
        return None

    for n in gm.graph.nodes:
        name = n.name
        role = roles.get(name, ShardRole.REPLICATE)
        out = full.get(name)
        tensor_args = _input_nodes((n.args, n.kwargs), [])
        in_splits = [(a, split_of(a)) for a in tensor_args]
        sharded = [(a, s) for a, s in in_splits if s is not None]
        tuple_inputs = [a for a in tensor_args if isinstance(vals.get(a.name), tuple)]
        if n.op in ("placeholder", "get_attr"):
            vals[name] = None
            continue
        if n.op == "output":
            res = n.args[0]
            if sharded:
                if isinstance(res, (tuple, list)) and res and isinstance(res[0], fx.Node) and \
                        all(split_of(r) is None for r in res[1:]):
                    res = res[0]   # (logits, ...): the loss reads the first output
                if not isinstance(res, fx.Node):
                    raise _Fail(name, "the model returns several values and one of them other than the first is "
                                      "split over the tensor axis; only the first (the logits) may be")
                s = split_of(res)
                if s.dim != len(full[res.name].shape) - 1:
                    raise _Fail(res.name, "the model output is split on a dimension other than the last")
                uses.append((name, "", "output", s))
            continue
        mod = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        tname = target_name(n, mod) if n.op != "call_module" else type(mod).__name__
        base = tname.rsplit(".", 1)[-1]
        if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT, ShardRole.ROW, ShardRole.VOCAB) and n.op == "call_function":
            vals[name] = _weight_role(n, role, tname, full, sharded, st)
            continue
        if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT):
            if sharded:
                raise _Fail(name, f"column-parallel {tname} reads a tensor that is already split")
            if n.op != "call_module" or not isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                raise _Fail(name, f"only nn.Linear / nn.ConvNd modules can be column-parallel, not {tname} "
                                  "(a functional or custom projection)")
            dim = 1 if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) else out.dim() - 1
            vals[name] = Split(dim, (out.shape[dim],), None, name)
            st.parent.setdefault(name, name)
            uses.append((name, str(n.target), role, vals[name]))
            continue
        if role == ShardRole.ROW:
            if n.op != "call_module" or not isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                raise _Fail(name, f"only nn.Linear / nn.ConvNd modules can be row-parallel, not {tname}")
            if len(sharded) != 1:
                raise _Fail(name, "a row-parallel op must read exactly one split tensor")
            s = sharded[0][1]
            want = 1 if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) else full[sharded[0][0].name].dim() - 1
            if s.dim != want:
                raise _Fail(name, f"row-parallel {tname} reads a tensor split on dimension {s.dim}, "
                                  f"not on its input features (dimension {want})")
            uses.append((name, str(n.target), ShardRole.ROW, s))
            vals[name] = None
            continue
        if role == ShardRole.VOCAB:
            if n.op != "call_module" or not isinstance(mod, nn.Embedding):
                raise _Fail(name, f"only nn.Embedding modules can be vocabulary-parallel, not {tname}")
            uses.append((name, str(n.target), ShardRole.VOCAB, mod.num_embeddings))
            vals[name] = None
            continue
        if not sharded and not tuple_inputs:
            vals[name] = None
            continue
        if role == ShardRole.REPLICATE and sharded and base not in ("size", "dim", "getattr"):
            raise _Fail(name, f"{tname} reads a tensor split over the tensor axis but the plan replicates it")
        vals[name] = _rule(n, mod, base, full, sharded, tensor_args, vals, st, uses, split_of)
    return vals, uses


def _weight_role(n, role, tname, full, sharded, st) -> Split | None:
    """The split of an ATen weight op's output (planner/graph/weight_op.py) under its role."""
    name = n.name
    op = weight_op(n)
    if op is None:
        raise _Fail(name, f"{tname} is not a linear, matmul, convolution or embedding reading its weight "
                          f"directly, so it cannot be {role}-parallel")
    x_split = next((s for a, s in sharded if a is op.x), None)
    if role == ShardRole.VOCAB:
        if op.kind != "embedding" or sharded:
            raise _Fail(name, f"{tname} cannot be split by vocabulary")
        st.param_uses.append((name, role, int(full[op.weight.name].shape[0])))
        return None
    out = full[name]
    dim = op.feature_dim % out.dim()
    if ShardRole(role).splits_output:
        if sharded or op.kind == "embedding":
            raise _Fail(name, f"column-parallel {tname} reads a tensor that is already split")
        split = Split(dim, (out.shape[dim],), None, name)
        st.parent.setdefault(name, name)
        st.param_uses.append((name, role, split))
        return split
    if len(sharded) != 1 or x_split is None:
        raise _Fail(name, f"row-parallel {tname} must read exactly one split tensor, its input")
    want = op.feature_dim % full[op.x.name].dim()
    if x_split.dim != want:
        raise _Fail(name, f"row-parallel {tname} reads a tensor split on dimension {x_split.dim}, not on its "
                          f"input features (dimension {want})")
    st.param_uses.append((name, ShardRole.ROW, x_split))
    return None


# ---------------------------------------------------------------------------
# driver


def _search(gm, roles, full, t):
    """Backtracking over the reshape choices until the whole graph analyses cleanly."""
    choices: dict[str, int] = {}
    first_error: _Fail | None = None
    for _attempt in range(256):
        st = _State(t=t, choices=dict(choices))
        try:
            vals, uses = _analyze(gm, roles, full, st)
            return vals, uses, st
        except _Fail as e:
            first_error = first_error or e
            # advance the last choice point that has candidates left
            taken = st.taken
            while taken and taken[-1][1] + 1 >= taken[-1][2]:
                taken.pop()
            if not taken:
                break
            choices = {node: c for node, c, _ in taken[:-1]}
            node, c, _ = taken[-1]
            choices[node] = c + 1
    err = TensorSplitError(f"tensor parallelism cannot split node {first_error.node!r}{_where(gm, first_error.node)}: "
                           f"{first_error}")
    err.node = first_error.node
    raise err


def _where(gm: fx.GraphModule, name: str) -> str:
    """" (aten.addmm at transformer.h.0.attn)": what a node calls and its module path, for messages."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    if node is None:
        return ""
    mod = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
    path = str(node.target) if node.op == "call_module" else module_path_of(node)
    return f" ({target_name(node, mod)} at {path or 'the top level'})"


"""Tensor parallelism on the fx graph: which dimension of every value is split, how the
split weights are partitioned, and the rewrite of shape constants to local sizes.

Input: the captured GraphModule and the plan's roles per node ("column",
"row", "inner", "vocab", "column_out"; planner/sharding.py finds them).
No model is special-cased; the analysis follows the split dimension through
the graph op by op:

* a column op's output is split on its feature dimension (last for Linear,
  1 for conv). How its output features are partitioned is decided where the
  split dimension is first reshaped: GPT's qkv (B, T, 3C) -> unflatten to
  (B, T, 3, H, D) offers the factors 3, H and D; the first that t divides
  *and* that the rest of the region can keep split is chosen (3 is indexed
  by q/k/v, so it fails and H is taken). The column weight is then
  partitioned per part: each rank holds its heads of q, of k and of v.
* views, permutes, transposes and integer indexing move the split dimension;
  elementwise ops and attention keep it (attention over heads); a replicated
  tensor meeting it (T5's per-head position bias, a mask per head) is cut to
  the rank's part where it is read (`scatter_to_group`: every tensor rank
  computes a replicated value alike; its gradient is all-reduced); a
  reduction, softmax, contraction or slice across it is an error naming the
  node (the planner must not choose that sharding).
* a row op's input features are partitioned the way its input is split; a
  per-channel norm (BatchNorm) between column and row keeps its channels.
* a column_out op (the last projection) leaves the model output split on its
  last dimension (vocabulary-parallel logits and loss).

The analysis lives in codegen/split_rules.py. The rewrite then re-runs the graph on meta tensors with the local modules,
replacing view/reshape/unflatten/split/expand constants that still hold the
full size of the split dimension (3C, C, num_heads) with the local size,
and checks every node's local shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from codegen.shape_rewrite import TensorSplitError, _rewrite, run_meta  # noqa: F401  (TensorSplitError re-exported)
from codegen.specialize import debake_devices, fold_batch_sizes
from codegen.split_rules import Split, _feature_split, _search, _State
from codegen.weight_ops import rewrite as rewrite_weight_ops, weight_op
from planner.ops import module_path_of, target_name
from runtime.tensor_parallel import FeatureSplit, ModuleShard, ParamShard
from runtime.vocab import ShardRole


@dataclass
class TensorSplitResult:
    """What `split_graph` found.

    graph: a copy of the graph with shape constants rewritten to local sizes.
    shards: module path -> ModuleShard for every split module.
    value_splits: node name -> (dim, FeatureSplit) for every split value.
    output_split: FeatureSplit of the model output's last dimension (vocab-parallel), or None.
    local_values / full_values: node name -> meta value (local run, full-size run).
    param_shards: get_attr target -> ParamShard for every weight an ATen op reads split.
    """

    graph: fx.Graph
    shards: dict[str, ModuleShard]
    value_splits: dict[str, tuple[int, FeatureSplit]]
    output_split: FeatureSplit | None
    local_values: dict[str, Any]
    full_values: dict[str, Any]
    param_shards: dict[str, ParamShard] = field(default_factory=dict)



def unsplittable(graph, roles: dict[str, str], tensor: int) -> TensorSplitError | None:
    """Why the tensor-parallel roles cannot be carried out on `tensor` ranks (the error, whose
    `node` names where), or None. Shapes come from the captured graph's figures, so this costs
    no run of the model: the planner asks it for every tensor degree it considers."""
    full: dict[str, Any] = {}
    for n in graph.nodes:
        metas = [torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta") for m in n.output_meta]
        full[n.name] = metas[0] if len(metas) == 1 else (tuple(metas) if metas else None)
    try:
        _search(graph.module, roles, full, tensor)
    except TensorSplitError as e:
        return e
    return None


def split_graph(gm: fx.GraphModule, roles: dict[str, str], tensor: int, inputs: dict[str, Any]) -> TensorSplitResult:
    """Analyse and rewrite `gm`'s graph for tensor degree `tensor` (see module docstring).

    `inputs`: placeholder name -> meta tensor with the micro-batch's shape.
    Raises TensorSplitError naming the node when the sharding cannot be carried out.
    """
    full = run_meta(gm, gm.graph, inputs, {})
    new_graph = fx.Graph()
    out_map: dict[fx.Node, fx.Node] = {}
    ret = new_graph.graph_copy(gm.graph, out_map)
    new_graph.output(ret)
    for n in list(new_graph.nodes):
        n.type = None
    debake_devices(new_graph)             # an export graph names the capture device (meta) ...
    fold_batch_sizes(new_graph, full)     # ... and reads its symbolic batch size
    if tensor == 1 or not any(r != "replicate" for r in roles.values()):
        return TensorSplitResult(new_graph, {}, {}, None, full, full)
    vals, uses, st = _search(gm, roles, full, tensor)

    shards: dict[str, ModuleShard] = {}
    output_split = None
    for node, path, role, x in uses:
        if role == "output":
            fs = _feature_split(x, st)
            if fs.contiguous_start(0, tensor) is None:
                raise TensorSplitError(f"the model output {node!r} is split in non-contiguous blocks; the "
                                       "vocabulary-parallel loss needs contiguous class blocks")
            output_split = fs
            continue
        if role == ShardRole.VOCAB:
            fs = FeatureSplit((x,), 0)
        else:
            fs = _feature_split(x, st)
        fs.check(tensor)
        sh = ModuleShard(path, role, fs)
        if path in shards and shards[path] != sh:
            raise TensorSplitError(f"module {path} is called twice and would be split two different ways")
        shards[path] = sh
    param_shards = _param_shards(gm, st, tensor)
    value_splits = {}
    for k, v in vals.items():
        if isinstance(v, Split):
            value_splits[k] = (v.dim, _feature_split(v, st))
    by_role: dict[str, list[str]] = {ShardRole.COLUMN: [], ShardRole.ROW: [], ShardRole.VOCAB: []}
    for node, role, _x in st.param_uses:
        by_role[ShardRole.COLUMN if role == ShardRole.COLUMN_OUT else role].append(node)
    rewrite_weight_ops(new_graph, by_role[ShardRole.COLUMN], by_role[ShardRole.ROW], by_role[ShardRole.VOCAB],
                       [(node, x, dim, _feature_split(sp, st)) for node, x, dim, sp in st.scatters])
    attrs = {}
    for target, ps in param_shards.items():
        full_attr = gm
        for part in target.split("."):
            full_attr = getattr(full_attr, part)
        shape = list(full_attr.shape)
        shape[ps.dim] = ps.split.local_size(tensor)
        attrs[target] = torch.empty(shape, dtype=full_attr.dtype, device="meta", requires_grad=full_attr.requires_grad)
    local = _rewrite(gm, new_graph, shards, value_splits, tensor, inputs, full, attrs)
    return TensorSplitResult(new_graph, shards, value_splits, output_split, local, full, param_shards)


def _param_shards(gm: fx.GraphModule, st: _State, tensor: int) -> dict[str, ParamShard]:
    """How each weight read by a split ATen op is split (one way, whichever ops read it)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out: dict[str, ParamShard] = {}

    def add(target: str, dim: int, fs: FeatureSplit, node: str) -> None:
        fs.check(tensor)
        ps = ParamShard(target, dim, fs)
        if target in out and out[target] != ps:
            raise TensorSplitError(f"weight {target} is read by {node!r} and by another op that split it "
                                   f"differently ({out[target].dim}/{out[target].split.to_list()} vs "
                                   f"{dim}/{fs.to_list()}); a tied weight's users must split it alike")
        out[target] = ps

    for node, role, x in st.param_uses:
        op = weight_op(nodes[node])
        if role == ShardRole.VOCAB:
            add(str(op.weight.target), 0, FeatureSplit((x,), 0), node)
            continue
        fs = _feature_split(x, st)
        if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT):
            add(str(op.weight.target), op.out_dim, fs, node)
            if op.bias is not None:
                add(str(op.bias.target), 0, fs, node)
        else:
            add(str(op.weight.target), op.in_dim, fs, node)
    split_users = {node for node, _r, _x in st.param_uses}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and str(n.target) in out:
            for u in n.users:
                if u.name not in split_users:
                                    raise TensorSplitError(f"weight {n.target} is split over the tensor axis, but {u.name!r} "
                                           f"({target_name(u, None)}) at {module_path_of(u) or 'the top level'} "
                                           "reads it whole; split both users of a tied weight, or neither")
    return out

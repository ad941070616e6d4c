"""Tensor parallelism on the fx graph, applied: the planner has decided which dimension of every
value is split and how (planner/strategies/tensor/split/, stored in the Plan as `TensorSplits`); here the
captured graph is copied for the build, the communication around weight ops of an ATen graph
is inserted (codegen/strategies/tensor/weight_ops.py), and the graph is re-run on meta tensors with the local
modules, replacing view/reshape/unflatten/split/expand constants that still hold the full size
of the split dimension (3C, C, num_heads) with the local size, and checking every node's local
shape (codegen/strategies/tensor/shapes.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from codegen.strategies.tensor.sequence import rewrite_sequence, sequence_scatters
from codegen.local_shapes import run_meta
from codegen.strategies.tensor.shapes import _rewrite
from codegen.specialize import debake_devices, fold_batch_sizes
from codegen.strategies.tensor.weight_ops import rewrite_weight_ops
from planner.strategies.tensor.split.analysis import decide
from planner.strategies.tensor.split.sequence import SEQUENCE_DIM
from planner.strategies.tensor.split.rules import TensorSplitError  # noqa: F401  (re-exported)
from planner.strategies.tensor.split.splits import TensorSplits
from runtime.program.shards import FeatureSplit, ModuleShard, ParamShard
from runtime.vocab import ShardRole


@dataclass
class TensorSplitResult:
    """What `apply_splits` made.

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


def apply_splits(gm: fx.GraphModule, splits: TensorSplits | None, inputs: dict[str, Any], *,
                 graph: fx.Graph | None = None, attrs: dict[str, Any] | None = None) -> TensorSplitResult:
    """`gm`'s graph specialized to the build and rewritten for the decided `splits` (None: nothing
    is split). `inputs`: placeholder name -> meta tensor with the micro-batch's shape. `graph`:
    a rewrite of gm's graph to split instead (context parallelism's, codegen/strategies/context/stage_code.py), whose
    runtime attributes' meta stand-ins are `attrs` (get_attr target -> value).

    Raises TensorSplitError when the graph with local sizes does not run (a shape constant
    computed at run time that cannot be rewritten).
    """
    graph = gm.graph if graph is None else graph
    return _apply(gm, graph, splits, inputs, run_meta(gm, graph, inputs, {}, attrs=attrs), attrs or {})


def _apply(gm: fx.GraphModule, graph: fx.Graph, splits: TensorSplits | None, inputs: dict[str, Any],
           full: dict[str, Any], extra_attrs: dict[str, Any]) -> TensorSplitResult:
    new_graph = fx.Graph()
    out_map: dict[fx.Node, fx.Node] = {}
    ret = new_graph.graph_copy(graph, out_map)
    new_graph.output(ret)
    for n in list(new_graph.nodes):
        n.type = None
    debake_devices(new_graph)             # an export graph names the capture device (meta) ...
    fold_batch_sizes(new_graph, full)     # ... and reads its symbolic batch size
    if splits is None:
        return TensorSplitResult(new_graph, {}, {}, None, full, full)
    tensor = splits.tensor
    by_role: dict[ShardRole, list[str]] = {ShardRole.COLUMN: [], ShardRole.ROW: [], ShardRole.VOCAB: []}
    for node, role in splits.weight_ops:
        by_role[ShardRole.COLUMN if role.splits_output else role].append(node)
    seq = splits.sequence
    scatters = list(splits.scatters) + (sequence_scatters(seq) if seq else [])
    rewrite_weight_ops(new_graph, by_role[ShardRole.COLUMN], by_role[ShardRole.ROW], by_role[ShardRole.VOCAB],
                       scatters, seq)
    if seq is not None:
        rewrite_sequence(new_graph, seq)
    attrs = {}
    for ps in splits.params:
        full_attr = gm
        for part in ps.name.split("."):
            full_attr = getattr(full_attr, part)
        shape = list(full_attr.shape)
        shape[ps.dim] = ps.split.local_size(tensor)
        attrs[ps.name] = torch.empty(shape, dtype=full_attr.dtype, device="meta", requires_grad=full_attr.requires_grad)
    attrs.update(extra_attrs)   # the runtime attributes of a strategy's rewrite (context parallelism's)
    shards = {sh.path: sh for sh in splits.modules}
    value_splits = {node: (dim, fs) for node, dim, fs in splits.values}
    if seq is not None:   # the stream's values hold this rank's tokens (an ATen row op's own output is partial)
        partial = set(by_role[ShardRole.ROW])
        value_splits.update({node: (SEQUENCE_DIM, FeatureSplit((seq.length,), 0)) for node in seq.split
                             if node not in partial})
    local = _rewrite(gm, new_graph, shards, value_splits, tensor, inputs, full, attrs)
    return TensorSplitResult(new_graph, shards, value_splits, splits.output, local, full,
                             {ps.name: ps for ps in splits.params})


def split_graph(gm: fx.GraphModule, roles: dict[str, str], tensor: int, inputs: dict[str, Any]) -> TensorSplitResult:
    """Decide the split of `gm` with the planner's analysis on a full-size meta run at `inputs`,
    then apply it: for a graph that no plan has decided for (a version-1 plan, a test).

    Raises TensorSplitError naming the node when the roles cannot be carried out.
    """
    full = run_meta(gm, gm.graph, inputs, {})
    split = tensor > 1 and any(r != ShardRole.REPLICATE for r in roles.values())
    return _apply(gm, gm.graph, decide(gm, roles, tensor, full) if split else None, inputs, full, {})

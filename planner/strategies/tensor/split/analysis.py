"""The tensor-parallel split of a graph, decided once when the plan is made.

Input: the captured graph, the plan's roles per node ("column", "row", "inner", "vocab",
"column_out"; planner/strategies/tensor/sharding.py finds them) and the tensor degree t. No model is
special-cased; the rules (rules.py) follow the split dimension through the graph op by op:

* a column op's output is split on its feature dimension (last for Linear, 1 for conv). How
  its output features are partitioned is decided where the split dimension is first
  reshaped: GPT's qkv (B, T, 3C) -> unflatten to (B, T, 3, H, D) offers the factors 3, H and
  D; the first that t divides *and* that the rest of the region can keep split is chosen (3
  is indexed by q/k/v, so it fails and H is taken). The column weight is then partitioned
  per part: each rank holds its heads of q, of k and of v.
* views, permutes, transposes and integer indexing move the split dimension; elementwise ops
  and attention keep it (attention over heads; grouped-query attention takes q split by its
  heads and k, v by theirs, each rank holding the query heads that read its key/value heads);
  a replicated tensor meeting it (T5's per-head position bias, a mask per head) is cut to the
  rank's part where it is read (every tensor rank computes a replicated value alike; its
  gradient is all-reduced); a reduction, softmax, contraction or slice across it is an error
  naming the node.
* a row op's input features are partitioned the way its input is split; a per-channel norm
  (BatchNorm) between column and row keeps its channels.
* a column_out op (the last projection) leaves the model output split on its last dimension
  (vocabulary-parallel logits and loss).

The result is a `TensorSplits` (splits.py) that the Plan stores; codegen/strategies/tensor/split.py
applies it. Shapes come from the captured graph's figures, so deciding costs no run of the
model; a split dimension is made of feature sizes (features, heads, channels, vocabulary),
which the batch size does not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from planner.config import ConfigError
from planner.graph.ops import module_path_of, target_name
from planner.graph.weight_op import weight_op
from planner.strategies.tensor.split.rules import _search
from planner.strategies.tensor.split.state import Split, TensorSplitError, _feature_split, _State
from planner.strategies.tensor.split.sequence import SEQUENCE_DIM, SequenceSplitError, sequence_stream
from planner.strategies.tensor.split.splits import SequenceSplit, TensorSplits
from runtime.program.shards import FeatureSplit, ModuleShard, ParamShard
from runtime.vocab import ShardRole


def decide(gm: fx.GraphModule, roles: dict[str, str], tensor: int, full: dict[str, Any]) -> TensorSplits:
    """The split of `gm` over `tensor` ranks under `roles` (see module docstring).

    full: node name -> meta value of a full-size run (tensors, tuples of tensors, or None).
    Raises TensorSplitError naming the node when the roles cannot be carried out.
    """
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
        fs = FeatureSplit((x,), 0) if role == ShardRole.VOCAB else _feature_split(x, st)
        fs.check(tensor)
        sh = ModuleShard(path, ShardRole(role), fs)
        if path in shards and shards[path] != sh:
            raise TensorSplitError(f"module {path} is called twice and would be split two different ways")
        shards[path] = sh
    params = _param_shards(gm, st, tensor)
    values = tuple((k, v.dim, _feature_split(v, st)) for k, v in vals.items() if isinstance(v, Split))
    return TensorSplits(
        tensor=tensor, values=values, modules=tuple(shards.values()), params=tuple(params.values()),
        weight_ops=tuple((node, ShardRole(role)) for node, role, _x in st.param_uses),
        scatters=tuple((node, x, dim, _feature_split(sp, st)) for node, x, dim, sp in st.scatters),
        output=output_split)


def graph_values(graph) -> dict[str, Any]:
    """node name -> meta value with the shape the capture recorded (a planner.graph.ModelGraph)."""
    full: dict[str, Any] = {}
    for n in graph.nodes:
        metas = [torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta") for m in n.output_meta]
        full[n.name] = metas[0] if len(metas) == 1 else (tuple(metas) if metas else None)
    return full


def tensor_splits(graph, roles: dict[str, str], tensor: int, sequence: bool = False) -> TensorSplits | None:
    """The split of a captured graph (planner.graph.ModelGraph) under `roles` on `tensor` ranks,
    or None when nothing is split (tensor 1 or no role other than replicate) or the graph has no
    fx module to decide on (loaded from JSON; the code generator needs the captured model anyway).
    sequence: with sequence parallelism (the values between regions split along the sequence).
    Raises TensorSplitError naming the node when the roles cannot be carried out, and
    SequenceSplitError (a ConfigError) when the sequence cannot be split."""
    if tensor == 1 or graph.module is None or not any(r != ShardRole.REPLICATE for r in roles.values()):
        return None
    splits = decide(graph.module, roles, tensor, graph_values(graph))
    return with_sequence(splits, graph, sequence_stream(graph, roles, tensor)) if sequence else splits


def with_sequence(splits: TensorSplits, graph, seq: SequenceSplit) -> TensorSplits:
    """`splits` with the sequence split `seq`: the split modules that begin or read the split stream
    reduce-scatter or gather along the sequence, and the modules run on split tokens are named so
    that their parameters' gradients are all-reduced (runtime.parallel.tensor.layers)."""
    by_name = {n.name: n for n in graph.nodes}
    along = {by_name[x].module_path for x in seq.starts + seq.columns if by_name[x].op == "call_module"}
    modules = tuple(dataclasses.replace(sh, sequence_dim=SEQUENCE_DIM) if sh.path in along else sh
                    for sh in splits.modules)
    owners = {by_name[x].module_path for x in seq.nodes if by_name[x].op == "call_module"}
    whole = FeatureSplit((seq.length,), 0)
    modules += tuple(ModuleShard(p, ShardRole.SEQUENCE, whole) for p in seq.params if p in owners)
    return dataclasses.replace(splits, modules=modules, sequence=seq)


def unsplittable(graph, roles: dict[str, str], tensor: int) -> TensorSplitError | None:
    """Why the roles cannot be carried out on `tensor` ranks (the error, whose `node` names
    where), or None: the question the search asks for every tensor degree it considers."""
    try:
        tensor_splits(graph, roles, tensor)
    except TensorSplitError as e:
        return e
    return None


class SplitCache:
    """`tensor_splits` of one graph, remembered per (roles, tensor degree), failures included:
    the search asks again for every configuration with the same roles."""

    def __init__(self, graph) -> None:
        self.graph = graph
        self._known: dict[tuple, TensorSplits | TensorSplitError | SequenceSplitError | None] = {}

    def get(self, roles: dict[str, str], tensor: int, sequence: bool = False) -> TensorSplits | None:
        """As `tensor_splits`; raises the remembered TensorSplitError or SequenceSplitError for roles that failed."""
        key = (frozenset(roles.items()), tensor, sequence)
        if key not in self._known:
            try:
                self._known[key] = tensor_splits(self.graph, roles, tensor, sequence)
            except (TensorSplitError, SequenceSplitError) as e:
                self._known[key] = e
        hit = self._known[key]
        if isinstance(hit, (TensorSplitError, SequenceSplitError)):
            raise hit
        return hit

    def refusal(self, roles: dict[str, str], tensor: int, sequence: bool = False) -> str | None:
        """Why a configuration with these roles on `tensor` ranks cannot be lowered, or None."""
        try:
            self.get(roles, tensor, sequence)
        except (TensorSplitError, SequenceSplitError) as e:
            return str(e)
        return None

    def for_plan(self, roles: dict[str, str], tensor: int, sequence: bool = False) -> TensorSplits | None:
        """As `get`, for a plan about to be returned: ConfigError naming the node on failure."""
        try:
            return self.get(roles, tensor, sequence)
        except TensorSplitError as e:
            raise ConfigError(f"{e}; the tensor-parallel roles cannot be carried out on {tensor} ranks: "
                              "choose another tensor degree") from None


class ConfigSplits:
    """A SplitCache asked by configuration (its tensor degree and sequence parallelism): the
    search's and the fixed plan's view of the split analysis (planner/strategies/base.SplitAnalysis)."""

    def __init__(self, graph) -> None:
        self._cache = SplitCache(graph)

    def refusal(self, roles: dict[str, str], config) -> str | None:
        return self._cache.refusal(roles, config.tensor, config.sequence_parallel)

    def get(self, roles: dict[str, str], config) -> TensorSplits | None:
        return self._cache.get(roles, config.tensor, config.sequence_parallel)

    def for_plan(self, roles: dict[str, str], config) -> TensorSplits | None:
        return self._cache.for_plan(roles, config.tensor, config.sequence_parallel)


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
        if ShardRole(role).splits_output:
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

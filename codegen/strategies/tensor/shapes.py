"""Running a (possibly rewritten) fx graph on meta tensors, and the rewrite of shape
constants to a rank's local sizes under tensor parallelism (used by codegen.strategies.tensor.split).

After the planner's split analysis (planner/strategies/tensor/split/) has decided which dimension of
every value is divided over the t ranks, the graph is re-run on meta tensors with each split
module replaced by its local shard; view/reshape/unflatten/split/expand constants that still hold a full size
of the split dimension are replaced with the local size, and every node's local shape
is checked against the expected one.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from planner.graph.ops import target_name
from planner.strategies.tensor.split.rules import TensorSplitError, norm_dim
from runtime.materialize import RUN_DEVICE, RUNTIME_ATTRS
from runtime.program.shards import FeatureSplit, ModuleShard
from runtime.parallel.tensor.layers import ShapeGroup, shard_module


# ---------------------------------------------------------------------------
# meta interpretation


def run_meta(gm: fx.GraphModule, graph: fx.Graph, inputs: dict[str, Any], modules: dict[str, nn.Module],
             on_node: Callable[[fx.Node, dict], None] | None = None,
             attrs: dict[str, Any] | None = None, tensor: int = 1) -> dict[str, Any]:
    """Run `graph` node by node on meta tensors; modules[path] replaces gm's submodule and
    attrs[target] the value of a get_attr (a weight's local shard); the stage's tensor group
    is a stand-in of `tensor` ranks (this run sees rank 0's shapes)."""
    env: dict[str, Any] = {}

    def load(a):
        return fx.node.map_arg(a, lambda n: env[n.name])

    meta = torch.device("meta")

    def fix(x):
        return meta if isinstance(x, torch.device) else x

    with torch.enable_grad():
        for n in list(graph.nodes):
            if on_node is not None:
                on_node(n, env)
            if n.op == "placeholder":
                env[n.name] = inputs[n.name]
            elif n.op == "get_attr":
                if attrs and n.target in attrs:
                    env[n.name] = attrs[n.target]
                    continue
                if n.target in RUNTIME_ATTRS:   # set on the stage module by the runtime
                    env[n.name] = meta if n.target == RUN_DEVICE else (ShapeGroup(tensor) if tensor > 1 else None)
                    continue
                obj = gm
                for part in str(n.target).split("."):
                    obj = getattr(obj, part)
                env[n.name] = obj
            elif n.op == "output":
                env[n.name] = load(n.args[0])
            else:
                args = tuple(fix(a) for a in load(n.args))
                kwargs = {k: fix(v) for k, v in load(n.kwargs).items()}
                if isinstance(kwargs.get("device"), str):
                    kwargs["device"] = meta
                if n.op == "call_module":
                    path = str(n.target)
                    mod = modules[path] if path in modules else gm.get_submodule(path)
                    env[n.name] = mod(*args, **kwargs)
                elif n.op == "call_method":
                    env[n.name] = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    env[n.name] = n.target(*args, **kwargs)
    return env


# ---------------------------------------------------------------------------
# rewrite of shape constants


def _local_modules(gm: fx.GraphModule, shards: dict[str, ModuleShard], t: int) -> dict[str, nn.Module]:
    # a stand-in group: the split modules' collectives give rank 0's shapes (a sequence-parallel row op
    # its block of the sequence)
    return {path: shard_module(gm.get_submodule(path), sh, 0, t, ShapeGroup(t)) for path, sh in shards.items()}


def _expected(full_val, split: tuple[int, FeatureSplit] | None, t: int):
    shape = list(full_val.shape)
    if split is not None:
        shape[split[0]] = split[1].local_size(t)
    return tuple(shape)


def _rewrite(gm, graph: fx.Graph, shards, value_splits, t, inputs, full, attrs=None) -> dict[str, Any]:
    modules = _local_modules(gm, shards, t)

    def fix_node(n: fx.Node, env: dict) -> None:
        if n.op not in ("call_method", "call_function"):
            return
        base = target_name(n, None).rsplit(".", 1)[-1]
        if base == "split" and isinstance(n.args[1], int):
            src = n.args[0]
            sdim = value_splits.get(src.name, (None,))[0]
            d = norm_dim(n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0), full[src.name].dim())
            if d == sdim:
                n.args = (src, n.args[1] // t, *n.args[2:])
            return
        if n.name not in value_splits or not isinstance(full.get(n.name), torch.Tensor):
            return
        dim, fs = value_splits[n.name]
        want = _expected(full[n.name], (dim, fs), t)
        if base in ("view", "reshape", "expand", "_unsafe_view"):
            shape_args = list(n.args[1:])
            packed = len(shape_args) == 1 and isinstance(shape_args[0], (tuple, list))
            if packed:
                shape_args = list(shape_args[0])
            new = [_fix_size(graph, n, a, p, want, full[n.name].shape, dim, t, env) for p, a in enumerate(shape_args)]
            n.args = (n.args[0], tuple(new)) if packed else (n.args[0], *new)
        elif base == "unflatten":
            d0 = norm_dim(n.args[1], full[n.args[0].name].dim())
            sizes = list(n.args[2])
            new = [_fix_size(graph, n, a, d0 + p, want, full[n.name].shape, dim, t, env) for p, a in enumerate(sizes)]
            n.args = (n.args[0], n.args[1], tuple(new))

    def check(n: fx.Node, env: dict) -> None:
        # called before each node runs: verify the previous nodes' shapes lazily
        for a in n.all_input_nodes:
            v = env.get(a.name)
            if a.op == "get_attr":
                continue   # a weight: its local shard (ParamShard), not an activation
            if isinstance(v, torch.Tensor) and isinstance(full.get(a.name), torch.Tensor):
                want = _expected(full[a.name], value_splits.get(a.name), t)
                if tuple(v.shape) != want:
                    raise TensorSplitError(f"after splitting over {t} ranks, node {a.name!r} has shape "
                                           f"{tuple(v.shape)}, expected {want}; its shape constants could not be "
                                           "rewritten to the local size")

    def on_node(n, env):
        check(n, env)
        fix_node(n, env)

    try:
        return run_meta(gm, graph, inputs, modules, on_node, attrs, t)
    except TensorSplitError:
        raise
    except Exception as e:
        raise TensorSplitError(f"the graph with local (1/{t}) sizes does not run: {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:300]}") from None


def _fix_size(graph: fx.Graph, n: fx.Node, a, pos: int, want, full_shape, dim: int, t: int, env) -> Any:
    """One shape argument of a view: keep it if it already gives the local size, scale it if
    it holds the full size of the split dimension."""
    v = env[a.name] if isinstance(a, fx.Node) else a
    if not isinstance(v, int) or v == -1 or want is None or pos >= len(want):
        return a
    if v == want[pos]:
        return a
    if pos == dim and v == full_shape[pos]:
        if isinstance(a, fx.Node):
            if v % t:
                raise TensorSplitError(f"node {n.name!r}: shape argument {pos} ({v}) is computed at run time and "
                                       f"{t} does not divide it; the padded local size cannot be derived")
            with graph.inserting_before(n):
                q = graph.call_function(operator.floordiv, (a, t))
            env[q.name] = v // t  # the meta run has passed this point already
            return q
        return want[pos]
    raise TensorSplitError(f"node {n.name!r}: shape argument {pos} is {v}, which is neither the local size "
                           f"{want[pos]} nor the full size {full_shape[pos]} of the split dimension")

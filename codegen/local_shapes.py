"""A graph at one rank's local sizes: running an fx graph on meta tensors, and rewriting the shape constants
of values split over ranks to their local sizes (what the tensor split and context parallelism's sequence
chunks both need: codegen/strategies/tensor/, codegen/strategies/context/).

Given which dimension of every value is divided over the t ranks (a FeatureSplit each), the graph is
re-run on meta tensors with the split modules replaced by their local stand-ins; view/reshape/unflatten/
split/expand constants that still hold a full size of the split dimension are replaced with the local
size, and every node's local shape is checked against the expected one.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from planner.graph.ops import target_name
from runtime.materialize import RUN_DEVICE, RUNTIME_ATTRS
from runtime.program.shards import FeatureSplit


class ShapeRewriteError(ValueError):
    """A split graph's shapes cannot be made local; the message names the node."""


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ---------------------------------------------------------------------------
# meta interpretation


def run_meta(gm: fx.GraphModule, graph: fx.Graph, inputs: dict[str, Any], modules: dict[str, nn.Module],
             on_node: Callable[[fx.Node, dict], None] | None = None,
             attrs: dict[str, Any] | None = None, stand_ins: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `graph` node by node on meta tensors and return every node's value (node name -> value);
    modules[path] replaces gm's submodule and attrs[target] the value of a get_attr (a weight's local
    shard); a runtime attribute of the stage module (runtime.materialize.RUNTIME_ATTRS) not in `attrs` is
    the meta device or stand_ins[target] (a group's shape-only stand-in), else None; on_node(node, values)
    is called before each node runs."""
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
                    env[n.name] = meta if n.target == RUN_DEVICE else (stand_ins or {}).get(n.target)
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


def _expected(full_val, split: tuple[int, FeatureSplit] | None, t: int):
    shape = list(full_val.shape)
    if split is not None:
        shape[split[0]] = split[1].local_size(t)
    return tuple(shape)


def rewrite_local(gm: fx.GraphModule, graph: fx.Graph, modules: dict[str, nn.Module],
                  value_splits: dict[str, tuple[int, FeatureSplit]], t: int, inputs: dict[str, Any],
                  full: dict[str, Any], attrs: dict[str, Any] | None = None,
                  stand_ins: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rewrite `graph` in place for one rank of `t` whose values are split as value_splits says (node name ->
    (dimension, FeatureSplit)), and return its nodes' local values (run_meta's, rank 0's shapes): view,
    reshape, expand, unflatten and split constants that hold a full size of a split dimension become the
    local size. modules: the local stand-ins of split modules (path -> module); full: run_meta's values of
    the whole graph. ShapeRewriteError naming the node where a local shape differs from the split's or
    the graph does not run at local sizes."""

    def fix_node(n: fx.Node, env: dict) -> None:
        if n.op not in ("call_method", "call_function"):
            return
        base = target_name(n, None).rsplit(".", 1)[-1]
        if base == "split" and isinstance(n.args[1], int):
            src = n.args[0]
            sdim = value_splits.get(src.name, (None,))[0]
            d = _dim(n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0), full[src.name].dim())
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
            d0 = _dim(n.args[1], full[n.args[0].name].dim())
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
                    raise ShapeRewriteError(f"after splitting over {t} ranks, node {a.name!r} has shape "
                                           f"{tuple(v.shape)}, expected {want}; its shape constants could not be "
                                           "rewritten to the local size")

    def on_node(n, env):
        check(n, env)
        fix_node(n, env)

    try:
        return run_meta(gm, graph, inputs, modules, on_node, attrs, stand_ins)
    except ShapeRewriteError:
        raise
    except Exception as e:
        raise ShapeRewriteError(f"the graph with local (1/{t}) sizes does not run: {type(e).__name__}: "
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
                raise ShapeRewriteError(f"node {n.name!r}: shape argument {pos} ({v}) is computed at run time and "
                                       f"{t} does not divide it; the padded local size cannot be derived")
            with graph.inserting_before(n):
                q = graph.call_function(operator.floordiv, (a, t))
            env[q.name] = v // t  # the meta run has passed this point already
            return q
        return want[pos]
    raise ShapeRewriteError(f"node {n.name!r}: shape argument {pos} is {v}, which is neither the local size "
                           f"{want[pos]} nor the full size {full_shape[pos]} of the split dimension")


__all__ = ["ShapeRewriteError", "rewrite_local", "run_meta"]

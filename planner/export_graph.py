"""Tidy a torch.export graph into one flat list of ATen calls, and export with a dynamic batch.

`ExportedProgram.module()` gives an fx GraphModule whose nodes are ATen ops carrying the
original model's module paths (`nn_module_stack`), plus a few export artifacts a rank
never needs:

* the input-shape guard `_guards_fn` and the `_assert_tensor_metadata` / `_assert_scalar`
  checks (they also bake the capture device into the graph);
* `wrap_with_set_grad_enabled` regions: a sub-graph run under torch.no_grad() or
  torch.enable_grad() (Llama's and Qwen2's rotary tables are computed under no_grad).

`tidy` removes the checks and inlines the regions (outputs of a no-grad region are
detached, which is what no_grad gives them), so planning, code generation and the
generated rank scripts see the same flat graph.

`export_dynamic_batch` exports with the batch dimension symbolic, so the graph does not
depend on the batch it was captured with: a plan made at one batch size lowers at any
micro-batch size (shape arguments that hold the batch read it from `sym_size`).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

_CHECKS = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size",
           "_assert_async")


class ExportGraphError(ValueError):
    """Something in a torch.export graph that meshplan cannot flatten; names the op and module path."""


def _op_name(target: Any) -> str:
    packet = getattr(target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


def module_path_of(node: fx.Node) -> str:
    """The innermost module path of a node ("" for the top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    for prefix in ("L['self'].", "L__self__.", "self."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return path


def tidy(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove export's checks and inline set_grad_enabled regions, in place; returns `gm`."""
    graph = gm.graph
    for n in list(graph.nodes):
        if n.users:
            continue
        if n.op == "call_module" and n.target == "_guards_fn":
            graph.erase_node(n)
        elif n.op == "call_function" and _op_name(n.target) in _CHECKS:
            graph.erase_node(n)
    for n in list(graph.nodes):
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
            if n.target.name() == "wrap_with_set_grad_enabled":
                _inline_grad_region(gm, n)
            elif n.target.name() != "wrap_with_autocast":
                raise ExportGraphError(f"torch.export produced the higher-order op {n.target.name()} at "
                                       f"{module_path_of(n) or 'the top level'} (node {n.name!r}), which meshplan "
                                       "cannot flatten; write that part of forward() without it")
    for name, child in list(gm.named_children()):
        if isinstance(child, fx.GraphModule) and not any(
                n.op == "get_attr" and n.target == name for n in graph.nodes):
            gm.delete_submodule(name)
    graph.lint()
    gm.recompile()
    return gm


def _inline_grad_region(gm: fx.GraphModule, n: fx.Node) -> None:
    """Replace wrap_with_set_grad_enabled(enabled, submod, *args) by the sub-graph's nodes."""
    enabled, sub_node, *args = n.args
    sub = gm.get_submodule(str(sub_node.target))
    tidy(sub)
    graph = gm.graph
    env: dict[fx.Node, Any] = {}
    inputs = iter(args)
    outputs: list[Any] = []
    with graph.inserting_before(n):
        for s in sub.graph.nodes:
            if s.op == "placeholder":
                env[s] = next(inputs)
            elif s.op == "output":
                outputs = list(s.args[0]) if isinstance(s.args[0], (tuple, list)) else [s.args[0]]
            elif s.op == "get_attr":
                raise ExportGraphError(f"a no-grad region at {module_path_of(n) or 'the top level'} reads "
                                       f"{s.target!r} directly; meshplan cannot flatten it")
            else:
                env[s] = graph.node_copy(s, lambda a: env[a])
        outs = []
        for o in outputs:
            v = env[o] if isinstance(o, fx.Node) else o
            if not enabled and isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor):
                d = graph.call_function(torch.ops.aten.detach.default, (v,))
                d.meta = dict(v.meta)
                v = d
            outs.append(v)
    for u in list(n.users):
        if u.op == "call_function" and u.target is operator.getitem:
            u.replace_all_uses_with(outs[u.args[1]])
            graph.erase_node(u)
        else:
            raise ExportGraphError(f"node {u.name!r} reads the no-grad region {n.name!r} whole; meshplan cannot "
                                   "flatten it")
    graph.erase_node(n)
    if not sub_node.users:
        graph.erase_node(sub_node)


def export_dynamic_batch(model: torch.nn.Module, args: tuple, kwargs: dict, batch_dim: int, batch_size: int):
    """torch.export.export(strict=False) with the batch dimension of every input that has the
    batch's size marked dynamic (Dim.AUTO: export keeps it symbolic where the model allows).

    A batch of 1 is traced as a batch of 2 (export specializes sizes 0 and 1); the inputs
    here are shapes only (meta tensors or the user's example tensors).
    """
    trace_batch = max(batch_size, 2)

    def widen(x):
        if isinstance(x, torch.Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == batch_size \
                and trace_batch != batch_size:
            shape = list(x.shape)
            shape[batch_dim] = trace_batch
            return torch.zeros(shape, dtype=x.dtype, device=x.device)
        return x

    marked: list[bool] = []

    def spec(x):
        if isinstance(x, torch.Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == trace_batch:
            marked.append(True)
            return {batch_dim: torch.export.Dim.AUTO}
        return None

    ex_args, ex_kwargs = tree_map(widen, (tuple(args), dict(kwargs)))
    bound = inspect.signature(model.forward).bind(*ex_args, **ex_kwargs).arguments
    dyn = {name: tree_map(spec, value) for name, value in bound.items()}
    ep = torch.export.export(model, ex_args, ex_kwargs, dynamic_shapes=dyn if marked else None, strict=False)
    return tidy(ep.module())

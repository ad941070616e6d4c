"""Tidy a torch.export graph into one flat list of ATen calls, and export with a dynamic batch.

`ExportedProgram.module()` gives an fx GraphModule whose nodes are ATen ops carrying the
original model's module paths (`nn_module_stack`), plus a few export artifacts a rank
never needs:

* the input-shape guard `_guards_fn` and the `_assert_tensor_metadata` / `_assert_scalar`
  checks (they also bake the capture device into the graph);
* `wrap_with_set_grad_enabled` regions: a sub-graph run under torch.no_grad() or
  torch.enable_grad() (Llama's and Qwen2's rotary tables are computed under no_grad), and
  `wrap_with_autocast` regions that turn autocast off (the same tables, in transformers 4.x,
  captured on the CPU): their ops run as plain ops (under a 16-bit run's autocast, the tables
  are then computed in 16 bits, as a capture on the meta device, where the region vanishes,
  already has them);
* `flat_apply` of dynamo's ModIndex autograd function: indexing inside torch.vmap (the mask
  functions of transformers 4.x), which is `aten.index` in forward.

`tidy` removes the checks, inlines the regions (outputs of a no-grad region are
detached, which is what no_grad gives them) and writes the indexing as aten.index, so
planning, code generation and the generated rank scripts see the same flat graph.

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

from planner.graph.ops import module_path_of, op_base

_CHECKS = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size",
           "_assert_async")


class ExportGraphError(ValueError):
    """Something in a torch.export graph that meshplan cannot flatten; names the op and module path."""


def tidy(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove export's checks and inline set_grad_enabled regions, in place; returns `gm`."""
    graph = gm.graph
    for n in list(graph.nodes):
        if n.users:
            continue
        if n.op == "call_module" and n.target == "_guards_fn":
            graph.erase_node(n)
        elif n.op == "call_function" and op_base(n.target) in _CHECKS:
            graph.erase_node(n)
    for n in list(graph.nodes):
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
            if n.target.name() == "wrap_with_set_grad_enabled":
                _inline_region(gm, n, sub_at=1, detach=not n.args[0])
            elif n.target.name() == "wrap_with_autocast" and len(n.args) > 4 and n.args[2] is False:
                _inline_region(gm, n, sub_at=4, detach=False)   # autocast off: plain ops
            elif n.target.name() == "flat_apply" and _mod_index(gm, n) is not None:
                x, indices = _mod_index(gm, n)
                n.target, n.args, n.kwargs = torch.ops.aten.index.Tensor, (x, list(indices)), {}
            elif n.target.name() != "wrap_with_autocast":
                raise ExportGraphError(f"torch.export produced the higher-order op {n.target.name()} at "
                                       f"{module_path_of(n) or 'the top level'} (node {n.name!r}), which meshplan "
                                       "cannot flatten; write that part of forward() without it")
    _inline_constants(gm)
    for n in list(graph.nodes):   # what the rewrites left unread (flat_apply's TreeSpec constants)
        if n.op == "get_attr" and not n.users and not isinstance(_attr_of(gm, str(n.target)), torch.Tensor):
            graph.erase_node(n)
    for name, child in list(gm.named_children()):
        if isinstance(child, fx.GraphModule) and not any(
                n.op == "get_attr" and n.target == name for n in graph.nodes):
            gm.delete_submodule(name)
    graph.lint()
    gm.recompile()
    return gm


_INLINE_ELEMENTS = 1024


def _inline_constants(gm: fx.GraphModule) -> None:
    """Small tensors export lifted out of forward() (a `torch.tensor(...)` there) become literals:
    `torch.tensor(values, dtype=..., device=...)` in the graph, since the model holds no such
    attribute for a rank to read. (The device is written as the capture's; code generation makes it
    the run's.)"""
    state = {id(t) for t in (*gm.parameters(), *gm.buffers())}
    for n in list(gm.graph.nodes):
        if n.op != "get_attr":
            continue
        value = _attr_of(gm, str(n.target))
        if not isinstance(value, torch.Tensor) or id(value) in state or value.is_meta \
                or value.numel() > _INLINE_ELEMENTS or type(value) is not torch.Tensor:
            continue
        with gm.graph.inserting_before(n):
            lit = gm.graph.call_function(torch.tensor, (value.tolist(),),
                                         {"dtype": value.dtype, "device": torch.device("cpu")})
        lit.meta = dict(n.meta)
        n.replace_all_uses_with(lit)
        gm.graph.erase_node(n)


def _attr_of(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _mod_index(gm: fx.GraphModule, n: fx.Node):
    """(x, indices) when `n` is flat_apply of dynamo's ModIndex autograd function (transformers' vmapped
    mask functions index tensors through it; its forward is aten.index(x, indices)), else None."""
    from torch.utils._pytree import tree_unflatten

    specs = [getattr(gm, str(a.target), None) if isinstance(a, fx.Node) and a.op == "get_attr" else None
             for a in n.args[:2]]
    if specs[1] is None:
        return None
    try:
        args, kwargs = tree_unflatten(list(n.args[2:]), specs[1])
    except Exception:   # another structure: not the call this rewrites
        return None
    if kwargs or len(args) != 3 or not str(args[0]).endswith("_trace_wrapped_higher_order_op.ModIndex"):
        return None
    return args[1], args[2]


def _inline_region(gm: fx.GraphModule, n: fx.Node, sub_at: int, detach: bool) -> None:
    """Replace a region call (wrap_with_set_grad_enabled(enabled, submod, *args), or
    wrap_with_autocast(device, dtype, False, cache, submod, *args)) by its sub-graph's nodes;
    `detach`: its outputs take no gradient (a no-grad region)."""
    sub_node, args = n.args[sub_at], n.args[sub_at + 1:]
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
                raise ExportGraphError(f"a region at {module_path_of(n) or 'the top level'} reads "
                                       f"{s.target!r} directly; meshplan cannot flatten it")
            else:
                env[s] = graph.node_copy(s, lambda a: env[a])
        outs = []
        for o in outputs:
            v = env[o] if isinstance(o, fx.Node) else o
            if detach and isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor):
                d = graph.call_function(torch.ops.aten.detach.default, (v,))
                d.meta = dict(v.meta)
                v = d
            outs.append(v)
    for u in list(n.users):
        if u.op == "call_function" and u.target is operator.getitem:
            u.replace_all_uses_with(outs[u.args[1]])
            graph.erase_node(u)
        else:
            raise ExportGraphError(f"node {u.name!r} reads the region {n.name!r} whole; meshplan cannot "
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
    try:
        ep = torch.export.export(model, ex_args, ex_kwargs, dynamic_shapes=dyn if marked else None, strict=False)
    except Exception:
        if not any(t.is_meta for t in model.parameters()):
            raise
        # Some code cannot run on the meta device (torch.autocast(device_type="meta") in transformers
        # 4.x's rotary embeddings): export a copy whose weights are fake CPU tensors (no memory).
        fake, fake_args, fake_kwargs = _fake_cpu(model, ex_args, ex_kwargs)
        ep = torch.export.export(fake, fake_args, fake_kwargs, dynamic_shapes=dyn if marked else None, strict=False)
    gm = ep.module()
    _to_meta(gm)
    return tidy(gm)


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters, buffers and other tensor attributes are meta tensors of the
    same shapes and dtypes (ties kept: one tensor stays one), as if it had been built under
    `with torch.device("meta"):`. The model's own tensors are neither copied nor touched.

    Capture exports this twin rather than the model on its device: kernels report different
    strides on different devices (the CPU's attention returns a layout whose transpose is already
    contiguous, the meta kernel's is not), and code such as transformers' `.contiguous()` then
    traces to different graphs; on the twin, a model built on the CPU, on a GPU or on meta traces
    to one graph, and a plan made from any of them binds to all."""
    import copy

    memo: dict[int, object] = {}

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        m = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return torch.nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else m

    for mod in model.modules():
        tensors = [*mod._parameters.values(), *mod._buffers.values(),
                   *(v for v in vars(mod).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = t if t.is_meta else stand_in(t)
    keep = list(model.modules())   # the ids in memo stay those of live objects while deepcopy runs
    twin = copy.deepcopy(model, memo)
    del keep
    return twin


def _fake_cpu(model: torch.nn.Module, args: tuple, kwargs: dict):
    """A copy of a meta model, and of its inputs, with fake CPU tensors (torch's FakeTensorMode)."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = copy.deepcopy(model)
    with FakeTensorMode():
        for mod in fake.modules():
            for k, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[k] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                                            requires_grad=p.requires_grad)
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[k] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        fake_args, fake_kwargs = tree_map(
            lambda x: torch.zeros(x.shape, dtype=x.dtype, device="cpu") if isinstance(x, torch.Tensor) else x,
            (args, kwargs))
    return fake, fake_args, fake_kwargs


def _to_meta(gm: fx.GraphModule) -> None:
    """Every parameter and buffer of `gm` on the meta device (an export of fake tensors holds fakes),
    keeping tied names tied."""
    done: dict[int, torch.Tensor] = {}
    for mod in gm.modules():
        for store in (mod._parameters, mod._buffers):
            for k, t in list(store.items()):
                if t is None or t.is_meta:
                    continue
                if id(t) not in done:
                    m = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    done[id(t)] = torch.nn.Parameter(m, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else m
                store[k] = done[id(t)]

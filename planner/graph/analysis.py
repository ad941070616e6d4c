"""`planner.graph.analysis`: the one pass that turns a traced fx GraphModule (planner/graph/capture.py
traces it) into a ModelGraph.

Analysis runs every node once on meta tensors (no memory, no arithmetic):
shapes and dtypes come out of the run, forward FLOPs from
torch.utils.flop_counter attributed node by node, activations saved for
backward from autograd's saved-tensor hooks, and backward FLOPs from a small
forward+backward of each distinct node signature (repeated blocks are
counted once and reused). The user's model is never modified and, when it
lives on a real device, its weights are never touched: parameters are
replaced by meta stand-ins for the run.

The pass also builds the graph's layers (planner/graph/layers.py), branches (branches.py), random
ops (randomness.py) and fingerprint.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from planner.graph.branches import find_branches
from planner.graph.model import ModelGraph, OpInfo, TensorMeta
from planner.graph.layers import NodeView, find_layers
from planner.graph.randomness import SeededOps, random_ops
from planner.graph.replay import ForwardMemo
from planner.graph.replay import inputs as replay_inputs
from planner.graph.ops import classify, module_path_of, module_stack, target_name


@dataclass
class _State:
    """Mutable bookkeeping for one analysis pass (local, never global)."""

    meta_of: dict[int, torch.Tensor] = field(default_factory=dict)   # id(real tensor) -> meta stand-in
    keep: list = field(default_factory=list)                        # keeps ids unique while we run
    seen_params: set[int] = field(default_factory=set)
    param_ids: set[int] = field(default_factory=set)                 # ids of the meta stand-ins of parameters
    saved_ids: set[int] = field(default_factory=set)
    saved_order: list[int] = field(default_factory=list)             # saved_ids in the order autograd saved them
    saved_bytes: int = 0
    bwd_cache: dict[str, int] = field(default_factory=dict)
    memo: ForwardMemo = field(default_factory=ForwardMemo)           # repeated nodes run once
    seeded_of: dict = field(default_factory=dict)                    # memo key -> seeded ops its first run drew


def analyze(gm: torch.fx.GraphModule, model: nn.Module, method: str, meta_args: tuple,
             meta_kwargs: dict, batch_dim: int, batch_size: int) -> ModelGraph:
    """The ModelGraph of `gm`, traced from `model` by `method` ("fx" or "export"), run on the example inputs'
    meta stand-ins (`batch_size` samples along `batch_dim`). Raises NodeFailure naming the node that failed."""
    st = _State()
    env: dict[str, Any] = {}
    infos: list[OpInfo] = []
    views: list[NodeView] = []
    placeholders = _placeholder_values(gm, model, method, meta_args, meta_kwargs, batch_size)

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(base) not in st.param_ids and id(base) not in st.saved_ids:
            st.saved_ids.add(id(base))
            st.saved_order.append(id(base))
            st.keep.append(base)
            st.saved_bytes += base.numel() * base.element_size()
        return t

    counter = FlopCounterMode(display=False)
    seeded = SeededOps()           # the random draws of each node's run (planner/graph/randomness.py)
    streams: dict[str, tuple[str, ...]] = {}
    leaves: dict[str, nn.Module] = {}
    with torch.enable_grad(), counter, seeded, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for node in gm.graph.nodes:
            module = gm.get_submodule(node.target) if node.op == "call_module" else None
            if module is not None:
                leaves[node.name] = module
            seeded.take()   # what ran before this node (the last node's backward, run to count its FLOPs) is not its own
            try:
                value, params, fwd, saved, streams[node.name] = _run_once(node, gm, module, env, placeholders, st,
                                                                          counter, seeded)
            except Exception as e:
                raise NodeFailure(node, module, env, e) from e
            env[node.name] = value
            infos.append(_op_info(node, module, value, params, env, st, fwd, saved, gm))
            views.append(NodeView(name=node.name, op=node.op,
                                  users=tuple(u.name for u in node.users),
                                  owner=_owner(node), module_path=_module_path(node)))

    infos_t = tuple(infos)
    shared = shared_parameters(model)
    draws = random_ops(infos_t, leaves, streams)
    layers = find_layers(infos_t, views)
    branches = find_branches(infos_t, views)
    return ModelGraph(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        method=method, batch_dim=batch_dim, batch_size=batch_size,
        nodes=infos_t, layers=layers, branches=branches,
        fingerprint=_fingerprint(infos_t), module=gm, shared_params=tuple(g for g, _n in shared),
        shared_numel=tuple(n for _g, n in shared), random_ops=draws,
    )


def shared_parameters(model: nn.Module) -> list[tuple[tuple[str, ...], int]]:
    """(names, elements) of each parameter the model holds under several names (canonical first)."""
    names: dict[int, list[str]] = {}
    numel: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        numel[id(p)] = p.numel()
    return [(tuple(g), numel[k]) for k, g in names.items() if len(g) > 1]


class NodeFailure(Exception):
    """Running one node on meta tensors failed: usually inputs that do not fit the model."""

    def __init__(self, node, module, env, err):
        ins = []
        for n in node.all_input_nodes:
            v = env.get(n.name)
            if isinstance(v, torch.Tensor):
                ins.append(f"{n.name}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}")
        where = _module_path(node) or "the top-level forward"
        super().__init__(
            f"node {node.name!r} ({target_name(node, module)}) in {where} failed on inputs "
            f"[{', '.join(ins)}]: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        )


def _placeholder_values(gm, model, method, meta_args, meta_kwargs, batch_size) -> dict[str, Any]:
    """Values for the graph's placeholders, from the (meta) example inputs."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if method == "export":
        # export flattened the inputs; each placeholder records its fake value, whose batch
        # dimension is symbolic (export_dynamic_batch): it takes the example's batch here.
        out = {}
        for n in phs:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                shape = [batch_size if isinstance(d, torch.SymInt) else int(d) for d in v.shape]
                out[n.name] = torch.empty(shape, dtype=v.dtype, device="meta")
            else:
                out[n.name] = v
        return out
    bound = inspect.signature(model.forward).bind(*meta_args, **meta_kwargs).arguments
    out = {}
    for n in phs:
        name = str(n.target).lstrip("*")
        if name in bound:
            out[n.name] = bound[name]
        else:  # a specialised (concrete) argument: fx kept its default in args
            out[n.name] = n.args[0] if n.args else None
    return out


def _meta_param(t: torch.Tensor, st: _State) -> torch.Tensor:
    """A meta stand-in for a parameter or buffer; the same stand-in on every use (ties stay tied)."""
    m = st.meta_of.get(id(t))
    if m is None:
        m = torch.empty(t.shape, dtype=t.dtype, device="meta")
        if isinstance(t, nn.Parameter) and t.requires_grad:
            m.requires_grad_(True)
            st.param_ids.add(id(m))
        st.meta_of[id(t)] = m
        st.keep.append(t)
    return m


def _fetch_attr(gm: torch.fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _run_once(node, gm, module, env, placeholders, st: _State, counter: FlopCounterMode, seeded: SeededOps
              ) -> tuple[Any, list[tuple[str, torch.Tensor]], int, int, tuple[str, ...]]:
    """Run one node, or replay the run of an earlier node of the same signature (planner/graph/replay.py).
    Returns (value, [(param name, real param)] it owns, forward FLOPs, bytes it saved for backward,
    the random-drawing ATen ops it ran)."""
    key = ins = None
    if node.op in ("call_module", "call_function", "call_method") and node.target != "_guards_fn":
        args, kwargs = _node_args(node, env)
        state = [] if module is None else [_meta_param(v, st) for _k, v in
                                           (*module.named_parameters(), *module.named_buffers())]
        key = st.memo.key(node, module, args, kwargs, state, st.saved_ids, st.param_ids)
        ins = replay_inputs(args, kwargs, state)
        hit = st.memo.replay(key, ins, st.keep, st.saved_ids)
        if hit is not None:
            value, fwd, saved = hit
            params = [(f"{node.target}.{k}", v) for k, v in module.named_parameters()] if module is not None else []
            return value, params, fwd, saved, st.seeded_of.get(key, ())   # what the first run drew
    flops_before, saved_before, order_before = counter.get_total_flops(), st.saved_bytes, len(st.saved_order)
    value, params = _run(node, gm, module, env, placeholders, st)
    draws = seeded.take()
    fwd, saved = counter.get_total_flops() - flops_before, st.saved_bytes - saved_before
    if key is not None:
        st.memo.record(key, ins, value, fwd, saved, set(st.saved_order[order_before:]))
        st.seeded_of.setdefault(key, draws)
    return value, params, fwd, saved, draws


def _run(node, gm, module, env, placeholders, st) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Execute one node on meta values. Returns (value, [(param name, real param)] it owns)."""
    if node.op == "placeholder":
        return placeholders[node.name], []
    if node.op == "get_attr":
        obj = _fetch_attr(gm, node.target)
        if isinstance(obj, torch.Tensor):
            return _meta_param(obj, st), [(str(node.target), obj)] if isinstance(obj, nn.Parameter) else []
        return obj, []
    if node.op == "output":
        return torch.fx.node.map_arg(node.args[0], lambda n: env[n.name]), []
    args, kwargs = _node_args(node, env)
    if node.op == "call_module":
        if node.target == "_guards_fn":  # torch.export's input guard: nothing to cost
            return None, []
        params = list(module.named_parameters())
        state = {k: _meta_param(v, st) for k, v in module.named_parameters()}
        state.update({k: _meta_param(v, st) for k, v in module.named_buffers()})
        value = torch.func.functional_call(module, state, tuple(args), dict(kwargs))
        return value, [(f"{node.target}.{k}", v) for k, v in params]
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs), []
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return _run_higher_order(node.target, args, st), []
    return node.target(*args, **kwargs), []


def _run_higher_order(op, args: tuple, st: _State) -> Any:
    """Run torch.export's wrappers (set_grad_enabled, autocast) around a sub-graph on meta.

    Their sub-graphs bake in the export-time device, so they are interpreted
    node by node like the main graph instead of being called directly.
    """
    k = next((i for i, a in enumerate(args) if isinstance(a, torch.fx.GraphModule)), None)
    if k is None:
        raise NotImplementedError(f"higher-order op {op.name()} without a sub-graph is not supported")
    sub, sub_args = args[k], args[k + 1:]
    grad = args[0] if op.name() == "wrap_with_set_grad_enabled" else torch.is_grad_enabled()
    env: dict[str, Any] = {}
    inputs = iter(sub_args)
    with torch.set_grad_enabled(bool(grad)):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n.name] = next(inputs)
            elif n.op == "output":
                return torch.fx.node.map_arg(n.args[0], lambda m: env[m.name])
            else:
                module = sub.get_submodule(n.target) if n.op == "call_module" else None
                env[n.name], _ = _run(n, sub, module, env, {}, st)
    raise AssertionError("sub-graph without an output node")


def _node_args(node, env) -> tuple[tuple, dict]:
    """A node's arguments from the environment, with every device moved to meta.

    A graph exported from a model on a real device bakes that device into ops
    such as arange(device=...) and to(device=...); on meta they must stay on meta.
    """
    meta = torch.device("meta")

    def fix(x):
        return meta if isinstance(x, torch.device) else x

    args = tree_map(fix, torch.fx.node.map_arg(node.args, lambda n: env[n.name]))
    kwargs = tree_map(fix, torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name]))
    if isinstance(kwargs.get("device"), str):
        kwargs = {**kwargs, "device": meta}
    return tuple(args), dict(kwargs)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _tm(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))


def _op_info(node, module, value, params, env, st: _State, fwd_flops: int, saved: int, gm) -> OpInfo:
    outs = _tensors(value) if node.op != "output" else []
    in_nodes = node.all_input_nodes
    input_meta: list[TensorMeta] = []
    param_read = 0
    has_param_input = False
    for n in in_nodes:
        v = env.get(n.name)
        if n.op == "get_attr" and isinstance(v, torch.Tensor):
            param_read += v.numel() * v.element_size()
            has_param_input = has_param_input or id(v) in st.param_ids
        else:
            input_meta.extend(_tm(t) for t in _tensors(v))
    # Parameters: owned by call_module nodes, or by the first consumer of a get_attr.
    owned: list[tuple[str, torch.Tensor]] = list(params) if node.op == "call_module" else []
    if node.op not in ("get_attr", "call_module"):
        for n in in_nodes:
            if n.op == "get_attr":
                obj = _fetch_attr(gm, n.target)
                if isinstance(obj, nn.Parameter):
                    owned.append((str(n.target), obj))
    if node.op == "call_module":
        param_read += sum(p.numel() * p.element_size() for _, p in params)
        has_param_input = has_param_input or bool(params)
    names, count, nbytes = [], 0, 0
    for name, p in owned:
        if id(p) in st.seen_params:
            continue
        st.seen_params.add(id(p))
        names.append(name)
        count += p.numel()
        nbytes += p.numel() * p.element_size()
    out_meta = tuple(_tm(t) for t in outs)
    out_bytes = sum(m.nbytes for m in out_meta)
    kind = classify(node, module, has_param_input=has_param_input, output_is_tensor=bool(outs) or node.op == "output")
    requires_grad = any(t.requires_grad for t in outs)
    bwd = _bwd_flops(node, module, env, st, fwd_flops) if requires_grad and fwd_flops else 0
    return OpInfo(
        attrs=_attrs(node, module),
        name=node.name, op=node.op, target=target_name(node, module), kind=kind,
        module_path=_module_path(node), inputs=tuple(n.name for n in in_nodes),
        input_meta=tuple(input_meta), output_meta=out_meta,
        fwd_flops=int(fwd_flops), bwd_flops=int(bwd),
        param_count=count, param_bytes=nbytes, param_names=tuple(names),
        output_bytes=out_bytes, saved_bytes=int(saved),
        bytes_read=sum(m.nbytes for m in input_meta) + param_read, bytes_written=out_bytes,
        requires_grad=requires_grad,
    )


_MODULE_ATTRS = ("in_features", "out_features", "in_channels", "out_channels", "kernel_size", "stride",
                 "padding", "dilation", "groups", "p", "eps", "num_heads", "num_embeddings",
                 "embedding_dim", "output_size", "ceil_mode")


def _scalar(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    return isinstance(v, (tuple, list)) and all(isinstance(i, (bool, int, float)) for i in v)


def _attrs(node, module) -> tuple[tuple[str, Any], ...]:
    """The op's scalar settings: what later passes (halo widths, dropout traffic) need."""
    out: list[tuple[str, Any]] = []
    if node.op == "call_module":
        for name in _MODULE_ATTRS:
            v = getattr(module, name, None)
            if v is not None and _scalar(v):
                out.append((name, tuple(v) if isinstance(v, list) else v))
    elif node.op in ("call_function", "call_method"):
        for i, a in enumerate(node.args):
            if not isinstance(a, torch.fx.Node) and _scalar(a) and a is not None:
                out.append((f"arg{i}", tuple(a) if isinstance(a, list) else a))
        for k, v in node.kwargs.items():
            if not isinstance(v, torch.fx.Node) and _scalar(v):
                out.append((k, tuple(v) if isinstance(v, list) else v))
    return tuple(out)


def _bwd_flops(node, module, env, st: _State, fwd_flops: int) -> int:
    """FLOPs of this node's backward, from a forward+backward on fresh meta leaves.

    Memoized on the node's signature (target, module config, input shapes and
    which inputs need grad), so a model's repeated blocks cost one run each.
    """
    args, kwargs = _node_args(node, env)
    leaves_spec, treedef = tree_flatten((args, kwargs))
    key_parts = [node.op, target_name(node, module)]
    if module is not None:
        key_parts.append(repr(module))
        key_parts.extend(f"{k}{tuple(p.shape)}{p.requires_grad}" for k, p in module.named_parameters())
    for x in leaves_spec:
        key_parts.append(f"T{tuple(x.shape)}{x.dtype}{x.requires_grad}" if isinstance(x, torch.Tensor) else repr(x))
    key = "|".join(key_parts)
    if key in st.bwd_cache:
        return st.bwd_cache[key]

    def fresh(x):
        if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
            return torch.empty(x.shape, dtype=x.dtype, device="meta", requires_grad=True)
        return x

    leaves = [fresh(x) for x in leaves_spec]
    grad_leaves = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    # clone() so in-place ops (ReLU(inplace=True)) do not hit a leaf; clone's backward has no FLOPs.
    a, kw = treedef.unflatten([x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in leaves])
    with torch.enable_grad():
        if node.op == "call_module":
            p_state = {k: torch.empty(p.shape, dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
                       for k, p in module.named_parameters()}
            b_state = {k: torch.empty(b.shape, dtype=b.dtype, device="meta") for k, b in module.named_buffers()}
            grad_leaves += [p for p in p_state.values() if p.requires_grad]
            out = torch.func.functional_call(module, {**p_state, **b_state}, tuple(a), dict(kw))
        elif node.op == "call_method":
            out = getattr(a[0], node.target)(*a[1:], **kw)
        else:
            out = node.target(*a, **kw)
        outs = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
        if not outs or not grad_leaves:
            st.bwd_cache[key] = 0
            return 0
        counter = FlopCounterMode(display=False)
        with counter:
            torch.autograd.grad(outs, grad_leaves, grad_outputs=[torch.empty_like(o) for o in outs],
                                allow_unused=True)
    st.bwd_cache[key] = int(counter.get_total_flops())
    return st.bwd_cache[key]


# ---------------------------------------------------------------------------
# module paths and fingerprint


def _module_path(node) -> str:
    if node.op == "call_module":
        return str(node.target)
    return module_path_of(node)


_CONTAINERS = ("Sequential", "ModuleList", "ModuleDict")


def _owner(node) -> str:
    """The repeated block a node belongs to ("blocks.3"), else its innermost module.

    The shallowest module on the stack whose path ends in an index and which
    is not a container: transformer blocks, ResNet blocks, Sequential items.
    """
    stack = module_stack(node)
    if node.op == "call_module":
        stack = stack + [(str(node.target), "")]
    for path, cls in stack:
        if path and path.rsplit(".", 1)[-1].isdigit() and not cls.endswith(_CONTAINERS):
            return path
    return stack[-1][0] if stack else ""


def _fingerprint(nodes: tuple[OpInfo, ...]) -> str:
    """A hash of the graph's structure and parameters, independent of batch and sequence sizes."""
    h = hashlib.sha256()
    for n in nodes:
        h.update(json.dumps([n.name, n.op, n.target, n.kind, list(n.inputs), list(n.param_names),
                              n.param_count]).encode())
    h.update(str(sum(n.param_count for n in nodes)).encode())
    return h.hexdigest()

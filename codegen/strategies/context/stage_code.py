"""Context parallelism on the fx graph: every layer runs on this rank's chunks of each sequence.

A plan with context degree c cuts every sequence of T tokens into 2c chunks in the causal
load-balanced order (runtime/parallel/context/attention.py: rank k of the context group holds chunks k
and 2c-1-k). The captured graph is rewritten once, before the tensor-parallel split, so that the
stage code calls the stage's `context` attribute (runtime/parallel/context/strategy.py sets it) by name:

    take = context.take(idx, 1)                        a sequence input -> this rank's tokens (B, T/c)
    arange = context.positions(0, device=...)          torch.arange(T) -> their positions (T/c,)
    scaled_dot_product_attention = context.attention(q, k, v, causal=True, mode='ring')
                                                       attention over the whole sequence

Every other op works token by token, so it runs unchanged on T/c tokens; the view/reshape
constants that still hold T become T/c (codegen/local_shapes.py, with the sequence as the split
dimension of every value that carries it). A mask tensor the attention reads is evaluated once at
build time when it is computed from sizes alone (HF models build their causal mask from the
sequence length): if it is the causal triangle it becomes causal=True and its arithmetic is
dropped; any other mask (a parameter, a buffer, one that reads the inputs' values) is refused,
since a (T, T) mask does not follow the sequence's chunks.

The sequence is the dimension right after the batch dimension of the graph's inputs that have
one; every input that has it must agree on T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from codegen.local_shapes import ShapeRewriteError, rewrite_local, run_meta
from codegen.strategies.base import LoweringError
from planner.graph.model import ModelGraph
from planner.graph.ops import module_path_of, op_base
from runtime.materialize import CONTEXT
from runtime.program.shards import FeatureSplit
from runtime.vocab import OpKind

# scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
# grouped-query attention (fewer key/value heads) needs no flag of its own: context_attention reads the heads
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


@dataclass(frozen=True)
class ContextSpec:
    """What the rewrite needs: `degree` c ranks per sequence of `seq_len` tokens on dimension `dim`
    of the inputs (and targets) that carry it; `mode` the attention's exchange
    (runtime.vocab.ContextAttention's value: "ring" or "ulysses")."""

    degree: int
    seq_len: int
    dim: int
    mode: str

    @property
    def local_len(self) -> int:
        """Tokens per rank (two chunks of seq_len / 2c)."""
        return self.seq_len // self.degree


class MetaContext:
    """The stage's `context` attribute in the build's meta runs: this rank's shapes, no data."""

    def __init__(self, spec: ContextSpec):
        self.spec = spec

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.narrow(dim, 0, self.spec.local_len)

    def positions(self, start: int = 0, *, device=None) -> torch.Tensor:
        return torch.arange(self.spec.local_len, device="meta") + start

    def attention(self, q, k, v, *, causal: bool, mode: str, scale: float | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])


def context_spec(graph: ModelGraph, degree: int, mode: str) -> ContextSpec:
    """The sequence of `graph`'s inputs and the rewrite's settings; LoweringError when no input has a
    sequence, when the inputs disagree on its length, or when it does not cut into 2 x degree chunks."""
    dim = graph.batch_dim + 1
    lengths = {n.name: n.output_meta[0].shape[dim] for n in graph.nodes
               if n.op == "placeholder" and n.output_meta and len(n.output_meta[0].shape) > dim}
    if not lengths:
        raise LoweringError(f"context parallelism splits the sequence (dimension {dim} of the inputs), but no input "
                            "of the model has one; use context=1")
    if len(set(lengths.values())) > 1:
        raise LoweringError(f"context parallelism splits the sequence (dimension {dim} of the inputs), but the inputs "
                            f"disagree on its length: {lengths}; use context=1")
    seq_len = next(iter(lengths.values()))
    if seq_len % (2 * degree):
        raise LoweringError(f"context={degree} cuts every sequence into 2 x {degree} = {2 * degree} chunks (the causal "
                            f"load-balanced layout), but the sequence has {seq_len} tokens, which {2 * degree} does "
                            f"not divide; use a sequence length that is a multiple of {2 * degree} or another "
                            "context degree")
    return ContextSpec(degree, seq_len, dim, str(mode))


def context_graph(gm: fx.GraphModule, inputs: dict[str, Any], *, graph: ModelGraph,
                  spec: ContextSpec) -> tuple[fx.Graph, dict[str, Any]]:
    """(a copy of gm's graph rewritten for context parallelism, the meta stand-ins of the runtime
    attributes it reads) for codegen.strategies.tensor.split.apply_splits; `inputs`: placeholder name -> meta
    tensor of one micro-batch. LoweringError naming the node that cannot be rewritten."""
    full = run_meta(gm, gm.graph, inputs, {})
    kinds = {n.name: n.kind for n in graph.nodes}
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_after(placeholders[-1]):
        context = g.get_attr(CONTEXT)
    causal: dict[str, bool] = {}   # mask node -> whether it is the causal triangle (evaluated once)

    def is_causal_mask(m: fx.Node) -> bool:
        if m.name not in causal:
            causal[m.name] = _is_causal_triangle(m, spec, inputs)
        return causal[m.name]

    for n in list(g.nodes):   # first: a mask's arithmetic reads the whole sequence's sizes and positions
        if kinds.get(n.name) == OpKind.ATTENTION:
            _attention(g, n, context, spec, is_causal_mask)
    seq_inputs = [n for n in placeholders if _has_sequence(full[n.name], spec)]
    for n in reversed(seq_inputs):
        with g.inserting_after(context):
            take = g.call_method("take", (context, n, spec.dim))
        n.replace_all_uses_with(take, delete_user_cb=lambda user, take=take: user is not take)
    for n in list(g.nodes):
        if n.op == "call_function" and op_base(n.target) == "arange" and _has_sequence(full[n.name], spec, 0):
            _positions(g, n, context)
    attrs = {CONTEXT: MetaContext(spec)}
    splits = {name: (d, FeatureSplit((spec.seq_len,), 0)) for name, d in _sequence_dims(g, full, spec).items()}
    try:
        rewrite_local(gm, g, {}, splits, spec.degree, inputs, full, attrs)
    except ShapeRewriteError as e:
        raise LoweringError(f"context parallelism (each rank holds {spec.local_len} of {spec.seq_len} tokens): "
                            f"{e}") from None
    g.lint()
    return g, attrs


def _has_sequence(value, spec: ContextSpec, dim: int | None = None) -> bool:
    d = spec.dim if dim is None else dim
    return isinstance(value, torch.Tensor) and value.dim() > d and value.shape[d] == spec.seq_len \
        and (dim is None or value.dim() == 1)


def _where(n: fx.Node) -> str:
    return f"node {n.name!r} at {module_path_of(n) or 'the top level'}"


def _attention(g: fx.Graph, n: fx.Node, context: fx.Node, spec: ContextSpec,
               is_causal_mask: Callable[[fx.Node], bool]) -> None:
    """The attention node, in place (its name stays: the tensor-parallel split names it), as
    context.attention(q, k, v, causal=..., mode=...); a mask computed from sizes alone that is the
    causal triangle (as HF models build it) becomes causal=True and its arithmetic is dropped."""
    if n.op != "call_function" or op_base(n.target) != "scaled_dot_product_attention":
        raise LoweringError(f"context parallelism rewrites attention written as scaled_dot_product_attention, but "
                            f"{_where(n)} is {n.target if n.op != 'call_module' else 'a module'}; use "
                            "torch.nn.functional.scaled_dot_product_attention in the model, or context=1")
    args = dict(_SDPA_DEFAULTS)
    args.update(zip(_SDPA_ARGS, n.args))
    args.update(n.kwargs)
    mask = args["attn_mask"]
    if isinstance(mask, fx.Node) and not args["is_causal"] and is_causal_mask(mask):
        args["attn_mask"], args["is_causal"] = None, True
        n.args, n.kwargs = (args["query"], args["key"], args["value"]), {}
        _drop_unused(g, [mask])
    if args["attn_mask"] is not None:
        raise LoweringError(f"context parallelism cannot split the attention mask of {_where(n)} "
                            f"({mask.name if isinstance(mask, fx.Node) else mask!r}): a mask tensor built for the "
                            f"whole sequence of {spec.seq_len} tokens does not follow the sequence's chunks. Make "
                            "the attention causal through is_causal=True without a mask tensor, or use context=1")
    if isinstance(args["dropout_p"], fx.Node) or args["dropout_p"]:
        raise LoweringError(f"context parallelism runs attention without dropout, but {_where(n)} has "
                            f"dropout_p={args['dropout_p']}; set the model's attention dropout to 0, or use context=1")
    n.op, n.target = "call_method", "attention"
    n.args = (context, args["query"], args["key"], args["value"])
    n.kwargs = {"causal": bool(args["is_causal"]), "mode": spec.mode,
                **({"scale": args["scale"]} if args["scale"] is not None else {})}


def _positions(g: fx.Graph, n: fx.Node, context: fx.Node) -> None:
    """torch.arange(T) (or arange(start, start + T)), in place, as context.positions(start): the
    positions of this rank's tokens. The size arithmetic it read is dropped when nothing else reads it."""
    args = list(n.args)
    start, step = (0, 1) if len(args) < 2 else (args[0], args[2] if len(args) > 2 else n.kwargs.get("step", 1))
    if step != 1:
        raise LoweringError(f"context parallelism turns torch.arange over the sequence into this rank's positions, "
                            f"but {_where(n)} steps by {step}; use context=1")
    old = n.all_input_nodes
    device = n.kwargs.get("device")
    n.op, n.target = "call_method", "positions"
    n.args = (context, start)
    n.kwargs = {"device": device} if device is not None else {}
    _drop_unused(g, old)


def _drop_unused(g: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase `nodes` that nothing reads any more, and what only they read (placeholders stay)."""
    dead = [a for a in nodes if not a.users and a.op != "placeholder"]
    while dead:
        a = dead.pop()
        inputs = a.all_input_nodes
        g.erase_node(a)
        dead += [b for b in inputs if not b.users and b.op != "placeholder" and b not in dead]


# what a mask's arithmetic may read of an input: its sizes (and device, dtype) only
_SIZE_OPS = ("size", "sym_size")
_SIZE_ATTRS = ("shape", "device", "dtype")


def _is_causal_triangle(mask: fx.Node, spec: ContextSpec, inputs: dict[str, Any]) -> bool:
    """Whether `mask` is computed from sizes alone (no parameter, no input's values) and equals the
    causal triangle over the whole sequence: True (or 0.0) where a query may see a key at or before
    it, False (or below -1e30) elsewhere, broadcast over batch and heads. Evaluated once, on the CPU."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(x: fx.Node) -> bool:
        if x in seen:
            return True
        seen.add(x)
        if x.op in ("get_attr", "call_module"):
            return False
        for a in x.all_input_nodes:
            if a.op == "placeholder":
                if not (x.op in ("call_method", "call_function") and _base(x) in _SIZE_OPS
                        or _base(x) == "getattr" and x.args[1:2] and x.args[1] in _SIZE_ATTRS):
                    return False
            elif not visit(a):
                return False
        order.append(x)
        return True

    if not visit(mask):
        return False
    cpu = torch.device("cpu")

    def concrete(v):
        if isinstance(v, torch.device):
            return cpu
        if isinstance(v, torch.Tensor) and v.is_meta:   # an input: only its sizes are read
            return torch.zeros(v.shape, dtype=v.dtype)
        return v

    env: dict[str, Any] = {name: concrete(v) for name, v in inputs.items()}
    try:
        for x in order:
            args = fx.node.map_aggregate(fx.node.map_arg(x.args, lambda a: env[a.name]), concrete)
            kwargs = fx.node.map_aggregate(fx.node.map_arg(x.kwargs, lambda a: env[a.name]), concrete)
            env[x.name] = getattr(args[0], x.target)(*args[1:], **kwargs) if x.op == "call_method" \
                else x.target(*args, **kwargs)
    except Exception:   # arithmetic that does not run concretely: not a mask this rewrite knows
        return False
    m = env[mask.name]
    if not isinstance(m, torch.Tensor) or m.dim() < 2 or tuple(m.shape[-2:]) != (spec.seq_len, spec.seq_len):
        return False
    seen_keys = m if m.dtype == torch.bool else m == 0
    if m.dtype != torch.bool and not bool((m[~seen_keys] < -1e30).all()):
        return False
    return bool((seen_keys == torch.ones(spec.seq_len, spec.seq_len, dtype=torch.bool).tril()).all())


_RESHAPES = ("view", "reshape", "_unsafe_view", "flatten", "unflatten")


def _moved(n: fx.Node, dim: int, full: dict[str, Any]) -> int:
    """Where node `n` puts dimension `dim` of its first input: moved by a transpose or permute, shifted
    by an unsqueeze, found by its offset through a view, kept by any other op (token-wise ops keep
    the sequence where it was); -1 where it cannot be told."""
    base, x = _base(n), n.args[0] if n.args else None
    if not (isinstance(x, fx.Node) and isinstance(full.get(x.name), torch.Tensor)):
        return dim
    shape = full[x.name].shape
    ndim = len(shape)
    if base == "unsqueeze" and len(n.args) == 2:
        return dim + (dim >= int(n.args[1]) % (ndim + 1))
    out = full.get(n.name)
    if base in _RESHAPES and isinstance(out, torch.Tensor):   # the same elements before the dimension
        before = math.prod(shape[:dim])
        return next((k for k in range(out.dim()) if math.prod(out.shape[:k]) == before and out.shape[k] == shape[dim]),
                    -1)
    if base in ("transpose", "swapaxes") and len(n.args) == 3 and ndim:
        a, b = (int(d) % ndim for d in n.args[1:])
        return b if dim == a else a if dim == b else dim
    if base == "permute" and ndim:
        order = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        order = [int(d) % ndim for d in order]
        return order.index(dim) if dim in order else dim
    return dim


def _base(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_method" else op_base(n.target)


def _sequence_dims(g: fx.Graph, full: dict[str, Any], spec: ContextSpec) -> dict[str, int]:
    """Value -> its sequence dimension, for every value computed from this rank's tokens or positions:
    its one dimension of length T or, where a model size equals T, the one its input's sequence
    dimension moves to (_moved); LoweringError for a value where that does not decide (a (T, T) mask)."""
    reached: set[str] = set()
    out: dict[str, int] = {}
    for n in g.nodes:
        if n.op == "call_method" and n.target in ("take", "positions"):
            reached.add(n.name)
        elif not any(a.name in reached for a in n.all_input_nodes):
            continue
        reached.add(n.name)
        v = full.get(n.name)
        if not isinstance(v, torch.Tensor):
            continue
        dims = [d for d, s in enumerate(v.shape) if s == spec.seq_len]
        if len(dims) > 1:   # a model size equal to T: the dimension the sequence came in on decides
            came = {_moved(n, out[a.name], full) for a in n.all_input_nodes if a.name in out}
            hinted = [d for d in dims if d in came]
            dims = hinted if len(hinted) == 1 else dims
        if len(dims) > 1:
            raise LoweringError(f"context parallelism cannot split {_where(n)}: its shape {tuple(v.shape)} holds the "
                                f"sequence length {spec.seq_len} on several dimensions (a mask over the whole "
                                "sequence, or a model size equal to the sequence length); choose a sequence length "
                                "that differs from the model's other sizes, or use context=1")
        if dims:
            out[n.name] = dims[0]
    return out


__all__ = ["ContextSpec", "MetaContext", "context_graph", "context_spec"]

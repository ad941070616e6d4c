"""What torch.autocast does to a captured graph on a GPU: the dtype every value runs in, and the casts.

A graph is captured in fp32. Under `torch.autocast("cuda", dtype=bf16)` over fp32 parameters (how
meshplan's runtime and the torch target run mixed precision) each op runs in the dtype its autocast
category gives (PyTorch's "Automatic Mixed Precision" reference, "CUDA Ops that can autocast"):

* LOWER (linear, matmul, addmm, bmm, conv, scaled_dot_product_attention, ...): inputs cast to the 16-bit
  dtype, output 16-bit. Each fp32 input is a cast kernel (reads 4, writes 2 bytes an element); a weight's
  cast is cached for the autocast region (once per micro-batch forward) and kept for backward. In backward
  each cast's gradient is cast back to fp32 (reads 2, writes 4).
* FP32 (layer_norm, group_norm, softmax, log_softmax, the losses, pow, exp, log, rsqrt, sum, cumsum, ...):
  16-bit inputs cast to fp32 (a kernel each, reading 2 and writing 4 bytes an element; cast back in
  backward), output fp32.
* PROMOTE and every other op (add, mul, gelu, dropout, views, batch_norm, embedding): no cast kernel; ops of
  several float inputs compute in the widest (an fp32 residual plus a 16-bit branch is fp32, read as it
  is); one-input ops keep their input's dtype. In backward, the gradient of a 16-bit input of an op whose
  output is fp32 is cast to 16 bits by autograd (reads 4, writes 2).

An explicit `.to(dtype)` / `.float()` in the model keeps its target dtype.

Everything here is pure and duck-typed on the captured nodes (planner.graph OpInfo: name, kind, target,
inputs, input_meta, output_meta, param_count, attrs), so cost_models needs no planner import.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from runtime.vocab import OpKind

FLOAT32, LOW = "float32", "low"   # LOW: the autocast dtype (bfloat16 or float16), resolved by the caller
_FLOATS = ("float16", "bfloat16", "float32", "float64")

# ATen / torch names (last dotted part, lower case, underscores removed) by autocast category.
_LOWER = frozenset({"linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "addr", "mv",
                    "conv1d", "conv2d", "conv3d", "convolution", "convtranspose1d", "convtranspose2d",
                    "convtranspose3d", "prelu", "scaleddotproductattention", "chainmatmul", "multidot",
                    "conv1d", "conv2d", "conv3d"})
_FP32 = frozenset({"layernorm", "nativelayernorm", "groupnorm", "softmax", "logsoftmax", "softmin", "crossentropy",
                   "nllloss", "mseloss", "l1loss", "smoothl1loss", "binarycrossentropywithlogits", "kldiv",
                   "pow", "exp", "expm1", "log", "log10", "log1p", "log2", "reciprocal", "rsqrt", "sum", "prod",
                   "cumsum", "cumprod", "norm", "normalize", "dist", "cdist", "pdist", "softplus", "cosh", "sinh",
                   "tan", "acos", "asin", "erfinv", "renorm", "cosinesimilarity", "rmsnorm"})
_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "typeas", "type"})
# op kinds that are always LOWER or FP32 whatever their target's name
_KIND_LOWER = frozenset({OpKind.LINEAR, OpKind.MATMUL, OpKind.ATTENTION})
_KIND_FP32 = frozenset({OpKind.SOFTMAX, OpKind.LOSS})


class Category(StrEnum):
    LOWER = "lower"
    FP32 = "fp32"
    CAST = "cast"
    OTHER = "other"


def base_name(target: str) -> str:
    """'torch.nn.LayerNorm' / 'aten.native_layer_norm' -> 'layernorm' / 'nativelayernorm'."""
    return str(target).rsplit(".", 1)[-1].lower().replace("_", "")


def category(node) -> Category:
    """The autocast category of one captured node."""
    base = base_name(node.target)
    if node.kind == OpKind.CONV or node.kind in _KIND_LOWER or base in _LOWER:
        return Category.LOWER
    if node.kind in _KIND_FP32 or base in _FP32 or (node.kind == OpKind.NORM and "batchnorm" not in base):
        return Category.FP32
    if base in _CASTS:
        return Category.CAST
    return Category.OTHER


def _is_float(dtype: str) -> bool:
    return dtype in _FLOATS


def run_dtypes(nodes, autocast: bool) -> dict[str, str]:
    """Node name -> the dtype its (first) output runs in: FLOAT32, LOW (the autocast dtype) or the
    captured dtype of a non-float value. Without `autocast` every float value is LOW (a stack that runs
    16-bit parameters and activations, such as Megatron-LM) -- or, for an fp32 run, the caller does not
    ask."""
    out: dict[str, str] = {}
    for n in nodes:
        captured = n.output_meta[0].dtype if n.output_meta else ""
        if not _is_float(captured):
            out[n.name] = captured
            continue
        if not autocast:
            out[n.name] = LOW
            continue
        if n.kind in (OpKind.INPUT, OpKind.PARAM):
            out[n.name] = FLOAT32
            continue
        ins = [out[i] for i in n.inputs if i in out and _is_float_run(out[i])]
        cat = category(n)
        if cat is Category.LOWER:
            out[n.name] = LOW
        elif cat is Category.FP32:
            out[n.name] = FLOAT32
        elif cat is Category.CAST:
            target = _cast_target(n)
            out[n.name] = target if target else (ins[0] if ins else FLOAT32)
        elif n.kind == OpKind.EMBEDDING:
            out[n.name] = FLOAT32                      # reads its fp32 weight
        else:
            out[n.name] = FLOAT32 if (FLOAT32 in ins or not ins) else LOW
    return out


def _is_float_run(d: str) -> bool:
    return d in (FLOAT32, LOW)


def _cast_target(n) -> str | None:
    """The float dtype an explicit cast names (from its recorded arguments), or None."""
    base = base_name(n.target)
    if base == "float":
        return FLOAT32
    if base in ("half", "bfloat16"):
        return LOW
    for _, v in n.attrs:
        s = str(v).removeprefix("torch.")
        if s in ("float32", "float", "float64", "double"):
            return FLOAT32
        if s in ("bfloat16", "float16", "half"):
            return LOW
    return None


@dataclass(frozen=True)
class CastWork:
    """The cast kernels autocast adds around one node, for the captured batch (bytes are of the whole
    graph's batch; callers scale them): forward and backward bytes and kernel counts, and the bytes of
    16-bit weight copies kept for backward (memory, per micro-batch in flight)."""

    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    fwd_kernels: int = 0
    bwd_kernels: int = 0
    weight_copy_bytes: float = 0.0
    weight_cast_bytes: float = 0.0   # of fwd_bytes / bwd_bytes: the weights' share (not scaled by the batch)


def cast_work(node, dtypes: dict[str, str], by_name: dict, low_bytes: int = 2) -> CastWork:
    """The casts autocast adds for `node` (see module docstring); `dtypes` from run_dtypes(autocast=True),
    `by_name` the graph's nodes by name. Weights are the node's own parameters (a module call) and the
    parameter nodes it reads through views (an exported graph's addmm reads a transposed parameter)."""
    cat = category(node)
    if cat not in (Category.LOWER, Category.FP32):
        return _grad_cast(node, dtypes, by_name, low_bytes)
    want = LOW if cat is Category.LOWER else FLOAT32
    f = b = 0.0
    kf = kb = 0
    weight_elems = float(node.param_count) if cat is Category.LOWER else 0.0
    for name, meta in _float_inputs(node, by_name):
        root = _root(name, by_name)
        if by_name[root].kind == OpKind.PARAM:
            if cat is Category.LOWER:
                weight_elems += meta.numel
            continue
        if dtypes.get(name) == want or dtypes.get(name) not in (FLOAT32, LOW):
            continue
        per = 4 + low_bytes                       # read one width, write the other
        f += per * meta.numel
        kf += 1
        if node.requires_grad:
            b += per * meta.numel
            kb += 1
    weights = (4 + low_bytes) * weight_elems
    return CastWork(fwd_bytes=f + weights, bwd_bytes=b + (weights if node.requires_grad else 0.0),
                    fwd_kernels=kf + (1 if weight_elems else 0), bwd_kernels=kb + (1 if weight_elems else 0),
                    weight_copy_bytes=low_bytes * weight_elems, weight_cast_bytes=weights)


def _grad_cast(node, dtypes, by_name, low_bytes: int) -> CastWork:
    """An op whose output is fp32 reading 16-bit inputs (an fp32 residual plus a 16-bit branch): autograd
    casts the fp32 gradient of each 16-bit input down (reads 4, writes 2 bytes an element)."""
    if not node.requires_grad or dtypes.get(node.name) != FLOAT32:
        return CastWork()
    b, kb = 0.0, 0
    for name, meta in _float_inputs(node, by_name):
        if dtypes.get(name) == LOW and by_name[_root(name, by_name)].kind != OpKind.PARAM:
            b += (4 + low_bytes) * meta.numel
            kb += 1
    return CastWork(bwd_bytes=b, bwd_kernels=kb)


def _float_inputs(node, by_name):
    """(input node name, its TensorMeta) of the node's float tensor inputs, parameters included."""
    out = []
    for name in node.inputs:
        src = by_name.get(name)
        if src is None or not src.output_meta or src.kind == OpKind.SCALAR:
            continue
        meta = src.output_meta[0]
        if _is_float(meta.dtype):
            out.append((name, meta))
    return out


def _root(name: str, by_name: dict) -> str:
    """The node a view chain starts from (a parameter read through aten.t, a slice of an activation)."""
    seen = 0
    while by_name[name].kind == OpKind.VIEW and by_name[name].inputs and seen < 64:
        name = by_name[name].inputs[0]
        seen += 1
    return name

"""Activation bytes each op saves for its backward, as PyTorch and Megatron-LM keep them.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(MLSys'23, arXiv 2205.05198), section 4.1, count the bytes one GPT layer keeps for a
micro-batch of b sequences of s tokens, hidden size h, a heads, 16-bit activations:

    attention  11 s b h + 5 a s^2 b:  the QKV input 2sbh, Q and K 4sbh, the softmax output
               2as^2b, its dropout mask as^2b, the dropout output and V 2as^2b + 2sbh, the
               projection input 2sbh, the projection's dropout mask sbh;
    MLP        19 s b h:  the first linear's input 2sbh, the GeLU input 8sbh, the second
               linear's input 8sbh, the dropout mask sbh;
    LayerNorms  4 s b h:  each one's input.

giving s b h (34 + 5 a s / h) (eq. 1); with tensor parallelism t the tensors inside the
column -> row regions are split: s b h (10 + 24/t + 5 a s / (h t)) (eq. 2); sequence
parallelism splits the other 10 sbh too: s b h (34 + 5 a s / h) / t (eq. 4). Selective
recomputation drops the 5 a s^2 b term (QK^T, softmax, softmax dropout, attention over V)
and recomputes it in backward (section 5); full recomputation keeps only the layer input.

This module states, per op kind, which tensors the op keeps (`saved_by`) and adds up a
layer's (`layer_bytes`) counting each tensor once however many ops keep it. Widths are those
the stacks store: activations in the compute dtype, dropout masks 1 byte per element
(PyTorch's native_dropout keeps a bool mask), LayerNorm's mean and reciprocal standard
deviation and RMSNorm's reciprocal RMS in fp32 (apex / Transformer Engine / ATen keep them
in fp32 whatever the input dtype), flash attention's per-row log-sum-exp in fp32 (Dao et al.
2022, FlashAttention, algorithm 2: backward reads Q, K, V, O and the row statistics L).
The paper's formula leaves out the norm statistics (8 bytes a token per LayerNorm); they are
counted here and the unit test names them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from runtime.vocab import OpKind, element_bytes

# fp32 row statistics each norm keeps (see module docstring); BatchNorm keeps 2 per channel
NORM_STATS = {"layernorm": 2, "nativelayernorm": 2, "rmsnorm": 1, "fusedrmsnorm": 1}
_BATCH_NORMS = ("batchnorm", "nativebatchnorm")

# Elementwise ops by what their backward reads (ATen's derivatives.yaml): the input, the
# output, nothing, or every tensor operand (products and quotients of two activations).
_SAVES_INPUT = frozenset({"gelu", "silu", "mish", "softplus", "elu", "selu", "celu", "leakyrelu",
                          "hardswish", "hardsigmoid", "hardtanh", "relu6", "log", "log1p", "sin",
                          "cos", "erf", "pow", "square", "abs", "logsigmoid", "clamp"})
_SAVES_OUTPUT = frozenset({"relu", "sigmoid", "tanh", "exp", "sqrt", "rsqrt"})
_SAVES_NOTHING = frozenset({"add", "iadd", "sub", "isub", "rsub", "neg", "pad", "constantpadnd"})
_PRODUCTS = frozenset({"mul", "imul", "truediv", "div", "itruediv"})
_DROPOUTS = frozenset({"dropout", "nativedropout", "featuredropout", "dropout1d", "dropout2d",
                       "dropout3d", "alphadropout"})
_MASKED = frozenset({"maskedfill", "where"})   # keep their boolean mask (own dtype)


class SelectivePolicy(StrEnum):
    """What a stack's selective recomputation keeps of a transformer block (a layer with attention).

    ATTENTION_CORE: everything but the attention core (QK^T, softmax, its dropout, attention over V),
        which runs again in backward: Megatron-LM (Korthikanti et al. 2022, section 5) and meshplan's
        runtime (runtime/recompute.py).
    ALTERNATE_MATMULS: torchtitan's per-op selective checkpointing ("selective_ac_option = op",
        torchtitan/models/llama3/infra/parallelize.py _save_list): the block's input, the output of the
        attention kernel and of every other matrix product (the 1st, 3rd, ... aten.mm of the block);
        everything else, the other products included, runs again in backward.
    """

    ATTENTION_CORE = "attention-core"
    ALTERNATE_MATMULS = "alternate-matmuls"


class Width(StrEnum):
    """How wide one saved element is."""

    ACTIVATION = "activation"   # the run's compute dtype (2 bytes under bf16/fp16, 4 under fp32)
    MASK = "mask"               # 1 byte: a dropout mask
    FP32 = "fp32"               # 4 bytes: norm statistics, attention log-sum-exp
    NATIVE = "native"           # the tensor's own dtype (token ids, boolean masks)


@dataclass(frozen=True)
class TensorRef:
    """One tensor an op reads or writes, for the captured batch.

    key: the tensor's storage, as the name of the node that produced it with views resolved
    (q, k and v sliced from one QKV output share its key); shape: the view's own; storage:
    elements of the tensor the view keeps alive (0: the view's own, it is no view); split: what
    tensor parallelism divides it by on each rank (1: whole on every rank); score: an attention
    score or probability (between QK^T and attention over V).
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    split: float = 1.0
    score: bool = False
    storage: int = 0
    run_fp32: bool = False   # autocast runs this value in fp32 (a residual stream, a norm's output)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))


@dataclass(frozen=True)
class OpView:
    """What the activation rules need of one captured op.

    kind: the cost models' op kind (linear, norm, attention, ...); base: the called function
    or module class, lower case without underscores ("gelu", "layernorm", "dropout");
    inputs: its activation inputs in argument order (no parameters); output: its first
    output; dropout_p: its dropout probability (0 when none); split: the op's own
    tensor-parallel divisor (for ops without a rule); captured: the bytes autograd kept for
    it at capture, in the captured dtype (the rule for ops this module does not know).
    """

    name: str
    kind: OpKind
    base: str
    inputs: tuple[TensorRef, ...]
    output: TensorRef | None
    dropout_p: float = 0.0
    params: bool = False
    split: float = 1.0
    captured: int = 0


@dataclass(frozen=True)
class SavedTensor:
    """One tensor an op keeps for backward: `elements` of `width` (for the captured batch),
    divided by `split` on each tensor rank; `core`: part of the attention core that selective
    recomputation drops and recomputes."""

    key: str
    elements: float
    width: Width
    split: float = 1.0
    native_bytes: int = 0
    core: bool = False

    def nbytes(self, compute_bytes: int, sequence: int = 1) -> float:
        """Bytes on one rank: compute_bytes per ACTIVATION element; a tensor whole on every tensor
        rank is divided by `sequence` (the tensor degree under sequence parallelism, else 1)."""
        width = {Width.ACTIVATION: compute_bytes, Width.MASK: 1, Width.FP32: 4,
                 Width.NATIVE: self.native_bytes}[self.width]
        return self.elements * width / (self.split if self.split > 1 else sequence)


def normalize(name: str) -> str:
    """'torch.nn.LayerNorm' / 'aten.native_layer_norm' / 'leaky_relu' -> 'layernorm' / 'nativelayernorm' /
    'leakyrelu': the last dotted part, lower case, without underscores."""
    return name.rsplit(".", 1)[-1].lower().replace("_", "")


def keep(t: TensorRef, core: bool = False) -> SavedTensor:
    """Keep tensor `t` and the storage it views (an activation in the compute dtype, in fp32 where autocast
    runs it in fp32, or its own dtype if not a float)."""
    n = t.storage or t.elements
    if t.is_float:
        return SavedTensor(t.key, n, Width.FP32 if t.run_fp32 else Width.ACTIVATION, t.split, core=core)
    return SavedTensor(t.key, n, Width.NATIVE, t.split, element_bytes(t.dtype), core=core)


def _keep_cast(t: TensorRef, core: bool = False) -> SavedTensor:
    """What an autocast-lowered op (linear, matmul, conv, attention) keeps of its input `t`: under autocast
    an fp32 input is cast to the 16-bit dtype and the op keeps that copy, a tensor of its own."""
    if t.is_float and t.run_fp32:
        return SavedTensor(f"{t.key}@16bit", t.elements, Width.ACTIVATION, t.split, core=core)
    return keep(t, core)


def saved_by(op: OpView, fused_attention: bool = True) -> tuple[SavedTensor, ...]:
    """The tensors `op` keeps for its backward (see module docstring)."""
    floats = [t for t in op.inputs if t.is_float]
    kind = op.kind
    if kind in (OpKind.LINEAR, OpKind.CONV):
        # grad of the weight reads the input (the weight itself is a parameter, not counted)
        return (_keep_cast(op.inputs[0]),) if op.inputs else ()
    if kind == OpKind.MATMUL:
        return tuple(_keep_cast(t, core=t.score) for t in floats)
    if kind == OpKind.NORM:
        return _norm(op)
    if kind == OpKind.SOFTMAX:
        return (keep(op.output, core=op.output.score),) if op.output is not None else ()
    if kind == OpKind.ATTENTION:
        return _attention(op, fused_attention)
    if kind == OpKind.EMBEDDING:
        return tuple(keep(t) for t in op.inputs if not t.is_float)   # the token ids
    if kind in (OpKind.VIEW, OpKind.CONCAT, OpKind.INPUT, OpKind.OUTPUT, OpKind.PARAM, OpKind.SCALAR):
        return ()
    if kind == OpKind.ELEMENTWISE:
        rule = _elementwise(op, floats)
        if rule is not None:
            return rule
    return _captured(op)


def _norm(op: OpView) -> tuple[SavedTensor, ...]:
    x = op.inputs[0]
    out = [keep(x)]
    if op.base in NORM_STATS and x.shape:
        rows = x.elements // max(x.shape[-1], 1)
        out.append(SavedTensor(f"{op.name}.stats", NORM_STATS[op.base] * rows, Width.FP32, x.split))
    elif op.base in _BATCH_NORMS and len(x.shape) >= 2:
        out.append(SavedTensor(f"{op.name}.stats", 2 * x.shape[1], Width.FP32, x.split))
    else:
        return _captured(op)
    return tuple(out)


def _attention(op: OpView, fused: bool) -> tuple[SavedTensor, ...]:
    """q, k, v (the inputs, kept by the recomputed region too) and the output; fused kernels add an
    fp32 log-sum-exp per query row, unfused ones the probabilities, their dropout mask and the
    dropout output (Korthikanti et al. 2022, section 4.1)."""
    kept = [_keep_cast(t) for t in op.inputs if t.is_float]
    if op.output is None:
        return tuple(kept)
    kept.append(keep(op.output, core=True))
    q = op.inputs[0] if op.inputs else None
    if q is None or len(q.shape) != 4 or len(op.inputs) < 2 or len(op.inputs[1].shape) != 4:
        return tuple(kept)
    b, h, tq, _ = q.shape
    if fused:
        kept.append(SavedTensor(f"{op.name}.lse", b * h * tq, Width.FP32, q.split, core=True))
        return tuple(kept)
    scores = b * h * tq * op.inputs[1].shape[2]
    kept.append(SavedTensor(f"{op.name}.probs", scores, Width.ACTIVATION, q.split, core=True))
    if op.dropout_p > 0:
        kept.append(SavedTensor(f"{op.name}.mask", scores, Width.MASK, q.split, core=True))
        kept.append(SavedTensor(f"{op.name}.dropped", scores, Width.ACTIVATION, q.split, core=True))
    return tuple(kept)


def _elementwise(op: OpView, floats: list[TensorRef]) -> tuple[SavedTensor, ...] | None:
    """The rule for a known elementwise op, or None (the captured bytes then stand)."""
    base = op.base
    if base in _DROPOUTS:
        if op.dropout_p <= 0 or not floats:
            return ()
        x = floats[0]
        return (SavedTensor(f"{op.name}.mask", x.elements, Width.MASK, x.split, core=x.score),)
    if base in _SAVES_NOTHING:
        return ()
    if base in _SAVES_INPUT and floats:
        return (keep(floats[0], core=floats[0].score),)
    if base in _SAVES_OUTPUT and op.output is not None:
        return (keep(op.output, core=op.output.score),)
    if base in _PRODUCTS:
        # each operand's gradient reads the other: times a constant nothing is kept
        return tuple(keep(t, core=t.score) for t in floats) if len(floats) > 1 or op.params else ()
    if base in _MASKED:
        return tuple(keep(t, core=t.score) for t in op.inputs if not t.is_float)
    return None


def _captured(op: OpView) -> tuple[SavedTensor, ...]:
    """An op without a rule keeps what autograd kept at capture, scaled to the compute dtype when its
    output is a float."""
    if not op.captured:
        return ()
    out = op.output
    if out is not None and out.is_float:
        return (SavedTensor(f"{op.name}.captured", op.captured / element_bytes(out.dtype),
                            Width.ACTIVATION, op.split),)
    return (SavedTensor(f"{op.name}.captured", op.captured, Width.NATIVE, op.split, 1),)


@dataclass(frozen=True)
class LayerBytes:
    """A layer's saved activations on one rank for one micro-batch, in bytes: `kept` stays until
    its backward under selective (or no) recomputation, `core` is the attention core selective
    recomputation drops (0 unless asked), `total` what no recomputation keeps."""

    kept: float
    core: float

    @property
    def total(self) -> float:
        return self.kept + self.core


def layer_bytes(saved: list[SavedTensor], compute_bytes: int, sequence: int = 1, *,
                selective: bool = False) -> LayerBytes:
    """Add up a layer's saved tensors, each key once: with `selective`, tensors that only the
    attention core keeps are dropped (counted in `core`); a tensor another op also keeps stays."""
    first: dict[str, SavedTensor] = {}
    core: dict[str, bool] = {}
    for s in saved:
        first.setdefault(s.key, s)
        core[s.key] = core.get(s.key, True) and s.core
    kept = dropped = 0.0
    for key, s in first.items():
        nbytes = s.nbytes(compute_bytes, sequence)
        if selective and core[key]:
            dropped += nbytes
        else:
            kept += nbytes
    return LayerBytes(kept=kept, core=dropped)

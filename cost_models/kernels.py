"""What one captured op costs on a GPU, priced as the kernels it launches.

* Linear layers and batched matmuls: GEMMs priced by shape (cost_models/gemm.py); the
  backward is the input-gradient and the weight-gradient GEMM, each with its own shape.
* Attention, fused: the FlashAttention-2 kernel (Dao 2023, arXiv 2307.08691). It computes
  4 B H Tq Tk D FLOPs forward, half of them under a causal mask (blocks above the diagonal
  are skipped), and 2.5x that backward (5 matmuls instead of 2: the scores are recomputed),
  the paper's own counting (section 4.1). Its rate: up to 230 TFLOP/s forward on an A100,
  73% of the 312 TFLOP/s peak (section 4), "50-73%" over head dims 64/128 and sequences
  512-16k (abstract). Here that is ATTENTION_SHARE of the device's large-GEMM rate (0.73 /
  0.80), lowered for short sequences and small head dims (see flash_efficiency).
* Attention, unfused (`fused_attention=False`): Q K^T and P V as batched GEMMs by shape, with
  the softmax and dropout as memory passes over the (B, H, Tq, Tk) scores, all one after the
  other; the backward's four GEMMs and the softmax/dropout backward likewise.
* Elementwise, norm and softmax ops: memory-bound passes over every operand they read and
  write, in the compute dtype (pass_bytes).

Every kernel is cost_models/compute.op_time's roofline (FLOP side or byte side, whichever is
longer) plus the per-kernel overhead. CPUs are not priced here (their calibrated rates and
per-op overheads are measured whole, cost_models/compute.Efficiency).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.compute import Efficiency, op_time
from cost_models.gemm import GemmShape, aligned, shape_efficiency
from cost_models.gpu_costs import GpuCosts
from cost_models.op_curves import node_family
from runtime.vocab import DType, OpKind, ShardRole, element_bytes

# FlashAttention-2's best forward rate over the large-GEMM rate: 230 TFLOP/s = 0.73 of the
# A100's peak (Dao 2023, section 4) over Efficiency.matmul's 0.80 (cost_models/compute.py).
# The same share on an H100 is what a Hopper-tuned kernel reaches: FlashAttention-3 (Shah et
# al. 2024, arXiv 2407.08608, abstract) up to 740 TFLOP/s in fp16, 75% of the 989 peak;
# FlashAttention-2 itself, without Hopper instructions, reached 335 (Dao 2023, section 4.1).
ATTENTION_SHARE = 0.73 / 0.80
# Backward rate over the forward rate. ASSUMPTION: the paper's backward curves (its Figure 6)
# sit below the forward ones (Figure 5), and its text gives no number; 0.85 puts the backward of
# a long, head-dim-128 sequence near 0.62 of the A100 peak.
ATTENTION_BACKWARD_SHARE = 0.85
# FlashAttention-2 works on {64, 128} x {64, 128} blocks of queries x keys (section 3.3).
ATTENTION_BLOCK = 128
# Head dims at which the per-score softmax work (exp, max, rescale: non-matmul FLOPs, 16x dearer
# than tensor-core ones on an A100, section 3.1) equals the 4 D matmul FLOPs per score element.
# ASSUMPTION, set so head dim 64 runs at 0.9 of head dim 128's rate (the paper's Figures 4-6
# show head dim 128 faster than 64 at every length; the text gives no ratio).
HEAD_DIM_FILL = 16.0
# A dropout keeps its mask as one byte per element (torch.native_dropout's bool mask).
MASK_BYTES = 1
# LayerNorm/RMSNorm keep mean and reciprocal standard deviation per row, in fp32.
NORM_STATS_BYTES = 8


@dataclass(frozen=True)
class AttentionShape:
    """Per-rank attention: `batch` x `heads` of (tq x d) queries against (tk x d) keys/values."""

    batch: int
    heads: int
    tq: int
    tk: int
    head_dim: int
    causal: bool = False
    dropout: bool = False

    @property
    def full_flops(self) -> float:
        """Forward FLOPs of the two matmuls over the whole (tq x tk) score matrix."""
        return 4.0 * self.batch * self.heads * self.tq * self.tk * self.head_dim

    @property
    def computed_fraction(self) -> float:
        """Share of the score blocks a flash kernel computes: those on or below the diagonal
        under a causal mask ((n + 1) / 2n of n x n blocks), all of them without one."""
        if not self.causal:
            return 1.0
        n = math.ceil(max(self.tq, self.tk) / ATTENTION_BLOCK)
        return (n + 1) / (2 * n)


@dataclass(frozen=True)
class Gpu:
    """What prices a kernel: peak FLOP/s of the compute dtype, memory bandwidth (bytes/s),
    SM count, the efficiencies, bytes per element of the compute dtype, and the device's
    GpuCosts (the GEMM shape model's constants, alignment, attention, norm and softmax
    bandwidth shares; cost_models/gpu_costs.py)."""

    peak: float
    bandwidth: float
    units: int
    eff: Efficiency
    elem_bytes: int
    costs: GpuCosts = GpuCosts()

    def gemm(self, shape: GemmShape, nbytes: float, backward: bool = False, *, elem_bytes: int | None = None,
             peak: float | None = None) -> float:
        """Seconds of one GEMM kernel moving `nbytes` (operands of `elem_bytes`, default the compute dtype's,
        at `peak` FLOP/s, default the compute dtype's): the shape model's efficiency, and the misaligned
        kernels' rate where a dimension is not a multiple of 16 bytes."""
        c = self.costs
        se = shape_efficiency(shape, self.units, c.gemm_tile_load, c.gemm_k_fill)
        if self.units > 0 and not aligned(shape, elem_bytes or self.elem_bytes):
            se *= c.gemm_misaligned
        return op_time(OpKind.MATMUL, shape.flops, nbytes, peak or self.peak, self.bandwidth, self.eff,
                       shape_efficiency=se, backward=backward)

    def stream(self, kind: OpKind | str, nbytes: float, backward: bool = False, kernels: int = 1) -> float:
        """Seconds of `kernels` memory-bound kernels moving `nbytes` in all: norms, softmax-family kernels and
        dtype-converting copies ("cast") at their own share of the bandwidth (GpuCosts.norm_efficiency,
        softmax_efficiency, cast_efficiency), the rest at the streaming share (Efficiency.memory). `kind` is
        an op kind, or "cast": autocast's copies belong to no captured node, so they have no OpKind."""
        share = {OpKind.NORM: self.costs.norm_efficiency, OpKind.SOFTMAX: self.costs.softmax_efficiency,
                 "cast": self.costs.cast_efficiency}.get(kind)
        memory = self.eff.memory * (share / self.costs.stream_efficiency if share else 1.0)
        return nbytes / (self.bandwidth * memory) + self.eff.overhead(kind, kernels, backward)

    @property
    def kernel_gap(self) -> float:
        """Device seconds one more kernel adds (Efficiency.kernel_overhead)."""
        return self.eff.kernel_overhead


def flash_efficiency(shape: AttentionShape, costs: GpuCosts = GpuCosts()) -> float:
    """Rate of a FlashAttention-2 forward over its best (long sequence, head dim 128), <= 1.

    Each query block sweeps all key blocks; loading it and writing its output costs about one
    more key block (`costs.attention_block` keys, ATTENTION_BLOCK by default), so a sweep of tk
    keys runs tk / (tk + block) of the long-sequence rate. The softmax work per score element is
    fixed while the matmul work grows with the head dim: d / (d + fill), relative to head dim 128
    (`costs.attention_head_dim_fill`, HEAD_DIM_FILL by default).
    """
    d, fill = shape.head_dim, costs.attention_head_dim_fill
    seq = shape.tk / (shape.tk + costs.attention_block)
    dim = (d / (d + fill)) * ((128 + fill) / 128)
    return min(seq * dim, 1.0)


def fused_attention_seconds(shape: AttentionShape, gpu: Gpu, nbytes: float) -> tuple[float, float]:
    """(forward s, backward s) of the flash-attention kernels: FLOPs of the computed blocks at the
    flash rate; `nbytes` the forward's q, k, v and output (the backward also reads the output
    gradient and writes q, k, v gradients: twice that)."""
    flops = shape.full_flops * shape.computed_fraction
    c = gpu.costs
    rate = c.attention_share * flash_efficiency(shape, c)
    f = op_time(OpKind.ATTENTION, flops, nbytes, gpu.peak, gpu.bandwidth, gpu.eff, shape_efficiency=rate)
    # backward: the main kernel plus the small one that forms rowsum(dO * O) first
    b = op_time(OpKind.ATTENTION, 2.5 * flops, 2 * nbytes, gpu.peak, gpu.bandwidth, gpu.eff, kernels=2,
                shape_efficiency=rate * c.attention_backward_share, backward=True)
    return f, b


def unfused_attention_seconds(shape: AttentionShape, gpu: Gpu) -> tuple[float, float]:
    """(forward s, backward s) of attention as separate kernels over materialized scores.

    Forward: S = Q K^T (writes the scores), softmax (reads and writes them), dropout (reads,
    writes, and writes a 1-byte mask), O = P V (reads them): 4 passes over the scores, 2 more
    and the mask with dropout. Backward: dP = dO V^T (writes), dropout backward (reads dP and
    the mask, writes), softmax backward (reads P and dP, writes dS), dV = P^T dO, dQ = dS K and
    dK = dS^T Q (each reads a score-sized operand): 7 passes, 2 more and the mask with dropout.
    The GEMMs run over the whole score matrix: an unfused kernel masks, it does not skip.
    """
    e = gpu.elem_bytes
    bh, tq, tk, d = shape.batch * shape.heads, shape.tq, shape.tk, shape.head_dim
    s = bh * tq * tk * e
    q, kv = bh * tq * d * e, bh * tk * d * e
    drop = (2 * s + s * MASK_BYTES / e) if shape.dropout else 0.0
    f = (gpu.gemm(GemmShape(tq, tk, d, bh), q + kv + s) + gpu.stream(OpKind.SOFTMAX, 2 * s)
         + (gpu.stream(OpKind.ELEMENTWISE, drop) if drop else 0.0) + gpu.gemm(GemmShape(tq, d, tk, bh), s + kv + q))
    b = (gpu.gemm(GemmShape(tq, tk, d, bh), q + kv + s, True)             # dP = dO V^T
         + (gpu.stream(OpKind.ELEMENTWISE, drop, True) if drop else 0.0)
         + gpu.stream(OpKind.SOFTMAX, 3 * s, True)                          # dS from P and dP
         + gpu.gemm(GemmShape(tk, d, tq, bh), s + q + kv, True)             # dV = P^T dO
         + gpu.gemm(GemmShape(tq, d, tk, bh), s + kv + q, True)             # dQ = dS K
         + gpu.gemm(GemmShape(tk, d, tq, bh), s + q + kv, True))            # dK = dS^T Q
    return f, b


def pass_bytes(family: str, inputs: float, output: float, elem_bytes: int, rows: float = 0.0,
               params: float = 0.0) -> tuple[float, float]:
    """(forward bytes, backward bytes) a memory-bound op moves.

    `inputs`: bytes of its activation inputs; `output`: bytes of its output (`elem_bytes` per
    element); `rows`: rows a norm keeps fp32 statistics of; `params`: bytes of the weights it
    reads (their gradients are written in the backward). Families:

    * "norm" (LayerNorm/RMSNorm/BatchNorm): reads x (and the weights), writes y and per-row
      stats; backward reads x, dy, the stats and the weights, writes dx and the weight grads;
    * "softmax": reads x, writes y; backward reads y and dy, writes dx;
    * "dropout": reads x, writes y and a 1-byte mask; backward reads dy and the mask, writes dx;
    * "identity" (dropout with p = 0): returns its input, moves nothing;
    * "add" (add/sub): reads both, writes y; backward: the gradient passes through both ways
      as the same tensor, and where the two branches meet one is added into the other: 3 passes;
    * "mul" (mul/div): backward reads dy and both inputs, writes both gradients;
    * "unary" (GELU, ReLU, ...): reads x, writes y; backward reads x and dy, writes dx.
    """
    stats = rows * NORM_STATS_BYTES
    if family == "norm":
        return inputs + output + stats + params, 2 * inputs + output + stats + 2 * params
    if family == "softmax":
        return inputs + output, 3 * output
    if family == "dropout":
        mask = output / elem_bytes * MASK_BYTES
        return inputs + output + mask, 2 * output + mask
    if family == "identity":
        return 0.0, 0.0
    if family == "add":
        return inputs + output, 3 * output
    if family == "mul":
        return inputs + output, output + 2 * inputs
    return inputs + output, 2 * inputs + output


def node_seconds(node, gpu: Gpu, *, role: str, share: float, div: float,
                 fused_attention: bool, widths: tuple[tuple[int, ...], int] | None = None,
                 pad_outputs: int = 1) -> tuple[float, float] | None:
    """(forward s, backward s) of one captured node (planner.graph OpInfo: kind, target, attrs,
    input_meta, output_meta, fwd_flops, bwd_flops, param_count) on one rank, or None for kinds
    priced elsewhere (convolutions, embeddings, pools, losses, ...).

    `share`: the micro-batch over the captured batch; `role`: its tensor-parallel split role
    ("replicate" when whole); `div`: what the split divides by (below the degree when padded).
    `widths`: (bytes per element of each input in input_meta, of the output) as the run holds them
    (cost_models/autocast.py: an fp32 residual under autocast); default the compute dtype's for floats.
    `pad_outputs`: a linear's output features on this rank are padded to a multiple of this (a vocabulary
    padded for aligned GEMMs, runtime/execution.py vocab_multiple).
    """
    if not node.output_meta:
        return None
    if node.kind == OpKind.LINEAR:
        return _linear_seconds(node, gpu, role, share, div, pad_outputs)
    if node.kind == OpKind.MATMUL:
        return _matmul_seconds(node, gpu, share, div)
    if node.kind == OpKind.ATTENTION:
        shape = _attention_shape(node, share, div)
        if shape is None:
            return None
        if not fused_attention:
            return unfused_attention_seconds(shape, gpu)
        e = gpu.elem_bytes
        nbytes = (2 * shape.tq * shape.heads + 2 * shape.tk * _kv_heads(node, div)) * shape.batch * shape.head_dim * e
        return fused_attention_seconds(shape, gpu, nbytes)
    family = _pass_family(node)
    if family is None:
        return None
    e, per_rank = gpu.elem_bytes, share / div
    out = node.output_meta[0]
    if widths is not None and len(widths[0]) == len(node.input_meta):
        inputs = sum(m.numel * w for m, w in zip(node.input_meta, widths[0])) * per_rank
        output = out.numel * widths[1] * per_rank
    else:
        inputs = sum(m.numel * _bytes_per(m, e) for m in node.input_meta) * per_rank
        output = out.numel * _bytes_per(out, e) * per_rank
    rows = out.numel / out.shape[-1] * per_rank if family == "norm" and len(out.shape) > 1 else 0.0
    f_bytes, b_bytes = pass_bytes(family, inputs, output, e, rows, node.param_count * e / div)
    kind = OpKind.NORM if family == "norm" else OpKind.ELEMENTWISE
    f = gpu.stream(kind, f_bytes)
    # a norm's backward is two kernels: the input gradient and the weight gradients
    b = gpu.stream(kind, b_bytes, True, kernels=2 if node.param_count else 1)
    return f, b


def _linear_seconds(node, gpu: Gpu, role: str, share: float, div: float,
                    pad_outputs: int = 1) -> tuple[float, float] | None:
    """A linear layer: y (m x n) = x (m x k) W^T; backward dx = dy W (m x k, inner n) and, when
    it has weights, dW = dy^T x (n x k, inner m)."""
    if not node.input_meta:
        return None
    n_out, k = node.output_meta[0].shape[-1], node.input_meta[0].shape[-1]
    m = _whole(node.output_meta[0].numel / max(n_out, 1) * share)
    if role in (ShardRole.COLUMN, ShardRole.COLUMN_OUT):
        n_out = n_out / div
    elif role == ShardRole.ROW:
        k = k / div
    n, k = _whole(n_out), _whole(k)
    n = -(-n // pad_outputs) * pad_outputs
    e = gpu.elem_bytes
    nbytes = (m * k + k * n + m * n) * e
    f = gpu.gemm(GemmShape(m, n, k), nbytes)
    grads = []
    if node.bwd_flops > 1.5 * node.fwd_flops or not node.param_count:
        grads.append(GemmShape(m, k, n))
    if node.param_count:
        grads.append(GemmShape(n, k, m))
    b = sum(gpu.gemm(g, nbytes, backward=True) for g in grads)
    return f, b


def _matmul_seconds(node, gpu: Gpu, share: float, div: float) -> tuple[float, float] | None:
    """A batched matmul of two activations, (.., m, k) @ (.., k, n): backward dA = dC B^T
    (m x k, inner n) and dB = A^T dC (k x n, inner m) (only dA when the FLOP count says one)."""
    if len(node.input_meta) < 2 or len(node.input_meta[0].shape) < 2 or len(node.input_meta[1].shape) < 2:
        return None
    m, k = node.input_meta[0].shape[-2:]
    n = node.input_meta[1].shape[-1]
    batch = _whole(node.output_meta[0].numel / max(m * n, 1) * share / div)
    e = gpu.elem_bytes
    nbytes = batch * (m * k + k * n + m * n) * e
    f = gpu.gemm(GemmShape(m, n, k, batch), nbytes)
    grads = [GemmShape(m, k, n, batch)]
    if node.bwd_flops > 1.5 * node.fwd_flops:
        grads.append(GemmShape(k, n, m, batch))
    return f, sum(gpu.gemm(g, nbytes, backward=True) for g in grads)


def _attention_shape(node, share: float, div: float) -> AttentionShape | None:
    """Per-rank (B, H, Tq, Tk, D) of a scaled-dot-product attention node (heads split by `div`)."""
    if len(node.input_meta) < 2 or len(node.input_meta[0].shape) != 4 or len(node.input_meta[1].shape) != 4:
        return None
    b, h, tq, d = node.input_meta[0].shape
    tk = node.input_meta[1].shape[2]
    return AttentionShape(batch=_whole(b * share), heads=_whole(h / div), tq=tq, tk=tk, head_dim=d,
                          causal=bool(node.attr("is_causal")), dropout=(node.attr("dropout_p") or 0) > 0)


def _kv_heads(node, div: float) -> int:
    """Key/value heads per rank (fewer than the query heads under grouped-query attention)."""
    return _whole(node.input_meta[1].shape[1] / div)


def _pass_family(node) -> str | None:
    """pass_bytes's family of an elementwise, norm or softmax node; None for other kinds."""
    if node.kind == OpKind.NORM:
        return "norm"
    if node.kind == OpKind.SOFTMAX:
        return "softmax"
    if node.kind != OpKind.ELEMENTWISE:
        return None
    base = node.target.rsplit(".", 1)[-1]
    if base in ("Dropout", "dropout"):
        return "dropout" if (node.attr("p") or node.attr("dropout_p")) else "identity"
    family = node_family(node.kind, node.target, dict(node.attrs))
    if family == "add":
        return "mul" if base in ("mul", "truediv", "div") else "add"
    return "unary"


def _bytes_per(meta, elem_bytes: int) -> int:
    """Bytes per element of a tensor in the run: the compute dtype's for floats, its own otherwise."""
    return elem_bytes if meta.dtype.startswith(("float", "bfloat")) else element_bytes(meta.dtype)


def _whole(x: float) -> int:
    """A per-rank dimension as a whole number of elements (at least 1)."""
    return max(int(round(x)), 1)


def gpu_for(device, dtype: str, eff: Efficiency, costs: GpuCosts | None = None) -> Gpu:
    """The Gpu pricing kernels of compute dtype `dtype` on `device` (a cost_models.hardware.Device), with
    the device's GpuCosts (default: the published defaults)."""
    return Gpu(peak=device.peak(dtype), bandwidth=device.memory_bandwidth, units=device.compute_units, eff=eff,
               elem_bytes=DType(dtype).bytes, costs=costs or GpuCosts())

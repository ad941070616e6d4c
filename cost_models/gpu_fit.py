"""Fit a GPU's GpuCosts to an op table, and check the model against one.

An op table (cost_models/op_table.py) times single calls with CUDA events around each: what
a row measures is the host dispatching the call's ops while the device runs their kernels. The
model of a row is therefore the same host/device queue a training step is priced with
(:func:`queue_seconds`): the host dispatches op after op (host seconds each, `GpuCosts.host_op`
for an eager op, `host_gemm` for a GEMM call through cuBLAS), and the device starts a kernel once
the host has dispatched it and the previous kernel is done. A small op is measured as its
dispatch plus its kernel; a large one as its kernel.

The kernels are priced by cost_models/kernels.py's `Gpu` (GEMMs by shape and alignment, flash
attention, memory passes at their bandwidth shares) with the row's own byte counts, written out
per family in `row_kernels`. `fit_gpu` fits the constants family by family, each to the rows
that determine it (relative least squares):

    host_op                          launch_1000_small_adds / 1000
    stream_efficiency                add, gelu_fwd, copy_d2d
    host_gemm, gemm_ceiling,         mm_fwd / mm_dgrad / mm_wgrad (bf16, fp32, tf32)
      gemm_tile_load, gemm_k_fill,
      gemm_misaligned                the rows with a dimension off 16 bytes (vocabulary 50257)
    attention_share, _block,         sdpa_fwd, then sdpa_fwd_bwd for attention_backward_share
      _head_dim_fill
    softmax_efficiency               xent_bf16_fwd_bwd (no cast), then
    cast_efficiency                  xent_fp32_fwd_bwd (its two casts of every logit)
    norm_efficiency                  layernorm_fwd, layernorm_fwd_bwd (autocast's cast to fp32 included)
    adam_*                           adamw_fused, adamw_foreach
    h2d_pinned, h2d_pageable         copy_h2d_pinned, copy_h2d_pageable
    host_backward_share              host_linear_fwd_bwd rows where a calibration measured them

xent_compiled_fwd_bwd rows (the compiled loss) fit nothing: the report checks them against the model,
which prices them with the softmax share the eager loss's rows fit. A constant whose rows are absent
keeps its default (cost_models/gpu_costs.py says where each default comes from). Rows the model does
not price (`EXCLUDED`) are named with the reason.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable

from cost_models.compute import Efficiency
from cost_models.gemm import GemmShape
from cost_models.gpu_costs import GpuCosts
from cost_models.kernels import AttentionShape, Gpu, fused_attention_seconds
from cost_models.op_table import OpRow
from runtime.vocab import OpKind

# Op families the model does not price, and why.
EXCLUDED = {
    "nccl_allreduce_ws1": "a collective over a world of one rank: no plan issues one (a rank alone has no "
                          "data, tensor or pipeline peer), so nothing prices it",
}
# bytes per element of the table's dtype names
_ELEM = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "bf16->fp32": 2, "u8": 1}
# Adam reads master weights, m, v and the gradient and writes master, m and v: 28 bytes per parameter
# in mixed precision (cost_models/memory.adam_step_bytes); the table's tensors are fp32 (16 + 12).
ADAM_BYTES = 28


@dataclass(frozen=True)
class Dispatch:
    """One op in a row's (or a step's) stream: host seconds to dispatch it, device seconds of its kernels."""

    host: float
    device: float


def queue_seconds(ops: Iterable[Dispatch], host_start: float = 0.0, device_free: float = 0.0) -> tuple[float, float]:
    """(host time, device time) when the last op's kernels end, for ops dispatched in order by one host
    thread onto one stream: the host dispatches op i at host_i (the sum of the dispatch times so far);
    its kernels start once dispatched and once the kernels before them are done."""
    h, d = host_start, device_free
    for op in ops:
        h += op.host
        d = max(d, h) + op.device
    return h, d


def gpu_of(device, dtype: str, costs: GpuCosts) -> Gpu:
    """A Gpu for `device` (cost_models.hardware.Device) in `dtype` ("bf16", "fp32", "tf32") with `costs`."""
    eff = efficiency_of(costs)
    return Gpu(peak=device.peak(dtype), bandwidth=device.memory_bandwidth, units=device.compute_units, eff=eff,
               elem_bytes=_ELEM.get(dtype, 2), costs=costs)


def efficiency_of(costs: GpuCosts) -> Efficiency:
    """The roofline Efficiency a GPU with these constants prices with (the conv share stays the published
    0.70 of peak: the op tables hold no convolution)."""
    return Efficiency(matmul=costs.gemm_ceiling, conv=0.70, memory=costs.stream_efficiency,
                      kernel_overhead=costs.kernel_gap, source=costs.source)


# --- the model of one row ----------------------------------------------------------------------


def row_kernels(row: OpRow, device, costs: GpuCosts) -> list[Dispatch] | None:
    """The ops one timed call of `row` dispatches, with their host and device seconds; None for a
    row outside the model (EXCLUDED, or an op family this version does not know)."""
    d, op, dt = row.dims(), row.op, row.dtype
    fwd_host, bwd_host = costs.host_op, costs.host_op * costs.host_backward_share
    if op in ("mm_fwd", "mm_dgrad", "mm_wgrad"):
        gpu = gpu_of(device, dt if dt in ("fp32", "tf32") else "bf16", costs)
        e = _ELEM.get(dt, 2)
        m, k, n = d["M"], d["K"], d["N"]
        return [Dispatch(costs.host_gemm, gpu.gemm(GemmShape(m, n, k), (m * k + k * n + m * n) * e))]
    if op in ("sdpa_fwd", "sdpa_fwd_bwd"):
        gpu = gpu_of(device, "bf16", costs)
        shape = AttentionShape(d["B"], d["H"], d["T"], d["T"], d["D"], causal="causal" in row.shape)
        nbytes = 4 * shape.batch * shape.heads * shape.tq * shape.head_dim * 2
        f, b = fused_attention_seconds(shape, gpu, nbytes)
        ops = [Dispatch(costs.host_gemm, f)]
        return ops + [Dispatch(costs.host_gemm, b)] if op == "sdpa_fwd_bwd" else ops
    if op in ("layernorm_fwd", "layernorm_fwd_bwd"):
        gpu = gpu_of(device, "bf16", costs)
        rows, h = d["N"], d["h"]
        e = rows * h
        ops = [Dispatch(fwd_host, gpu.stream("cast", 6 * e)),                          # autocast: x bf16 -> fp32
               Dispatch(fwd_host, gpu.stream(OpKind.NORM, 8 * e + 8 * rows + 8 * h))]  # LayerNorm in fp32
        if op == "layernorm_fwd_bwd":
            ops += [Dispatch(bwd_host, gpu.stream(OpKind.NORM, 12 * e + 8 * rows + 16 * h, True, kernels=2)),
                    Dispatch(bwd_host, gpu.stream("cast", 6 * e, True))]               # dx fp32 -> bf16
        return ops
    if op == "gelu_fwd":
        gpu = gpu_of(device, "bf16", costs)
        return [Dispatch(fwd_host, gpu.stream(OpKind.ELEMENTWISE, 4 * d["N"] * d["h"]))]
    if op == "add_residual":   # x + y: two full tensors read, one written
        gpu = gpu_of(device, "bf16", costs)
        return [Dispatch(fwd_host, gpu.stream(OpKind.ELEMENTWISE, 6 * d["N"] * d["h"]))]
    if op == "host_linear_fwd_bwd":
        # one autograd-recorded nn.Linear forward and torch.autograd.grad of x, weight and bias, on tiny
        # tensors (the device keeps up): the forward's GEMM call; the backward's two GEMMs and the bias
        # gradient's sum; under bf16 autocast the casts of x, weight and bias and their gradients' casts back
        ops = [Dispatch(costs.host_gemm, 0.0), Dispatch(costs.host_op, 0.0)]          # addmm; autograd.grad's call
        ops += [Dispatch(costs.host_gemm * costs.host_backward_share, 0.0)] * 2 + [Dispatch(bwd_host, 0.0)]
        if dt == "bf16":
            ops += [Dispatch(fwd_host, 0.0)] * 3 + [Dispatch(bwd_host, 0.0)] * 3
        return ops
    if op == "host_item_sync":   # x.item(): a copy to the host after the device's last kernel
        gpu = gpu_of(device, "fp32", costs)
        return [Dispatch(fwd_host, gpu.kernel_gap)]
    if op == "add":
        # one full tensor read and one written: a third full tensor would exceed the HBM's peak on the
        # largest row (16384 x 8192 in 0.1996 ms), so the second operand is broadcast or the same tensor
        gpu = gpu_of(device, "bf16", costs)
        return [Dispatch(fwd_host, gpu.stream(OpKind.ELEMENTWISE, 4 * d["N"] * d["h"]))]
    if op in ("xent_fp32_fwd_bwd", "xent_bf16_fwd_bwd"):
        gpu = gpu_of(device, "bf16", costs)
        return loss_ops(gpu, d["N"], d["V"], upcast=op == "xent_fp32_fwd_bwd")
    if op == "xent_compiled_fwd_bwd":
        gpu = gpu_of(device, "bf16", costs)
        fwd, bwd = compiled_loss_passes(gpu, d["N"], d["V"], logits_bytes=_ELEM.get(dt, 2))
        return fwd + bwd
    if op in ("adamw_fused", "adamw_foreach"):
        gpu = gpu_of(device, "fp32", costs)
        return [Dispatch(fwd_host, adam_seconds(gpu, d["params"], d["tensors"], op.removeprefix("adamw_")))]
    if op == "copy_d2d":
        gpu = gpu_of(device, "bf16", costs)
        return [Dispatch(fwd_host, gpu.stream(OpKind.ELEMENTWISE, 2 * d["bytes"]))]
    if op in ("copy_h2d_pinned", "copy_h2d_pageable"):
        bw = costs.h2d_pinned if op == "copy_h2d_pinned" else costs.h2d_pageable
        return [Dispatch(fwd_host, d["bytes"] / bw)]
    if op == "launch_1000_small_adds":
        gpu = gpu_of(device, "fp32", costs)
        return [Dispatch(fwd_host, gpu.kernel_gap)] * 1000
    return None


def loss_ops(gpu: Gpu, tokens: int, vocab: int, *, upcast: bool, host: float | None = None,
             backward_host: float | None = None) -> list[Dispatch]:
    """loss_passes' forward and backward ops in one list (an op table's xent rows time both)."""
    fwd, bwd = loss_passes(gpu, tokens, vocab, upcast=upcast, host=host, backward_host=backward_host)
    return fwd + bwd


def loss_passes(gpu: Gpu, tokens: int, vocab: int, *, upcast: bool, host: float | None = None,
                backward_host: float | None = None) -> tuple[list[Dispatch], list[Dispatch]]:
    """(forward ops, backward ops) of F.cross_entropy over (tokens x vocab) logits in the compute dtype, as
    eager PyTorch runs it (`upcast`: on logits.float(), as the runtime's full loss does):

        forward:  [cast to fp32: reads 2, writes 4 bytes per logit]  log_softmax (reads x, writes y), nll_loss
        backward: nll_loss_backward (fills a zero gradient, scatters -1/N), log_softmax_backward (reads dy and
                  y, writes dx), [the cast's backward: reads 4, writes 2 bytes per logit]

    log_softmax's two kernels run at the softmax share of the bandwidth, the casts at the cast share and the
    fill at the streaming share. `host`, `backward_host`: seconds to dispatch one op (default: GpuCosts.host_op and its
    backward share)."""
    c = gpu.costs
    fh = c.host_op if host is None else host
    bh = c.host_op * c.host_backward_share if backward_host is None else backward_host
    e = tokens * vocab
    w = 4 if upcast else gpu.elem_bytes
    fwd = [Dispatch(fh, gpu.stream("cast", 6 * e))] if upcast else []
    fwd += [Dispatch(fh, gpu.stream(OpKind.SOFTMAX, 2 * w * e)),                  # log_softmax
            Dispatch(fh, gpu.kernel_gap)]                                          # nll_loss (reads one logit a row)
    bwd = [Dispatch(bh, gpu.stream(OpKind.ELEMENTWISE, w * e, True)),              # nll_loss_backward's zero fill
           Dispatch(bh, gpu.stream(OpKind.SOFTMAX, 3 * w * e, True))]              # log_softmax_backward
    if upcast:
        bwd.append(Dispatch(bh, gpu.stream("cast", 6 * e, True)))
    return fwd, bwd


def compiled_loss_passes(gpu: Gpu, tokens: int, vocab: int, *, logits_bytes: int
                         ) -> tuple[list[Dispatch], list[Dispatch]]:
    """(forward ops, backward ops) of the same loss through torch.compile (runtime/losses.compiled_loss) over
    (tokens x vocab) logits of `logits_bytes` bytes an element: the kernels AOTAutograd's graphs of it
    (TORCH_LOGS=aot_graphs) fuse into, each reading the logits in their own dtype, never writing fp32 ones:

        forward:  the row max, then the sum of exponentials with the target's logit (a row longer than one
                  block is read once per reduction: 2 reads of the logits)
        backward: the gradient's row sum over the targets alone (no logit read), then softmax minus the
                  one-hot times the incoming gradient, from the logits and the saved max and log-sum-exp,
                  written in the logits' dtype (one read, one write)

    ASSUMPTION until an op table times xent_compiled_fwd_bwd rows (the calibration measures them; the fit
    does not use them yet): the kernels run at the softmax share of the bandwidth, as the eager loss's, each
    dispatched at an eager op's host cost (the compiled region's guards and autograd wrapper)."""
    c = gpu.costs
    fh, bh = c.host_op, c.host_op * c.host_backward_share
    e = float(tokens) * vocab * logits_bytes
    fwd = [Dispatch(fh, gpu.stream(OpKind.SOFTMAX, e)), Dispatch(fh, gpu.stream(OpKind.SOFTMAX, e))]
    bwd = [Dispatch(bh, gpu.kernel_gap), Dispatch(bh, gpu.stream(OpKind.SOFTMAX, 2 * e, True))]
    return fwd, bwd


def adam_seconds(gpu: Gpu, params: float, tensors: int, impl: str) -> float:
    """Device seconds of one AdamW step over `params` parameters in `tensors` tensors: impl "fused" or
    "foreach" (multi-tensor kernels: a cost per tensor, and the 28 bytes per parameter at the
    implementation's bandwidth share), or "for-loop" (priced as foreach: no op table times it)."""
    c = gpu.costs
    per_tensor, eff = (c.adam_fused_per_tensor, c.adam_fused_efficiency) if impl == "fused" else \
        (c.adam_foreach_per_tensor, c.adam_foreach_efficiency)
    return tensors * per_tensor + ADAM_BYTES * params / (gpu.bandwidth * eff)


def predict_row(row: OpRow, device, costs: GpuCosts) -> float | None:
    """Seconds the model gives one timed call of `row`, or None outside the model."""
    ops = row_kernels(row, device, costs)
    if ops is None:
        return None
    if row.op in ("launch_1000_small_adds", "host_linear_fwd_bwd"):   # wall times: the host's
        return max(queue_seconds(ops))
    return queue_seconds(ops)[1]


# --- the fit ------------------------------------------------------------------------------------


def _loss(rows: list[OpRow], device, costs: GpuCosts) -> float:
    """Sum of squared relative errors of the model over `rows`."""
    total = 0.0
    for r in rows:
        p = predict_row(r, device, costs)
        if p is not None:
            total += (p / r.seconds - 1.0) ** 2
    return total


def _golden(f: Callable[[float], float], lo: float, hi: float, iters: int = 40) -> float:
    """The x in [lo, hi] minimizing a unimodal f (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _fit1(rows: list[OpRow], device, costs: GpuCosts, name: str, lo: float, hi: float) -> GpuCosts:
    """`costs` with field `name` fit to `rows` within [lo, hi] (unchanged when no row depends on it)."""
    if not rows:
        return costs
    best = _golden(lambda x: _loss(rows, device, costs.replace(**{name: x})), lo, hi)
    return costs.replace(**{name: best})


def fit_gpu(rows: Iterable[OpRow], device, base: GpuCosts | None = None, source: str = "") -> GpuCosts:
    """GpuCosts fit to the op table `rows` measured on `device` (cost_models.hardware.Device: its peak per
    dtype, memory bandwidth and SM count are taken as given). Constants without rows keep `base`'s."""
    rows = list(rows)
    by = {}
    for r in rows:
        by.setdefault(r.op, []).append(r)
    c = base or GpuCosts()
    if by.get("launch_1000_small_adds"):
        c = c.replace(host_op=statistics.median(r.seconds for r in by["launch_1000_small_adds"]) / 1000)
    c = _fit1(by.get("add", []) + by.get("add_residual", []) + by.get("gelu_fwd", []) + by.get("copy_d2d", []),
              device, c, "stream_efficiency", 0.2, 1.0)
    gemm = [r for op in ("mm_fwd", "mm_dgrad", "mm_wgrad") for r in by.get(op, [])]
    if gemm:
        c = _fit_gemm(gemm, device, c)
    if by.get("sdpa_fwd"):
        c = _fit_attention(by["sdpa_fwd"], device, c)
    c = _fit1(by.get("sdpa_fwd_bwd", []), device, c, "attention_backward_share", 0.2, 1.5)
    # the 16-bit loss has no cast: it fixes the softmax share, and the upcast one then the cast share
    xent = by.get("xent_fp32_fwd_bwd", []) + by.get("xent_bf16_fwd_bwd", [])
    for _ in range(3):
        c = _fit1(by.get("xent_bf16_fwd_bwd", []) or xent, device, c, "softmax_efficiency", 0.1, 1.0)
        c = _fit1(by.get("xent_fp32_fwd_bwd", []), device, c, "cast_efficiency", 0.1, 1.0)
    c = _fit1(by.get("layernorm_fwd", []) + by.get("layernorm_fwd_bwd", []), device, c, "norm_efficiency", 0.1, 1.0)
    for impl in ("fused", "foreach"):
        c = _fit_adam(by.get(f"adamw_{impl}", []), device, c, impl)
    c = _fit1(by.get("copy_h2d_pinned", []), device, c, "h2d_pinned", 1e9, 200e9)
    c = _fit1(by.get("copy_h2d_pageable", []), device, c, "h2d_pageable", 1e9, 200e9)
    c = _fit1(by.get("host_linear_fwd_bwd", []), device, c, "host_backward_share", 0.05, 3.0)
    return c.replace(source=source or f"fit to {len(rows)} op-table rows by cost_models/gpu_fit.fit_gpu")


def _fit_gemm(rows: list[OpRow], device, c: GpuCosts) -> GpuCosts:
    """The GEMM constants: the tile model's two (a grid: they change which tile wins, not smoothly), then
    the host's dispatch and the ceiling on the aligned rows, then the misaligned rate."""
    aligned_rows = [r for r in rows if _aligned_row(r)]
    off = [r for r in rows if not _aligned_row(r)]
    best = None
    for tile_load in (8.0, 16.0, 32.0):
        for k_fill in (32.0, 64.0, 128.0, 256.0):
            t = c.replace(gemm_tile_load=tile_load, gemm_k_fill=k_fill)
            for _ in range(2):   # host dispatch and ceiling interact on small shapes: alternate twice
                t = _fit1(aligned_rows, device, t, "host_gemm", 0.0, 60e-6)
                t = _fit1(aligned_rows, device, t, "gemm_ceiling", 0.3, 1.0)
            loss = _loss(aligned_rows, device, t)
            if best is None or loss < best[0]:
                best = (loss, t)
    c = best[1]
    return _fit1(off, device, c, "gemm_misaligned", 0.01, 1.0)


def _aligned_row(r: OpRow) -> bool:
    d = r.dims()
    step = 16 // _ELEM.get(r.dtype, 2)
    return all(d[k] % step == 0 for k in ("M", "K", "N"))


def _fit_attention(rows: list[OpRow], device, c: GpuCosts) -> GpuCosts:
    best = None
    for block in (64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0):
        for fill in (0.0, 16.0, 32.0, 64.0, 128.0):
            t = _fit1(rows, device, c.replace(attention_block=block, attention_head_dim_fill=fill),
                      "attention_share", 0.2, 2.0)
            loss = _loss(rows, device, t)
            if best is None or loss < best[0]:
                best = (loss, t)
    return best[1]


def _fit_adam(rows: list[OpRow], device, c: GpuCosts, impl: str) -> GpuCosts:
    if not rows:
        return c
    per, eff = f"adam_{impl}_per_tensor", f"adam_{impl}_efficiency"
    for _ in range(3):
        c = _fit1(rows, device, c, eff, 0.05, 1.0)
        c = _fit1(rows, device, c, per, 0.0, 200e-6)
    return c


# --- the check --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowError:
    row: OpRow
    predicted: float     # s
    error: float         # predicted / measured - 1


def family(op: str) -> str:
    """The op family a row belongs to, for the per-family report ("gemm", "attention", ...)."""
    if op.startswith("mm_"):
        return "gemm"
    if op.startswith("sdpa"):
        return "attention"
    if op.startswith("layernorm"):
        return "norm"
    if op in ("gelu_fwd", "add", "add_residual", "copy_d2d"):
        return "elementwise"
    if op.startswith("xent"):
        return "loss"
    if op.startswith("adamw"):
        return "optimizer"
    if op.startswith("copy_h2d"):
        return "host_to_device"
    if op.startswith("launch") or op.startswith("host_"):
        return "host"
    return op


def row_errors(rows: Iterable[OpRow], device, costs: GpuCosts) -> tuple[dict[str, list[RowError]],
                                                                         list[tuple[OpRow, str]]]:
    """({family: errors of its rows}, [(row, why it is not priced)])."""
    out: dict[str, list[RowError]] = {}
    skipped = []
    for r in rows:
        p = predict_row(r, device, costs)
        if p is None:
            skipped.append((r, EXCLUDED.get(r.op, f"op family {r.op!r} is not in the model")))
            continue
        out.setdefault(family(r.op), []).append(RowError(r, p, p / r.seconds - 1.0))
    return out, skipped


def error_report(rows: Iterable[OpRow], device, costs: GpuCosts) -> str:
    """A table: per family, rows, median and worst absolute error, rows beyond 15%; then skipped rows."""
    fam, skipped = row_errors(rows, device, costs)
    lines = [f"{'family':<16}{'rows':>5}{'median |err|':>14}{'worst':>9}{'> 15%':>7}"]
    for name, errs in sorted(fam.items()):
        a = [abs(e.error) for e in errs]
        lines.append(f"{name:<16}{len(a):>5}{statistics.median(a):>13.1%}{max(a):>9.1%}"
                     f"{sum(x > 0.15 for x in a):>7}")
    for r, why in skipped:
        lines.append(f"not priced: {r.op} {r.shape}: {why}")
    return "\n".join(lines)

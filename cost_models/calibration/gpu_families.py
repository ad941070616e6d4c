"""The op families of the GPU calibration (cost_models/calibration/gpu_ops.py times them): how one row's inputs
are built and its call made, and the FLOPs or bytes its rate divides by. What one timed call does (bf16
unless the dtype says otherwise; shape letters as OpRow.dims reads them):

    mm_fwd     "<layer> M K N"   a @ w.t(), a [M, K], w [N, K] (layer: qkv, proj, fc1, fc2 of a
                                 transformer of hidden h at M tokens; lm_head; square; and the dtype
                                 rows "fp32 ..." (TF32 off), "tf32 ..." (TF32 on), "fp16 ...")
    mm_dgrad   "<layer> M K N"   g @ w, g [M, K], w [K, N] (M tokens, K the layer's outputs)
    mm_wgrad   "<layer> M K N"   g.t() @ a, g [K, M], a [K, N] (K tokens, M the layer's outputs)
    sdpa_fwd   "B H T D causal"  F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sdpa_fwd_bwd                 the same and torch.autograd.grad for q, k, v
    layernorm_fwd "N h"          nn.LayerNorm(h) (fp32 weights) on bf16 x [N, h] under bf16 autocast
    layernorm_fwd_bwd            the same and torch.autograd.grad for x, weight and bias
    gelu_fwd   "N h"             F.gelu(x), x [N, h]
    add        "N h"             x + b, x [N, h], b [h] (a broadcast row: one tensor read, one written,
                                 which is what the reference's times allow: three full tensors of its
                                 largest row would exceed the H100's memory bandwidth)
    add_residual "N h"           x + y, both [N, h] (new: a transformer's residual add)
    xent_fp32_fwd_bwd "N V"      F.cross_entropy(logits.float(), targets) and its gradient for the bf16
                                 logits [N, V] (dtype "bf16->fp32"); xent_bf16_fwd_bwd: without .float()
    xent_compiled_fwd_bwd "N V"  (new) the first through torch.compile (runtime/losses.compiled_loss,
                                 inductor: Execution.loss "compiled"); compiled in the warm-up calls
    adamw_fused / adamw_foreach "params P tensors 100"   torch.optim.AdamW(fused= / foreach=True).step()
                                 over 100 fp32 tensors holding P parameters, gradients set
    copy_d2d / copy_h2d_pinned / copy_h2d_pageable "bytes B"   dst.copy_(src) of B bytes (u8); from
                                 pinned host memory with non_blocking=True
    launch_1000_small_adds "16 floats"   host wall time of 1000 x.add_(1.0) on 16 floats and a
                                 synchronize: what the host pays to launch a small kernel, x 1000
    host_linear_fwd_bwd "M16 K16 N16"   (new) host wall time of one autograd-recorded nn.Linear(16, 16)
                                 forward on x [16, 16] (requires grad) and torch.autograd.grad for x,
                                 weight and bias: the host's side of a layer's forward and backward;
                                 dtype bf16: under bf16 autocast (its casts included). Timed as 100 in a
                                 row and a synchronize, per call
    host_item_sync "1 float"     (new) host wall time of x.item() on an idle device: a step's sync

`rate`: tflops = FLOPs / s / 1e12, gbps = bytes / s / 1e9 with the reference's FLOP and byte counts
(FAMILIES[op].work: 2MKN for a GEMM; causal attention 2BHT^2D forward, 3.5x that with the backward;
bytes per element: LayerNorm 4 forward, 12 with the backward, gelu 4, add 6, cross-entropy 12
upcast, 8 in bf16 and compiled, AdamW 28 per parameter, a device copy 2 per byte, a host copy 1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from cost_models.op_table import OpRow, shape_dims
from runtime.losses import compiled_loss

DEVICE, HOST = "device", "host"
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}


@dataclass(frozen=True)
class OpSpec:
    """One row to measure: its op family, shape text and dtype as the table writes them."""

    op: str
    shape: str
    dtype: str = "bf16"

    @property
    def dims(self) -> dict[str, int]:
        return shape_dims(self.shape)


# build(device, spec) -> (make, run): make() allocates one set of inputs (a tuple), run(inputs) is one call.
Build = Callable[[torch.device, OpSpec], tuple[Callable[[], tuple], Callable[[tuple], object]]]


@dataclass(frozen=True)
class Family:
    """How one op family is measured: `build` its inputs and call; `work(dims, dtype)` its FLOPs (rate
    "tflops") or bytes (rate "gbps") per call, None without a rate; `timing` DEVICE (CUDA events around
    each call) or HOST (wall time of a call and a synchronize); `calls` a HOST call's repetitions (the
    row is per one); `rotate`: inputs copied past the L2 cache; `context(spec)`: settings a call runs under."""

    build: Build
    work: Callable[[dict[str, int], str], float] | None = None
    rate: str | None = None
    timing: str = DEVICE
    calls: int = 1
    rotate: bool = True
    context: Callable[[OpSpec], contextlib.AbstractContextManager] = field(
        default=lambda spec: contextlib.nullcontext())


def _randn(device, *shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)


def _gemm(kind: str) -> Build:
    def build(device, spec):
        d, dt = spec.dims, _TORCH_DTYPE[spec.dtype]
        m, k, n = d["M"], d["K"], d["N"]
        shapes = {"mm_fwd": ((m, k), (n, k)), "mm_dgrad": ((m, k), (k, n)), "mm_wgrad": ((k, m), (k, n))}[kind]
        run = {"mm_fwd": lambda x: x[0] @ x[1].t(), "mm_dgrad": lambda x: x[0] @ x[1],
               "mm_wgrad": lambda x: x[0].t() @ x[1]}[kind]
        return (lambda: tuple(_randn(device, *s, dtype=dt) for s in shapes)), run
    return build


@contextlib.contextmanager
def _matmul_precision(spec: OpSpec) -> Iterator[None]:
    """TF32 on for the "tf32" rows, off for "fp32" ones (restored after); other dtypes as they are."""
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    if spec.dtype in ("fp32", "tf32"):
        flags.allow_tf32 = spec.dtype == "tf32"
    try:
        yield
    finally:
        flags.allow_tf32 = before


def _sdpa(backward: bool) -> Build:
    def build(device, spec):
        d = spec.dims
        shape = (d["B"], d["H"], d["T"], d["D"])

        def make():
            qkv = tuple(_randn(device, *shape, grad=backward) for _ in range(3))
            return qkv + ((_randn(device, *shape),) if backward else ())

        def run(x):
            out = F.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=True)
            return torch.autograd.grad(out, x[:3], x[3]) if backward else out
        return make, run
    return build


def _autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _out_dtype(device, fn, x) -> torch.dtype:
    """The dtype fn returns on (a slice of) x under bf16 autocast: its gradient's dtype."""
    with torch.no_grad(), _autocast(device):
        return fn(x[:1]).dtype


def _layernorm(backward: bool) -> Build:
    def build(device, spec):
        n, h = spec.dims["N"], spec.dims["h"]
        ln = torch.nn.LayerNorm(h, device=device)
        params = tuple(ln.parameters())

        def make():
            x = _randn(device, n, h, grad=backward)
            return (x, _randn(device, n, h, dtype=_out_dtype(device, ln, x))) if backward else (x,)

        def run(x):
            with _autocast(device):
                y = ln(x[0])
            return torch.autograd.grad(y, (x[0], *params), x[1]) if backward else y
        return make, run
    return build


def _elementwise(kind: str) -> Build:
    def build(device, spec):
        n, h = spec.dims["N"], spec.dims["h"]
        if kind == "gelu_fwd":
            return (lambda: (_randn(device, n, h),)), (lambda x: F.gelu(x[0]))
        other = (h,) if kind == "add" else (n, h)
        return (lambda: (_randn(device, n, h), _randn(device, *other))), (lambda x: x[0] + x[1])
    return build


def _xent(upcast: bool) -> Build:
    def build(device, spec):
        n, v = spec.dims["N"], spec.dims["V"]

        def make():
            return _randn(device, n, v, grad=True), torch.randint(0, v, (n,), device=device)

        def run(x):
            logits = x[0].float() if upcast else x[0]
            return torch.autograd.grad(F.cross_entropy(logits, x[1]), x[0])
        return make, run
    return build


def _xent_compiled(device, spec):
    n, v = spec.dims["N"], spec.dims["V"]
    loss = compiled_loss("cross_entropy", "inductor")

    def make():
        return _randn(device, n, v, grad=True), torch.randint(0, v, (n,), device=device)

    return make, (lambda x: torch.autograd.grad(loss(x[0], x[1]), x[0]))


def _adamw(impl: str) -> Build:
    def build(device, spec):
        total, count = spec.dims["params"], spec.dims["tensors"]
        sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]

        def make():
            params = [torch.randn(s, device=device, requires_grad=True) for s in sizes]
            for p in params:
                p.grad = torch.randn_like(p)
            return torch.optim.AdamW(params, lr=1e-3, **{impl: True}), params

        return make, (lambda x: x[0].step())
    return build


def _copy(source: str) -> Build:
    def build(device, spec):
        nbytes = spec.dims["bytes"]

        def make():
            dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if source == "d2d":
                return torch.ones(nbytes, dtype=torch.uint8, device=device), dst
            pin = source == "pinned" and device.type == "cuda"
            return torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin), dst

        return make, (lambda x: x[1].copy_(x[0], non_blocking=source == "pinned"))
    return build


def _launch_adds(device, spec) -> tuple:
    def run(x):
        for _ in range(1000):
            x[0].add_(1.0)
    return (lambda: (torch.zeros(16, device=device),)), run


HOST_CALLS = 100   # host_linear_fwd_bwd, host_item_sync: calls per timed round


def _host_linear(device, spec) -> tuple:
    d = spec.dims
    lin = torch.nn.Linear(d["K"], d["N"], device=device)
    params = tuple(lin.parameters())
    autocast = spec.dtype == "bf16"
    cast = (lambda: _autocast(device)) if autocast else contextlib.nullcontext   # a new one per call, as a step does

    def make():
        x = torch.randn(d["M"], d["K"], device=device, requires_grad=True)
        out = _out_dtype(device, lin, x) if autocast else torch.float32
        return x, torch.randn(d["M"], d["N"], device=device, dtype=out)

    def run(x):
        for _ in range(HOST_CALLS):
            with cast():
                y = lin(x[0])
            torch.autograd.grad(y, (x[0], *params), x[1])
    return make, run


def _item_sync(device, spec) -> tuple:
    def run(x):
        for _ in range(HOST_CALLS):
            x[0].item()
    return (lambda: (torch.zeros(1, device=device),)), run


def _mm_flops(d, dtype):
    return 2.0 * d["M"] * d["K"] * d["N"]


def _sdpa_flops(d, dtype):
    return 2.0 * d["B"] * d["H"] * d["T"] * d["T"] * d["D"]   # 4BHT^2D, half the blocks (causal)


def _per_element(nbytes: float, rows: str = "N", cols: str = "h"):
    return lambda d, dtype: nbytes * d[rows] * d[cols]


FAMILIES: dict[str, Family] = {
    "mm_fwd": Family(_gemm("mm_fwd"), _mm_flops, "tflops", context=_matmul_precision),
    "mm_dgrad": Family(_gemm("mm_dgrad"), _mm_flops, "tflops", context=_matmul_precision),
    "mm_wgrad": Family(_gemm("mm_wgrad"), _mm_flops, "tflops", context=_matmul_precision),
    "sdpa_fwd": Family(_sdpa(False), _sdpa_flops, "tflops"),
    "sdpa_fwd_bwd": Family(_sdpa(True), lambda d, dt: 3.5 * _sdpa_flops(d, dt), "tflops"),
    "layernorm_fwd": Family(_layernorm(False), _per_element(4), "gbps"),
    "layernorm_fwd_bwd": Family(_layernorm(True), _per_element(12), "gbps"),
    "gelu_fwd": Family(_elementwise("gelu_fwd"), _per_element(4), "gbps"),
    "add": Family(_elementwise("add"), _per_element(6), "gbps"),
    "add_residual": Family(_elementwise("add_residual"), _per_element(6), "gbps"),
    "xent_fp32_fwd_bwd": Family(_xent(True), _per_element(12, "N", "V"), "gbps", rotate=False),
    "xent_bf16_fwd_bwd": Family(_xent(False), _per_element(8, "N", "V"), "gbps", rotate=False),
    "xent_compiled_fwd_bwd": Family(_xent_compiled, _per_element(8, "N", "V"), "gbps", rotate=False),
    "adamw_fused": Family(_adamw("fused"), lambda d, dt: 28.0 * d["params"], "gbps", rotate=False),
    "adamw_foreach": Family(_adamw("foreach"), lambda d, dt: 28.0 * d["params"], "gbps", rotate=False),
    "copy_d2d": Family(_copy("d2d"), lambda d, dt: 2.0 * d["bytes"], "gbps", rotate=False),
    "copy_h2d_pinned": Family(_copy("pinned"), lambda d, dt: 1.0 * d["bytes"], "gbps", rotate=False),
    "copy_h2d_pageable": Family(_copy("pageable"), lambda d, dt: 1.0 * d["bytes"], "gbps", rotate=False),
    "launch_1000_small_adds": Family(_launch_adds, timing=HOST, rotate=False),
    "host_linear_fwd_bwd": Family(_host_linear, timing=HOST, calls=HOST_CALLS, rotate=False),
    "host_item_sync": Family(_item_sync, timing=HOST, calls=HOST_CALLS, rotate=False),
}


def row_of(spec: OpSpec, ms: float) -> OpRow:
    """The table's row for `spec` timed at `ms` per call, with its derived rate."""
    fam = FAMILIES[spec.op]
    rate = {}
    if fam.work is not None and ms > 0:
        per_second = fam.work(spec.dims, spec.dtype) / (ms * 1e-3)
        rate = {"tflops": per_second / 1e12} if fam.rate == "tflops" else {"gbps": per_second / 1e9}
    return OpRow(spec.op, spec.shape, spec.dtype, ms, **rate)

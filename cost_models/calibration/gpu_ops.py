"""GPU calibration, the measuring side: the op table of one device, timed with CUDA events.

    rows = measure_gpu_ops(torch.device("cuda"), quick=True)    # list[OpRow]
    print(format_op_table(rows))                                 # cost_models/op_table.py

The rows have the families and the shape texts of the H100 table the GPU cost model is fit to
(../shared/reference/gpu/h100_ops.csv, H100.md), so a calibration and that table can be read by
the same fit (cost_models.gpu_fit) and compared row by row. What one timed call does (bf16
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

How a row is timed (the reference table's method, which the fit's model of a row assumes): after
warm-up calls, `repeat` calls each issued to an idle device (a synchronize before it) with a CUDA
event recorded before and after it; the row is the median of the event pairs' times: the call's
dispatch on the host, then its kernels (the model of a row, cost_models/gpu_fit.py). Inputs small
enough that they would stay in the GPU's L2 cache (50 MB on an H100) between calls are rotated:
enough copies that together they take ROTATE_CACHE_MULTIPLE times the cache, each call reading the
next. The host rows (launch_*, host_*) are the host's wall time, each round ending with a
synchronize.

Not measured: collectives (nccl_allreduce_ws1 in the reference table): they need a process group,
and one GPU's all-reduce is a copy at most; a calibration of one GPU says so.

`rate`: tflops = FLOPs / s / 1e12, gbps = bytes / s / 1e9 with the reference's FLOP and byte counts
(FAMILIES[op].work: 2MKN for a GEMM; causal attention 2BHT^2D forward, 3.5x that with the backward;
bytes per element: LayerNorm 4 forward, 12 with the backward, gelu 4, add 6, cross-entropy 12
upcast, 8 in bf16, AdamW 28 per parameter, a device copy 2 per byte, a host copy 1).
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from cost_models.op_table import OpRow, shape_dims

# Warm-up and timed calls per row: the reference table's in the full mode, fewer in the quick one.
FULL_REPEATS = (3, 10)
QUICK_REPEATS = (2, 5)
# Inputs are rotated until all copies together take this many times the L2 cache, at most MAX_COPIES.
ROTATE_CACHE_MULTIPLE = 2
MAX_COPIES = 32
DEFAULT_L2_BYTES = 50 * 2**20   # where the device does not say (an H100's)
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


# --- the timing loop ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timer:
    """Marks on a clock: `mark()` a point (a recorded CUDA event, or a host reading), `ms(a, b)` the
    milliseconds between two marks, `sync()` waits until the device has run everything issued."""

    mark: Callable[[], object]
    ms: Callable[[object, object], float]
    sync: Callable[[], None]

    def device_ms(self, call: Callable[[int], object], warmup: int, repeat: int) -> float:
        """Median milliseconds of call(i) with marks around each of `repeat` calls, each issued to an idle
        device (a sync before it), after `warmup` calls (call numbers run on, so inputs rotate through
        warm-up and timing). A call from an idle device is its host's dispatch, then its kernels: what
        the reference table's rows measure (a small GEMM there costs its dispatch, a large one its
        kernel; cost_models/gpu_fit.py models a row so), and what its back-to-back twin would hide for
        mid-sized ops, whose dispatch overlaps the previous call's kernels."""
        for i in range(warmup):
            call(i)
        marks = []
        for i in range(warmup, warmup + repeat):
            self.sync()
            a = self.mark()
            call(i)
            marks.append((a, self.mark()))
        self.sync()
        return statistics.median(self.ms(a, b) for a, b in marks)

    def host_ms(self, call: Callable[[int], object], warmup: int, repeat: int) -> float:
        """Median wall milliseconds of call(i) followed by a sync, over `repeat` calls after `warmup`."""
        wall = Timer(mark=time.perf_counter, ms=_wall_ms, sync=self.sync)
        return wall.device_ms(lambda i: (call(i), self.sync()), warmup, repeat)


def _wall_ms(a: float, b: float) -> float:
    return (b - a) * 1e3


def cuda_timer(device: torch.device) -> Timer:
    """CUDA events (enable_timing) recorded on the current stream of `device`."""
    def mark():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return Timer(mark=mark, ms=lambda a, b: a.elapsed_time(b), sync=lambda: torch.cuda.synchronize(device))


def host_timer() -> Timer:
    """The host's perf_counter and no device to wait for (a CPU device: how the unit tests drive the loop)."""
    return Timer(mark=time.perf_counter, ms=_wall_ms, sync=lambda: None)


# --- the families ---------------------------------------------------------------------------------


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


# --- what is measured -----------------------------------------------------------------------------

_LAYERS = (("qkv", 1, 3), ("proj", 1, 1), ("fc1", 1, 4), ("fc2", 4, 1))   # (name, inputs / h, outputs / h)
_LM_HEADS = ((768, 50257), (768, 50304), (4096, 128256))   # (hidden, vocabulary): unaligned, aligned, Llama 3
_SQUARES = ((1000, 1000, 1000), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 1024, 1024),
            (512, 12288, 12288), (2048, 12288, 49152), (2048, 49152, 12288))
_ATTENTION = ((16, 12, 1024, 64), (8, 16, 2048, 128), (4, 32, 4096, 128), (1, 32, 8192, 128), (2, 64, 4096, 128))
_ROWS = ((16384, 768), (8192, 2048), (8192, 4096), (16384, 8192))   # (tokens, hidden) of the elementwise rows
_VOCABS = ((16384, 50304), (16384, 50257), (8192, 128256))
_ADAM_PARAMS = (10_000_000, 100_000_000, 500_000_000)
COPY_BYTES = 256 * 2**20


def _transformer_gemms(tokens, hiddens) -> list[OpSpec]:
    out = []
    for t in tokens:
        for h in hiddens:
            for name, a, b in _LAYERS:
                k_in, n_out = a * h, b * h
                out += [OpSpec("mm_fwd", f"{name} M{t} K{k_in} N{n_out}"),
                        OpSpec("mm_dgrad", f"{name} M{t} K{n_out} N{k_in}"),
                        OpSpec("mm_wgrad", f"{name} M{n_out} K{t} N{k_in}")]
    return out


def gpu_op_specs(quick: bool) -> list[tuple[str, list[OpSpec]]]:
    """(section title, rows) in the order they are measured: the full mode has every row of the H100
    reference table (but its collectives) and the new families; the quick mode fewer shapes of each."""
    tokens, hiddens = ((2048, 8192), (768, 4096)) if quick else ((2048, 8192, 16384), (768, 2048, 4096, 8192))
    heads = [(m, h, v) for m in ((8192,) if quick else (2048, 8192, 16384)) for h, v in _LM_HEADS]
    squares = (_SQUARES[0], _SQUARES[2]) if quick else _SQUARES
    attention = (_ATTENTION[0], _ATTENTION[1], _ATTENTION[3]) if quick else _ATTENTION
    rows = (_ROWS[0], _ROWS[2]) if quick else _ROWS
    vocabs = _VOCABS[:2] if quick else _VOCABS
    adam = _ADAM_PARAMS[:2] if quick else _ADAM_PARAMS
    return [
        ("GEMMs of transformer layers (bf16)", _transformer_gemms(tokens, hiddens)),
        ("GEMMs: lm_head, squares, fp32/tf32/fp16",
         [OpSpec("mm_fwd", f"lm_head M{m} K{h} N{v}") for m, h, v in heads]
         + [OpSpec("mm_fwd", f"square M{m} K{k} N{n}") for m, k, n in squares]
         + [OpSpec("mm_fwd", "fp32 M4096 K4096 N4096", "fp32"), OpSpec("mm_fwd", "tf32 M4096 K4096 N4096", "tf32"),
            OpSpec("mm_fwd", "fp16 M8192 K8192 N8192", "fp16")]),
        ("attention (causal)", [OpSpec(op, f"B{b} H{h} T{t} D{d} causal") for b, h, t, d in attention
                                for op in ("sdpa_fwd", "sdpa_fwd_bwd")]),
        ("norms and elementwise", [OpSpec(op, f"N{n} h{hh}") for n, h in rows
                                   for op, hh in (("layernorm_fwd", h), ("layernorm_fwd_bwd", h), ("gelu_fwd", 4 * h),
                                                  ("add", h), ("add_residual", h))]),
        ("the loss", [OpSpec(op, f"N{n} V{v}", dt) for n, v in vocabs
                      for op, dt in (("xent_fp32_fwd_bwd", "bf16->fp32"), ("xent_bf16_fwd_bwd", "bf16"))]),
        ("the optimizer", [OpSpec(f"adamw_{impl}", f"params{p} tensors100", "fp32") for p in adam
                           for impl in ("fused", "foreach")]),
        ("copies", [OpSpec(op, f"bytes{COPY_BYTES}", "u8")
                    for op in ("copy_d2d", "copy_h2d_pinned", "copy_h2d_pageable")]),
        ("the host", [OpSpec("launch_1000_small_adds", "16 floats", "fp32"),
                      OpSpec("host_linear_fwd_bwd", "M16 K16 N16", "fp32"),
                      OpSpec("host_linear_fwd_bwd", "M16 K16 N16", "bf16"),
                      OpSpec("host_item_sync", "1 float", "fp32")]),
    ]


# --- measuring ------------------------------------------------------------------------------------


def _nbytes(inputs) -> int:
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


def _input_sets(make: Callable[[], tuple], rotate: bool, cache_bytes: int) -> list[tuple]:
    """One set of inputs, or (rotate) as many as make the sets together ROTATE_CACHE_MULTIPLE x
    `cache_bytes` (at most MAX_COPIES)."""
    sets = [make()]
    if rotate and cache_bytes > 0:
        copies = min(MAX_COPIES, math.ceil(ROTATE_CACHE_MULTIPLE * cache_bytes / max(_nbytes(sets[0]), 1)))
        sets += [make() for _ in range(copies - 1)]
    return sets


def measure_one(spec: OpSpec, device: torch.device, timer: Timer, *, warmup: int, repeat: int,
                cache_bytes: int = 0) -> OpRow:
    """Build `spec`'s inputs on `device` and time it with `timer` (its family's way)."""
    fam = FAMILIES[spec.op]
    make, run = fam.build(device, spec)
    with fam.context(spec):
        sets = _input_sets(make, fam.rotate, cache_bytes)
        call = (lambda i: run(sets[i % len(sets)]))
        if fam.timing == HOST:
            ms = timer.host_ms(call, warmup, repeat) / fam.calls
        else:
            ms = timer.device_ms(call, warmup, repeat)
    return row_of(spec, ms)


def measure_ops(sections: list[tuple[str, list[OpSpec]]], device: torch.device, timer: Timer, *, warmup: int,
                repeat: int, cache_bytes: int = 0, progress: Callable[[str], None] | None = print) -> list[OpRow]:
    """The rows of `sections` measured on `device` with `timer`, section by section. A row that runs out
    of device memory is left out and named through `progress` (a smaller GPU still calibrates)."""
    rows: list[OpRow] = []
    for title, specs in sections:
        t0, before = time.perf_counter(), len(rows)
        for spec in specs:
            try:
                rows.append(measure_one(spec, device, timer, warmup=warmup, repeat=repeat, cache_bytes=cache_bytes))
            except torch.cuda.OutOfMemoryError:
                if progress:
                    progress(f"  {spec.op} {spec.shape} {spec.dtype}: out of device memory, left out")
                gc.collect()   # what the failed row's frames held
            _free(device)
        if progress:
            got = rows[before:]
            span = f" ({min(r.ms for r in got):.4g} to {max(r.ms for r in got):.4g} ms per call)" if got else ""
            progress(f"  {title}: {len(got)} rows in {time.perf_counter() - t0:.1f} s{span}")
    return rows


def _free(device: torch.device) -> None:
    """Give the caching allocator's blocks back between rows: a long table of sizes fragments it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def l2_cache_bytes(device: torch.device) -> int:
    """The device's L2 cache (bytes), DEFAULT_L2_BYTES where torch does not say."""
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def measure_gpu_ops(device: torch.device, *, quick: bool, progress: Callable[[str], None] | None = print
                    ) -> list[OpRow]:
    """The op table of the CUDA device `device` (gpu_op_specs(quick), timed as the module says): 87 rows
    quick, 212 full. By the H100 reference table's times their calls (warm-ups included) keep an H100
    busy about 0.9 s quick and 6 s full; allocating inputs and the libraries' first calls add to that."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_gpu_ops times CUDA kernels; got device {device}: calibrate a CPU with "
                         "meshplan calibrate --device cpu")
    warmup, repeat = QUICK_REPEATS if quick else FULL_REPEATS
    with torch.cuda.device(device):
        return measure_ops(gpu_op_specs(quick), device, cuda_timer(device), warmup=warmup, repeat=repeat,
                           cache_bytes=l2_cache_bytes(device), progress=progress)

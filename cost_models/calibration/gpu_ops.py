"""GPU calibration, the measuring side: the op table of one device, timed with CUDA events.

    rows = measure_gpu_ops(torch.device("cuda"), quick=True)    # list[OpRow]
    print(format_op_table(rows))                                 # cost_models/op_table.py

The rows have the families and the shape texts of the H100 table the GPU cost model is fit to
(../shared/reference/gpu/h100_ops.csv, H100.md), so a calibration and that table can be read by
the same fit (cost_models.gpu_fit) and compared row by row. What one timed call of each family does,
and the work its rate divides by: cost_models/calibration/gpu_families.py.

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
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from cost_models.op_table import OpRow
from cost_models.calibration.gpu_families import FAMILIES, HOST, OpSpec, row_of

# Warm-up and timed calls per row: the reference table's in the full mode, fewer in the quick one.
FULL_REPEATS = (3, 10)
QUICK_REPEATS = (2, 5)
# Inputs are rotated until all copies together take this many times the L2 cache, at most MAX_COPIES.
ROTATE_CACHE_MULTIPLE = 2
MAX_COPIES = 32
DEFAULT_L2_BYTES = 50 * 2**20   # where the device does not say (an H100's)


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
                      for op, dt in (("xent_fp32_fwd_bwd", "bf16->fp32"), ("xent_bf16_fwd_bwd", "bf16"))]
         # the compiled loss compiles once per shape (seconds each): the quick mode times one
         + [OpSpec("xent_compiled_fwd_bwd", f"N{n} V{v}", "bf16->fp32") for n, v in vocabs[:1 if quick else None]]),
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
    """The op table of the CUDA device `device` (gpu_op_specs(quick), timed as the module says): 88 rows
    quick, 215 full. By the H100 reference table's times their calls (warm-ups included) keep an H100
    busy about 0.9 s quick and 6 s full; allocating inputs and the libraries' first calls add to that."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_gpu_ops times CUDA kernels; got device {device}: calibrate a CPU with "
                         "meshplan calibrate --device cpu")
    warmup, repeat = QUICK_REPEATS if quick else FULL_REPEATS
    with torch.cuda.device(device):
        return measure_ops(gpu_op_specs(quick), device, cuda_timer(device), warmup=warmup, repeat=repeat,
                           cache_bytes=l2_cache_bytes(device), progress=progress)

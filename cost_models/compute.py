"""Compute time of one op: a roofline with per-kind efficiencies and a kernel overhead.

time = max(FLOPs / (peak * eff_kind), bytes / (memory_bandwidth * eff_memory)) + overhead

Large GEMMs land on the FLOP side near `eff_kind` of peak; small GEMMs and
elementwise ops land on the bytes side (memory-bound); tiny ops are
dominated by the launch overhead. On a GPU, cost_models/kernels.py prices
each op as the kernels it runs through this roofline (GEMMs with their shape
efficiency, cost_models/gemm.py; attention as the flash kernel). The defaults come from published
microbenchmark-style facts, never from end-to-end throughputs; a measured
table (`Efficiency.from_measurements`, calibration) replaces them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.vocab import DeviceKind, OpKind

# Op kinds priced on the FLOP side (tensor cores / BLAS); the rest are memory-bound.
MATMUL_KINDS = (OpKind.LINEAR, OpKind.MATMUL, OpKind.ATTENTION)
CONV_KINDS = (OpKind.CONV,)
FREE_KINDS = (OpKind.INPUT, OpKind.OUTPUT, OpKind.PARAM, OpKind.SCALAR, OpKind.VIEW)


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of peak, and the fixed cost per kernel.

    Attributes:
        matmul: fraction of peak FLOP/s a large GEMM reaches.
        conv: fraction of peak FLOP/s a large convolution reaches.
        memory: fraction of peak memory bandwidth a streaming kernel reaches.
        kernel_overhead: seconds added per kernel launched (launch + tail).
        source: where these numbers come from.
        kind_overheads: measured (kind, forward s, backward s) per op of that kind,
            replacing ``kernels * kernel_overhead`` for it (calibration on a CPU, where
            eager dispatch and autograd bookkeeping, not kernels, dominate small ops;
            views cost their dispatch there too). Sorted pairs keep it hashable.
    """

    matmul: float
    conv: float
    memory: float
    kernel_overhead: float
    source: str = ""
    kind_overheads: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("matmul", "conv", "memory"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {v!r}")
        if self.kernel_overhead < 0:
            raise ValueError(f"Efficiency.kernel_overhead must be >= 0 s, got {self.kernel_overhead!r}")
        table = tuple(sorted((str(k), float(f), float(b)) for k, f, b in self.kind_overheads))
        for k, f, b in table:
            if not (f >= 0 and b >= 0):
                raise ValueError(f"Efficiency.kind_overheads[{k!r}] must be >= 0 s, got ({f!r}, {b!r})")
        object.__setattr__(self, "kind_overheads", table)

    def overhead(self, kind: str, kernels: int, backward: bool) -> float:
        """Seconds of fixed cost of one op of `kind` (its forward, or its backward)."""
        for k, f, b in self.kind_overheads:
            if k == kind:
                return b if backward else f
        return kernels * self.kernel_overhead

    @classmethod
    def default_for(cls, device) -> "Efficiency":
        """Published-fact defaults for a device kind ("gpu" or "cpu")."""
        if device.kind == DeviceKind.GPU:
            # cuBLAS reaches about 80% of the tensor-core peak on large bf16/fp16
            # GEMMs on A100/H100: Stas Bekman's "Maximum Achievable Matmul FLOPS" table
            # (ml-engineering, compute/accelerator) measured 267.9-271.2 of 312 TFLOP/s
            # on an A100 SXM and 792-795 of 989 on an H100 SXM at the best shape a search
            # found (86-87% and 80%); ordinary large shapes land a little lower. The shape
            # model (cost_models/gemm.py) only takes away from this rate. cuDNN convolutions
            # somewhat less. STREAM-like kernels reach ~80% of HBM bandwidth.
            # A kernel launch plus its tail costs a few microseconds.
            return cls(matmul=0.80, conv=0.70, memory=0.80, kernel_overhead=5e-6,
                       source="defaults: large-GEMM ~80% of tensor-core peak, ~80% of HBM bandwidth, 5 us/kernel")
        # The local (CPU) preset's peak FLOP/s and bandwidth are themselves measured
        # GEMM and copy rates, so they are reached as measured; eager PyTorch on the
        # CPU spends ~10 us of dispatch per op.
        return cls(matmul=1.0, conv=0.6, memory=1.0, kernel_overhead=10e-6,
                   source="defaults: measured CPU GEMM and copy rates, 10 us dispatch per op")

    def replace(self, **changes) -> "Efficiency":
        return dataclasses.replace(self, **changes)


# cuBLAS/CUTLASS's large fp16/bf16 tiles on Ampere and Hopper are 256 x 128
# output elements per thread block (one block per SM at a time).
GEMM_TILE = (256, 128)


def wave_efficiency(rows: int, cols: int, compute_units: int, tile: tuple[int, int] = GEMM_TILE) -> float:
    """Fraction of a GPU's SMs busy over a GEMM with a (rows x cols) output.

    The output is cut into tiles, one per SM at a time; the last "wave" of
    tiles leaves SMs idle unless the tile count is a multiple of the SM count
    (NVIDIA's matrix-multiplication guide calls this wave quantization).
    1.0 when the device has no SM count (CPUs).
    """
    if compute_units <= 0 or rows <= 0 or cols <= 0:
        return 1.0
    tiles = -(-rows // tile[0]) * -(-cols // tile[1])
    waves = tiles / compute_units
    return waves / -(-tiles // compute_units)


def op_time(kind: OpKind, flops: float, nbytes: float, peak_flops: float, mem_bandwidth: float,
            eff: Efficiency, kernels: int = 1, shape_efficiency: float = 1.0, backward: bool = False) -> float:
    """Seconds for one op that does `flops` FLOPs and moves `nbytes` bytes.

    `kernels` is how many kernels it launches (a backward is two: input and
    weight gradients). `shape_efficiency` scales the FLOP rate of GEMM-like
    kinds for their shape (see wave_efficiency). View-like kinds cost nothing,
    unless a calibration measured a per-op cost for them (eff.kind_overheads).
    `backward`: price the op's backward (selects the measured backward overhead).
    """
    if kind in FREE_KINDS:
        return eff.overhead(kind, 0, backward) if kind == OpKind.VIEW else 0.0
    if kind in MATMUL_KINDS:
        flop_rate = peak_flops * eff.matmul * shape_efficiency
    elif kind in CONV_KINDS:
        flop_rate = peak_flops * eff.conv * shape_efficiency
    else:  # elementwise, norm, softmax, pool, embedding, loss, concat: memory-bound
        flop_rate = peak_flops * eff.matmul
    compute = flops / flop_rate if flops else 0.0
    memory = nbytes / (mem_bandwidth * eff.memory) if nbytes else 0.0
    return max(compute, memory) + eff.overhead(kind, kernels, backward)

"""`GpuCosts`: the constants that price a GPU's kernels, its host side and its optimizer, per device.

Every constant is one of three kinds, and says which:

* a published microbenchmark fact (the defaults, used for the A100 and V100 presets);
* fit to an op table of measured kernels by cost_models/gpu_fit.fit_gpu (the H100 preset, fit to the
  project's own H100 table, cost_models/reference/h100_ops.csv; `meshplan calibrate` on a GPU fits the
  same constants to what it measures on that GPU);
* a stated assumption where neither exists.

A cluster carries fitted constants in `Cluster.measurements` under ``fit.gpu.<field>`` (with
``fit.gpu.source``), the way the CPU calibration's fits are kept, so presets and calibrated
cluster files are read through one path: :func:`gpu_costs` gives the cluster's constants, the
defaults where it has none. Units: seconds, bytes/s, fractions of the device's peak.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

PREFIX = "fit.gpu."


@dataclass(frozen=True)
class GpuCosts:
    """Constants of one GPU kind (see module docstring). Fractions are of the device's own peak
    FLOP/s (per dtype) and memory bandwidth (cost_models.hardware.Device)."""

    # Large-GEMM rate over peak: Stas Bekman's "Maximum Achievable Matmul FLOPS" table (ml-engineering,
    # compute/accelerator): A100 SXM 268-271 of 312 TFLOP/s, H100 SXM 792-795 of 989 at the best shape a
    # search found (0.86 and 0.80); ordinary large shapes land a little lower. The shape model
    # (cost_models/gemm.py) only takes away from this rate.
    gemm_ceiling: float = 0.80
    # cost_models/gemm.py's tile model: multiply-adds one loaded operand element costs (TILE_LOAD) and extra
    # K elements per tile for the K-loop's fill and drain (K_FILL); ASSUMPTIONS there, fit on the H100.
    gemm_tile_load: float = 16.0
    gemm_k_fill: float = 64.0
    # A GEMM with a dimension that is not a multiple of 16 bytes (8 elements of a 16-bit dtype) cannot
    # use the aligned tensor-core kernels and runs at this fraction of the aligned rate. Only measured on
    # the H100 (lm_head at vocabulary 50257: 82-96 against 632-703 TFLOP/s at 50304); NVIDIA's "Matrix
    # Multiplication Background" guide states the requirement but no rate, so the other GPUs take the
    # H100's figure (an assumption).
    gemm_misaligned: float = 0.13
    # FlashAttention-2's best forward rate over the large-GEMM rate: 230 TFLOP/s = 0.73 of the A100's
    # peak (Dao 2023, section 4) over 0.80; cost_models/kernels.py flash_efficiency lowers it for short
    # sequences (attention_block keys of fill per sweep) and small head dims (attention_head_dim_fill).
    attention_share: float = 0.73 / 0.80
    attention_block: float = 128.0
    attention_head_dim_fill: float = 16.0
    # backward rate over the forward rate: ASSUMPTION (the paper's Figure 6 below Figure 5, no number)
    attention_backward_share: float = 0.85
    # Memory-bound kernels: elementwise passes (STREAM-like, ~80% of HBM bandwidth), norms and the
    # softmax-family kernels of a loss (the same unless fit), over their true byte counts.
    stream_efficiency: float = 0.80
    norm_efficiency: float = 0.80
    softmax_efficiency: float = 0.80
    # A copy that converts dtype (an autocast cast, logits.float()) runs ATen's unrolled, unvectorized
    # elementwise kernel: this share of the bandwidth (the same as streaming unless fit).
    cast_efficiency: float = 0.80
    # Device time between back-to-back kernels of one stream (launch latency not hidden, ramp and tail):
    # "a few microseconds", the default every GPU kind used before the op tables (ASSUMPTION).
    kernel_gap: float = 5e-6
    # Host seconds to dispatch one eager op from Python (Python, the dispatcher, the launch):
    # launch_1000_small_adds / 1000 on the H100 machine (10.1 us); the default is that figure.
    host_op: float = 10.1e-6
    # A backward op is dispatched by the autograd engine in C++, without the Python frame: this share of
    # host_op. ASSUMPTION (half), until a calibration measures an autograd-recorded layer (host_linear_fwd_bwd).
    host_backward_share: float = 0.5
    # Host seconds to dispatch one GEMM call (torch.mm / addmm through cuBLASLt: the heuristic lookup and
    # the launch), and one attention call: fit to the H100 table's small GEMMs, which it dominates. Host
    # costs belong to the host CPU and PyTorch rather than to the GPU: the default is the H100 machine's
    # figure (ASSUMPTION for other machines until calibrated).
    host_gemm: float = 18e-6
    # torch.optim.AdamW(fused=True) and foreach: seconds per parameter tensor (the multi-tensor kernels'
    # launches grow with the tensor count) and the share of memory bandwidth over its 28 bytes per
    # parameter (mixed precision reads master, m, v and the gradient, writes master, m, v). Defaults: the
    # H100 table's fit (no published figure for other GPUs: ASSUMPTION that the shares carry over).
    adam_fused_per_tensor: float = 5.5e-6
    adam_fused_efficiency: float = 0.70
    adam_foreach_per_tensor: float = 15e-6
    adam_foreach_efficiency: float = 0.27
    # Host-to-device copies, bytes/s: PCIe Gen5 x16 from pinned (about 55 GB/s) and pageable (about 18 GB/s)
    # memory, as measured on the H100 machine; the defaults are those figures (PCIe Gen4 halves the first).
    h2d_pinned: float = 54.6e9
    h2d_pageable: float = 18.0e9
    source: str = "defaults: published microbenchmark facts (see cost_models/gpu_costs.py)"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "source":
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"GpuCosts.{f.name} must be a number >= 0, got {v!r}")
        for name in ("gemm_ceiling", "gemm_misaligned", "stream_efficiency", "norm_efficiency",
                     "softmax_efficiency", "cast_efficiency", "adam_fused_efficiency", "adam_foreach_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"GpuCosts.{name} must be a fraction in (0, 1], got {getattr(self, name)!r}")

    def replace(self, **changes) -> "GpuCosts":
        return dataclasses.replace(self, **changes)

    def to_measurements(self) -> dict[str, float | str]:
        """``fit.gpu.<field>`` entries for Cluster.measurements."""
        return {PREFIX + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_measurements(cls, measurements) -> "GpuCosts | None":
        """The constants in a cluster's measurements (missing fields keep their defaults), or None when it
        holds no ``fit.gpu.*`` entry."""
        return _from_measurements(tuple(sorted((str(k), v) for k, v in dict(measurements).items()
                                               if str(k).startswith(PREFIX))))


@functools.lru_cache(maxsize=64)
def _from_measurements(items: tuple[tuple[str, object], ...]) -> GpuCosts | None:
    if not items:
        return None
    names = {f.name for f in dataclasses.fields(GpuCosts)}
    values = {k[len(PREFIX):]: v for k, v in items if k[len(PREFIX):] in names}
    for k, v in values.items():
        if k != "source" and not isinstance(v, (int, float)):
            raise ValueError(f"cluster measurement {PREFIX}{k} must be a number, got {v!r}")
    return GpuCosts(**values)


def gpu_costs(cluster) -> GpuCosts:
    """The GPU constants of `cluster` (a cost_models.hardware.Cluster): its ``fit.gpu.*`` measurements
    (a calibrated file, or a preset fit to an op table), else the published defaults."""
    return GpuCosts.from_measurements(cluster.measurements) or GpuCosts()

"""Cluster presets: DGX A100 (80 GB), DGX H100, Summit, from published hardware facts
(docs/reference/PUBLISHED.md), and ``local``: this machine's CPU processes, measured.

Plain data: each preset is a :class:`NodeSpec` holding the fields of the Device and the
two Links its nodes are made of; :func:`preset_spec` resolves a preset's name and sizes to one,
and :meth:`cost_models.hardware.Cluster.preset` builds (and so checks) the Cluster from it. That keeps
the import one way: hardware reads presets.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from cost_models import local_machine
from cost_models.field_checks import did_you_mean
from runtime.vocab import DeviceKind

_GiB = 2**30
LOCAL_PRESET = "local"   # this machine's CPU processes, measured


# --- presets ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    """What every node of a preset is made of.

    device: the fields of a hardware.Device; intra_node, inter_node: the fields of a
    hardware.Link (bandwidth in bytes/s, latency in s); measurements: the raw figures a
    measured preset keeps (the Cluster's measurements), empty for published ones.
    """

    device: Mapping[str, Any]
    devices_per_node: int
    intra_node: Mapping[str, float]
    inter_node: Mapping[str, float]
    source: str
    measurements: Mapping[str, Any] = field(default_factory=dict)


# Latencies are not in PUBLISHED.md. ASSUMPTIONS: ~3 us is the usual small-message
# latency of NCCL within a node (NVLink / NVSwitch), ~6 us across one InfiniBand hop
# (adapter + switch + NCCL proxy thread). They only matter for small messages;
# calibrate them against measurements when you have a real cluster.
_NVLINK_LATENCY = 3e-6  # s, assumption (see above)
_IB_LATENCY = 6e-6  # s, assumption (see above)

# Idle power is not in PUBLISHED.md either. ASSUMPTION: roughly what nvidia-smi shows
# for an idle SXM card of each generation; only energy estimates use it.

_A100_80GB = MappingProxyType(dict(
    name="A100-SXM4-80GB",
    kind=DeviceKind.GPU,
    compute_units=108,  # NVIDIA A100 whitepaper: 108 SMs; not in PUBLISHED.md
    peak_flops={
        "bf16": 312e12,  # PUBLISHED.md: dense bf16/fp16 tensor peak 312 TFLOP/s
        "fp16": 312e12,  # PUBLISHED.md (same figure)
        "tf32": 156e12,  # NVIDIA A100 datasheet, dense TF32 tensor; not in PUBLISHED.md
        "fp32": 19.5e12,  # NVIDIA A100 datasheet, non-tensor FP32; not in PUBLISHED.md
    },
    # PUBLISHED.md "80 GB"; nvidia-smi reports 81920 MiB, i.e. 80 GiB, not 80e9 bytes.
    memory_bytes=80 * _GiB,
    memory_bandwidth=2.0e12,  # PUBLISHED.md: HBM2e, about 2.0 TB/s
    active_watts=400.0,  # PUBLISHED.md: TDP 400 W
    idle_watts=60.0,  # assumption (see above)
))

_H100_80GB = MappingProxyType(dict(
    name="H100-SXM5-80GB",
    kind=DeviceKind.GPU,
    compute_units=132,  # NVIDIA H100 SXM5 datasheet: 132 SMs; not in PUBLISHED.md
    peak_flops={
        "bf16": 989e12,  # PUBLISHED.md: dense bf16/fp16 tensor peak 989 TFLOP/s
        "fp16": 989e12,  # PUBLISHED.md (same figure)
        "fp8": 1979e12,  # PUBLISHED.md: fp8 1979 TFLOP/s
        # NVIDIA H100 SXM datasheet: 989 TFLOP/s TF32 is the *with sparsity* figure;
        # dense is half. Not in PUBLISHED.md.
        "tf32": 494.5e12,
        "fp32": 67e12,  # NVIDIA H100 SXM datasheet, non-tensor FP32; not in PUBLISHED.md
    },
    memory_bytes=80 * _GiB,  # PUBLISHED.md "80 GB" HBM3, taken as 80 GiB like the A100
    memory_bandwidth=3.35e12,  # PUBLISHED.md: 3.35 TB/s
    active_watts=700.0,  # PUBLISHED.md: TDP 700 W
    idle_watts=70.0,  # assumption (see above)
))

_V100_16GB = MappingProxyType(dict(
    name="V100-SXM2-16GB",
    kind=DeviceKind.GPU,
    compute_units=80,  # NVIDIA V100 whitepaper: 80 SMs; not in PUBLISHED.md
    # V100 has no bf16 or tf32 at all, so those are absent rather than zero.
    peak_flops={
        "fp16": 125e12,  # PUBLISHED.md: 125 TFLOP/s fp16 tensor
        "fp32": 15.7e12,  # NVIDIA V100 SXM2 datasheet; not in PUBLISHED.md
    },
    memory_bytes=16 * _GiB,  # PUBLISHED.md "16 GB" HBM2, taken as 16 GiB
    memory_bandwidth=900e9,  # PUBLISHED.md: 900 GB/s
    active_watts=300.0,  # PUBLISHED.md: TDP 300 W
    idle_watts=40.0,  # assumption (see above)
))

# The H100's kernel, host and optimizer constants (cost_models/gpu_costs.py), as
# cost_models.gpu_fit.fit_gpu fits them to the project's H100 op table
# (cost_models/reference/h100_ops.csv: one H100 80GB HBM3 SXM, PyTorch 2.11, CUDA 13.0);
# tests/unit/test_gpu_fit.py fits them again from the table and checks these values.
_H100_FIT = MappingProxyType({f"fit.gpu.{k}": v for k, v in dict(
    gemm_ceiling=0.7796, gemm_tile_load=8.0, gemm_k_fill=128.0, gemm_misaligned=0.1368,
    attention_share=0.9518, attention_block=1024.0, attention_head_dim_fill=16.0,
    attention_backward_share=0.8293, stream_efficiency=0.8846, norm_efficiency=0.5668,
    softmax_efficiency=0.6389, cast_efficiency=0.5733, kernel_gap=5e-06, host_op=1.014e-05, host_backward_share=0.5,
    host_gemm=1.328e-05, adam_fused_per_tensor=5.664e-06, adam_fused_efficiency=0.7664,
    adam_foreach_per_tensor=1.53e-05, adam_foreach_efficiency=0.3184, h2d_pinned=5.472e10,
    h2d_pageable=1.799e10,
    source="fit to the H100 op table cost_models/reference/h100_ops.csv (207 rows) by "
           "cost_models/gpu_fit.fit_gpu",
).items()})

GPU_PRESETS = MappingProxyType({
    "dgx-a100-80gb": NodeSpec(
        device=_A100_80GB,
        devices_per_node=8,  # PUBLISHED.md: 8 GPUs per node
        # PUBLISHED.md: NVLink 600 GB/s both directions = 300 GB/s each way, NVSwitch.
        intra_node=MappingProxyType(dict(bandwidth=300e9, latency=_NVLINK_LATENCY)),
        # PUBLISHED.md: 8 x 200 Gb/s HDR InfiniBand, one per GPU: 200e9 / 8 = 25e9 B/s.
        inter_node=MappingProxyType(dict(bandwidth=25e9, latency=_IB_LATENCY)),
        source="DGX A100 80GB: PUBLISHED.md (NVIDIA datasheets as quoted in Megatron-LM "
        "SC'21); fp32/tf32 peaks from the NVIDIA A100 datasheet; idle power and "
        "latencies assumed",
    ),
    "dgx-h100": NodeSpec(
        device=_H100_80GB,
        devices_per_node=8,  # PUBLISHED.md: 8 GPUs per node
        # PUBLISHED.md: 900 GB/s both directions = 450 GB/s each way. NCCL issue #1264
        # measured about 376-380 GB/s; we keep the nominal figure and leave the
        # achieved fraction to the calibrated communication model.
        intra_node=MappingProxyType(dict(bandwidth=450e9, latency=_NVLINK_LATENCY)),
        # PUBLISHED.md: 400 Gb/s per GPU (ConnectX-7) = 50e9 B/s.
        inter_node=MappingProxyType(dict(bandwidth=50e9, latency=_IB_LATENCY)),
        source="DGX H100: PUBLISHED.md (NVIDIA datasheets; NCCL issue #1264); fp32/tf32 "
        "peaks from the NVIDIA H100 datasheet; idle power and latencies assumed; kernel, host and "
        "optimizer constants fit to the project's H100 op table (fit.gpu.*)",
        measurements=_H100_FIT,
    ),
    "summit": NodeSpec(
        device=_V100_16GB,
        devices_per_node=6,  # PUBLISHED.md: 6 GPUs + 2 POWER9 per node
        # PUBLISHED.md: NVLink 2.0, 50 GB/s each way between GPU pairs. Caveat: GPUs on
        # different sockets go through the POWER9 X-Bus; two link levels can't show it.
        intra_node=MappingProxyType(dict(bandwidth=50e9, latency=_NVLINK_LATENCY)),
        # PUBLISHED.md: dual-rail EDR, 2 x 100 Gb/s = 25e9 B/s per node, shared by 6 GPUs.
        inter_node=MappingProxyType(dict(bandwidth=25e9 / 6, latency=_IB_LATENCY)),
        source="Summit (OLCF): PUBLISHED.md (Summit user guide); fp32 peak from the "
        "NVIDIA V100 datasheet; idle power and latencies assumed",
    ),
})

# CPU power cannot be read portably from user space. ASSUMPTION: one core's share of a
# typical server CPU, the Intel Xeon Platinum 8380 (270 W TDP over 40 cores, Intel ARK)
# = 6.75 W active; idle taken as about 30% of that. Only energy estimates use them.
CPU_ACTIVE_WATTS_PER_CORE = 270.0 / 40
CPU_IDLE_WATTS_PER_CORE = 2.0


def local_spec(devices: int | None, figures: Mapping[str, Any] | None = None) -> NodeSpec:
    """``devices`` CPU processes on this machine (the ``local`` preset), from measured (cached) figures,
    or from ``figures`` (a record of cost_models.local_machine's form: a fixed machine, nothing measured).

    Compute and memory figures are those of one process on one thread. With more
    processes than usable CPUs, each process runs only ``cpus / devices`` of the time,
    so its rates (and its power share) are scaled down by that fraction. Memory is the
    machine's RAM split evenly. Both link levels are the measured loopback TCP link,
    which is what gloo uses between local processes.
    """
    m = dict(figures) if figures is not None else local_machine.load_or_measure()
    cpus = int(m["usable_cpus"])
    n = cpus if devices is None else devices
    share = min(1.0, cpus / n)
    link = MappingProxyType(dict(bandwidth=m["link_bandwidth"], latency=m["link_latency"]))
    return NodeSpec(
        devices_per_node=n,
        device=MappingProxyType(dict(
            name=f"cpu process ({m['cpu_model']})",
            kind=DeviceKind.CPU,
            peak_flops={"fp32": m["fp32_flops"] * share, "bf16": m["bf16_flops"] * share,
                        "fp16": m["fp16_flops"] * share},
            memory_bytes=int(m["memory_bytes"]) // n,
            memory_bandwidth=m["memory_bandwidth"] * share,
            active_watts=CPU_ACTIVE_WATTS_PER_CORE * share,
            idle_watts=CPU_IDLE_WATTS_PER_CORE * share,
        )),
        intra_node=link,
        inter_node=link,
        source=(
            f"measured on host {m['hostname']} ({m['cpu_model']}, {cpus} usable CPUs, "
            f"torch {m['torch_version']}) at {m['measured_at']} by "
            f"cost_models.local_machine; {n} processes on {cpus} CPUs (rates x{share:.3g}); "
            f"CPU power assumed"
        ),
        measurements=m,
    )


def preset_names() -> tuple[str, ...]:
    """Names Cluster.preset accepts, sorted."""
    return tuple(sorted([*GPU_PRESETS, LOCAL_PRESET]))


def preset_spec(name: str, nodes: int | None, devices: int | None,
                figures: Mapping[str, Any] | None) -> tuple[int, int, NodeSpec]:
    """(nodes, devices per node, what each node is made of) of the preset `name` at the sizes asked for
    (the arguments of Cluster.preset, which documents them). Raises ValueError for an unknown name (listing
    the known ones) or bad sizes."""
    if name == LOCAL_PRESET:
        if nodes not in (None, 1):
            raise ValueError(
                f"the 'local' preset is this one machine: nodes must be 1, got {nodes!r}"
            )
        spec = local_spec(None if devices is None else _count(devices, "devices"), figures)
        return 1, spec.devices_per_node, spec
    if figures is not None:
        raise ValueError(f"figures describe this machine for the 'local' preset; preset {name!r} has "
                         "published figures (edit a saved cluster file to change them)")
    spec = GPU_PRESETS.get(name) if isinstance(name, str) else None
    if spec is None:
        known = preset_names()
        raise ValueError(
            f"unknown cluster preset {name!r}.{did_you_mean(str(name), known)} "
            f"Known presets: {', '.join(known)}."
        )
    num_nodes = 1 if nodes is None else _count(nodes, "nodes")
    per_node = spec.devices_per_node
    if devices is not None:
        if _count(devices, "devices") > per_node:
            raise ValueError(
                f"preset {name!r} has {per_node} GPUs per node, so devices={devices} "
                f"does not fit one node; ask for nodes=N (with devices <= {per_node})."
            )
        per_node = devices
    return num_nodes, per_node, spec


def _count(value: Any, what: str) -> int:
    """``value`` as an integer >= 1, else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return int(value)

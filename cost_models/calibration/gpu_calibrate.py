"""`meshplan calibrate` on a GPU: this one device's op table, and the cluster file that carries it.

    device = calibration_device("auto")            # cuda when this machine has one, else cpu
    cluster = calibrate_gpu(device, quick=True)     # measure_gpu_ops, then gpu_cluster
    cluster.save("h100.yaml")                       # --cluster h100.yaml prices this machine

One device, no second rank: the op rows (cost_models/calibration/gpu_ops.py) are measured in this
process, and no collective is (one GPU has no peer; the links are the nominal figures of the
preset of the same GPU model, or an assumption, and the file says which). The cluster file keeps:

- device: the name, SM count and memory torch reports; memory_bandwidth the measured copy_d2d
  rate (bytes read and written per second); peak_flops per dtype the fastest measured GEMM of
  that dtype (so a fit's GEMM ceiling is relative to what this device reached); power from the
  preset of the same model, else assumed;
- measurements: raw.gpu_ops, every op row (a table of records: OpRow.to_dict, read back with
  cost_models.op_table.measured_rows), calibration.* (mode, seconds, versions), and the GPU cost
  model's constants fit to the rows, fit.gpu.* (cost_models.gpu_fit.fit_gpu).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from cost_models.calibration.calibrate import CalibrationError
from cost_models.calibration.gpu_ops import measure_gpu_ops
from cost_models.gpu_fit import error_report, fit_gpu
from cost_models.hardware import Cluster, Device, Link
from cost_models.op_table import GPU_OPS_KEY, OpRow
from cost_models.presets import GPU_PRESETS
from runtime.vocab import DeviceKind

# A GPU no preset describes: ASSUMPTIONS, for energy estimates only (power) and for a build of more
# GPUs than were calibrated (links: PCIe Gen4-like, through the host).
_ASSUMED_WATTS = (400.0, 60.0)
_ASSUMED_LINK = {"bandwidth": 25e9, "latency": 10e-6}
_GEMMS = ("mm_fwd", "mm_dgrad", "mm_wgrad")
_PEAK_DTYPES = ("bf16", "fp16", "fp32", "tf32")


@dataclass(frozen=True)
class GpuInfo:
    """What torch says about the device: name, streaming multiprocessors, memory bytes, versions."""

    name: str
    sm_count: int
    memory_bytes: int
    torch_version: str = ""
    cuda_version: str = ""

    @classmethod
    def of(cls, device: torch.device) -> "GpuInfo":
        p = torch.cuda.get_device_properties(device)
        # plain str: torch.__version__ is a TorchVersion, which a YAML cluster file cannot hold
        return cls(str(p.name), int(p.multi_processor_count), int(p.total_memory), str(torch.__version__),
                   str(torch.version.cuda or ""))


def calibration_device(spec: str | None) -> torch.device:
    """The device `meshplan calibrate --device` names: "auto" (or None) is cuda when this machine has a
    CUDA device, else cpu; "cpu"; "cuda" or "cuda:N". A CUDA device that is not here is a user error."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise CalibrationError(f"--device {spec!r}: name auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CalibrationError(f"--device {spec}: this machine has no CUDA device (torch {torch.__version__}: "
                                   "torch.cuda.is_available() is False); run the calibration on the GPU machine, "
                                   "or calibrate this CPU with --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CalibrationError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                                   f"numbered from 0")
    return device


def _preset_for(name: str):
    """The GPU preset of the same model as the device named `name` (its A100/H100/V100 token), or None."""
    for preset, spec in sorted(GPU_PRESETS.items()):
        if spec.device["name"].split("-")[0].lower() in name.lower():
            return preset, spec
    return None


def gpu_device(rows: list[OpRow], info: GpuInfo) -> tuple[Device, str]:
    """(the Device the rows and `info` describe, the text of where its figures come from).

    For a GPU model a preset knows (H100, A100, V100) the peaks and the memory bandwidth stay the preset's
    nominal figures, so the fitted fractions of them (fit.gpu.*) compare with the preset's own; for another
    GPU they are the fastest measured GEMM per dtype and the measured device copy."""
    match = _preset_for(info.name)
    peaks = {}
    for dtype in _PEAK_DTYPES:
        rates = [r.tflops for r in rows if r.op in _GEMMS and r.dtype == dtype and r.tflops]
        if rates:
            peaks[dtype] = max(rates) * 1e12
    if not peaks:
        raise CalibrationError("the GPU calibration measured no GEMM (every mm_* row failed); see its output")
    copy = [r.gbps for r in rows if r.op == "copy_d2d" and r.gbps]
    if not copy:
        raise CalibrationError("the GPU calibration measured no device copy (copy_d2d); see its output")
    watts = (match[1].device["active_watts"], match[1].device["idle_watts"]) if match else _ASSUMED_WATTS
    if match:
        peaks, bandwidth = dict(match[1].device["peak_flops"]), float(match[1].device["memory_bandwidth"])
        figures = f"peak FLOP/s and memory bandwidth: preset {match[0]}'s nominal figures (the fits are fractions of them)"
    else:
        bandwidth = max(copy) * 1e9
        figures = "peak FLOP/s: the fastest measured GEMM per dtype; memory bandwidth: the measured device copy"
    device = Device(name=info.name, kind=DeviceKind.GPU, peak_flops=peaks, memory_bytes=info.memory_bytes,
                    memory_bandwidth=bandwidth, active_watts=watts[0], idle_watts=watts[1],
                    compute_units=info.sm_count)
    power = f"power from preset {match[0]}" if match else "power assumed"
    return device, f"{figures}; {power}"


def fit_measurements(rows: list[OpRow], device: Device, progress: Callable[[str], None] | None = print) -> dict:
    """fit.gpu.* of the GPU cost model fit to `rows` (cost_models.gpu_fit.fit_gpu), with the fit's per-family
    errors printed through `progress`."""
    t0 = time.perf_counter()
    fitted = fit_gpu(rows, device, source=f"fit to {len(rows)} op rows measured on this {device.name} by "
                                          "meshplan calibrate (cost_models/gpu_fit.fit_gpu)")
    if progress:
        progress(f"  fit the GPU cost model's constants to the rows in {time.perf_counter() - t0:.1f} s:")
        for line in error_report(rows, device, fitted).splitlines():
            progress("    " + line)
    return fitted.to_measurements()


def gpu_cluster(rows: list[OpRow], info: GpuInfo, *, quick: bool, seconds: float = 0.0, name: str = "gpu-calibrated",
                fit: Callable[..., dict] = fit_measurements,
                progress: Callable[[str], None] | None = print) -> Cluster:
    """The one-device Cluster of a GPU calibration: the Device from `rows` and `info` (gpu_device), the
    rows under raw.gpu_ops, and fit(rows, device, progress)'s fit.gpu.* constants."""
    if not rows:
        raise CalibrationError("the GPU calibration measured no op row; see its output")
    device, figures = gpu_device(rows, info)
    match = _preset_for(info.name)
    link = Link(**match[1].intra_node) if match else Link(**_ASSUMED_LINK)
    far = Link(**match[1].inter_node) if match else Link(**_ASSUMED_LINK)
    links = f"links: preset {match[0]}'s nominal figures" if match else "links assumed (PCIe-like)"
    m: dict = {
        "calibration.device": "cuda", "calibration.mode": "quick" if quick else "full",
        "calibration.seconds": round(seconds, 3), "calibration.gpu": info.name,
        "calibration.torch": info.torch_version, "calibration.cuda": info.cuda_version,
        "calibration.measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "calibration.collectives": "not measured: one GPU has no peer to communicate with",
        GPU_OPS_KEY: [r.to_dict() for r in rows],
    }
    m.update(fit(rows, device, progress))
    source = (f"meshplan calibrate ({'quick' if quick else 'full'}) on one {info.name}: {len(rows)} op rows timed "
              f"with CUDA events ({GPU_OPS_KEY}), fits under fit.gpu.*; {figures}; collectives not measured (one "
              f"GPU), {links}")
    return Cluster(name=name, num_nodes=1, devices_per_node=1, device=device, intra_node=link, inter_node=far,
                   source=source, measurements=m)


def calibrate_gpu(device: torch.device, *, quick: bool = True,
                  progress: Callable[[str], None] | None = print) -> Cluster:
    """Measure the CUDA device `device` and build its Cluster (see the module docstring)."""
    info = GpuInfo.of(device)
    if progress:
        progress(f"calibrating {device} ({info.name}, {info.sm_count} SMs, {info.memory_bytes / 2**30:.1f} GiB) on "
                 f"its own ({'quick' if quick else 'full'}): the op table, timed with CUDA events; collectives are "
                 "not measured on one GPU (no second rank) ...")
    t0 = time.perf_counter()
    rows = measure_gpu_ops(device, quick=quick, progress=progress)
    return gpu_cluster(rows, info, quick=quick, seconds=time.perf_counter() - t0, progress=progress)

"""A fixed `local` cluster for tests whose expectations depend on the relative prices of compute and
communication (which plan the search picks, which regions tensor parallelism splits): the figures of
this project's 2-core test VM measured while it was quiet, so that no measurement taken on a busy
machine (tests/conftest.py) changes what these tests expect."""

from __future__ import annotations

from cost_models.hardware import Cluster
from cost_models.local_machine import CACHE_FORMAT_VERSION, machine_key

GiB = 2 ** 30

# cost_models/local_machine.py's record: one process on one thread of the test VM, quiet
FIGURES = {
    "usable_cpus": 2,
    "cpu_model": "AMD EPYC (fixed test figures)",
    "memory_bytes": 24 * GiB,
    "fp32_flops": 2.0e10,        # FLOP/s, a 1024^3 torch.mm
    "bf16_flops": 5.2e10,        # 2.6x fp32, as the README reports for this VM
    "fp16_flops": 2.5e8,         # 80x slower than fp32
    "memory_bandwidth": 1.0e10,  # B/s, read + write
    "link_bandwidth": 3.6e9,     # B/s, loopback TCP
    "link_latency": 3e-6,        # s, one way
    "load_per_cpu": 0.1,
    "latency_spread": 1.0,
    "measured_at": "2026-11-01T00:00:00Z",
    "measure_seconds": 1.0,
}


def local_cluster(devices: int) -> Cluster:
    """The `local` preset with `devices` processes on the fixed figures (nothing measured or read)."""
    return Cluster.preset("local", devices=devices,
                          figures={"format_version": CACHE_FORMAT_VERSION, **machine_key(), "cpu_count": 2,
                                   **FIGURES})

"""`meshplan calibrate --device cuda --quick` on the GPU: every op family measured with CUDA events, a
cluster file that loads with the rows and the device's figures, and the op table as CSV.

The quick mode (88 rows) must keep the whole command under 2 minutes on an H100; the full mode's 215
rows are not run here."""

import time

import pytest
import torch

from cost_models.calibration.gpu_families import FAMILIES
from cost_models.calibration.gpu_ops import gpu_op_specs
from cost_models.hardware import Cluster
from cost_models.op_table import measured_rows, read_op_table
from planner.app.cli import main

QUICK_LIMIT_S = 120.0   # the bound for the quick mode on an H100
# Far above what any GPU reaches: a row past these timed something other than its call.
MAX_TFLOPS, MAX_GBPS = 5000.0, 20000.0


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_calibrate")
    out, table = tmp / "gpu.yaml", tmp / "gpu_ops.csv"
    t0 = time.perf_counter()
    assert main(["calibrate", "--device", "cuda", "--quick", "--out", str(out), "--op-table", str(table)]) == 0
    return Cluster.load(out), read_op_table(table), time.perf_counter() - t0


def test_quick_calibration_measures_every_family(calibrated):
    cluster, rows, seconds = calibrated
    want = {(s.op, s.shape, s.dtype) for _, specs in gpu_op_specs(True) for s in specs}
    assert {(r.op, r.shape, r.dtype) for r in rows} == want      # no row left out (none ran out of memory)
    assert {r.op for r in rows} == set(FAMILIES)
    for r in rows:
        assert r.ms > 0, r
        assert (r.tflops or 0) < MAX_TFLOPS and (r.gbps or 0) < MAX_GBPS, r
    # the aligned vocabulary's lm_head is not slower than the one off a multiple of 64 (the cliff)
    ms = {r.shape: r.ms for r in rows}
    assert ms["lm_head M8192 K768 N50304"] < ms["lm_head M8192 K768 N50257"]
    if "H100" in torch.cuda.get_device_name():
        assert seconds < QUICK_LIMIT_S, seconds
    print(f"quick GPU calibration: {len(rows)} rows, {seconds:.1f} s for the whole command")


def test_the_cluster_file_carries_the_rows_and_the_device(calibrated):
    cluster, rows, _seconds = calibrated
    props = torch.cuda.get_device_properties(0)
    d = cluster.device
    assert d.kind == "gpu" and d.name == props.name and d.compute_units == props.multi_processor_count
    assert d.memory_bytes == props.total_memory
    gemm = max(r.tflops for r in rows if r.op.startswith("mm_") and r.dtype == "bf16")
    assert d.peak("bf16") == pytest.approx(gemm * 1e12, rel=1e-3)
    copy = next(r for r in rows if r.op == "copy_d2d")
    assert d.memory_bandwidth == pytest.approx(copy.gbps * 1e9, rel=1e-3)
    back = measured_rows(cluster.measurements)
    assert [(r.op, r.shape, r.dtype) for r in back] == [(r.op, r.shape, r.dtype) for r in rows]
    assert all(abs(a.ms - b.ms) <= 1e-5 for a, b in zip(back, rows))     # the CSV keeps 5 decimals
    m = dict(cluster.measurements)
    assert m["calibration.device"] == "cuda" and m["calibration.mode"] == "quick"
    assert "not measured" in m["calibration.collectives"]

"""The GPU cost model against the project's H100 op table (cost_models/reference/h100_ops.csv), and the fit
that gives the dgx-h100 preset its constants (cost_models/gpu_fit.py, cost_models/gpu_costs.py)."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest

from cost_models.gpu_costs import GpuCosts, gpu_costs
from cost_models.gpu_fit import EXCLUDED, Dispatch, fit_gpu, predict_row, queue_seconds, row_errors
from cost_models.hardware import Cluster
from cost_models.op_table import OpRow, read_op_table

TABLE = Path(__file__).resolve().parents[2] / "cost_models" / "reference" / "h100_ops.csv"
H100 = Cluster.preset("dgx-h100", devices=1)

# Rows the 15% bound leaves out, each named with the reason (every other row is held to it):
OUTLIERS = {
    # measured far below the same layer's other GEMMs of the same size (forward 725, weight gradient 714
    # TFLOP/s): a poor kernel choice for this one layout, which no shape model of the rest follows
    ("mm_dgrad", "qkv M16384 K24576 N8192"): "588 TFLOP/s against 714-725 for the same layer's other GEMMs",
    ("mm_fwd", "fc1 M8192 K8192 N32768"): "619 TFLOP/s against 690-716 for the same shapes' other GEMMs",
    # a small GEMM faster than every neighbour of its size (proj and fc2 at M2048 run at 91-106)
    ("mm_wgrad", "fc2 M768 K2048 N3072"): "318 TFLOP/s, above every other GEMM of hidden 768 at 2048 tokens",
    # 1000 is no multiple of the 64- to 256-wide tiles: cuBLAS picks a kernel the tile model does not know
    ("mm_fwd", "square M1000 K1000 N1000"): "a 1000-wide square (no tile divides it) at 65 TFLOP/s",
}


@pytest.fixture(scope="module")
def rows():
    return read_op_table(TABLE)


@pytest.fixture(scope="module")
def fitted(rows):
    return fit_gpu(rows, H100.device)


def test_the_h100_preset_s_constants_are_the_fit_of_its_op_table(fitted):
    preset = gpu_costs(H100)
    for f in dataclasses.fields(GpuCosts):
        if f.name == "source":
            continue
        # the preset keeps 4 significant digits
        assert getattr(preset, f.name) == pytest.approx(getattr(fitted, f.name), rel=1e-3), f.name
    assert "h100_ops.csv" in preset.source


def test_every_op_family_is_within_15_percent_of_its_h100_rows(rows):
    families, skipped = row_errors(rows, H100.device, gpu_costs(H100))
    assert set(families) == {"gemm", "attention", "norm", "elementwise", "loss", "optimizer", "host_to_device",
                             "host"}
    for name, errs in families.items():
        assert statistics.median(abs(e.error) for e in errs) <= 0.10, name
        for e in errs:
            if (e.row.op, e.row.shape) not in OUTLIERS:
                assert abs(e.error) <= 0.15, f"{e.row.op} {e.row.shape}: {e.error:+.1%}"
    assert len([e for errs in families.values() for e in errs]) == len(rows) - len(skipped)
    # the outliers are still within a third, and the only rows not priced are the world-of-one collective's
    outliers = [e for e in families["gemm"] if (e.row.op, e.row.shape) in OUTLIERS]
    assert len(outliers) == len(OUTLIERS) and all(abs(e.error) < 1 / 3 for e in outliers)
    assert {r.op for r, _ in skipped} == set(EXCLUDED) == {"nccl_allreduce_ws1"}


def test_an_unaligned_vocabulary_makes_the_output_gemm_seven_times_slower(rows):
    costs = gpu_costs(H100)
    by = {(r.op, r.shape): r for r in rows}
    odd, even = by[("mm_fwd", "lm_head M16384 K768 N50257")], by[("mm_fwd", "lm_head M16384 K768 N50304")]
    ratio = predict_row(odd, H100.device, costs) / predict_row(even, H100.device, costs)
    assert ratio == pytest.approx(odd.ms / even.ms, rel=0.15)     # measured 7.2x
    assert ratio > 6


def test_a_row_is_the_host_dispatching_its_ops_while_the_device_runs_them():
    # a small op: its dispatch then its kernel; a large one: the device never waits after the first
    assert queue_seconds([Dispatch(10e-6, 2e-6)]) == pytest.approx((10e-6, 12e-6))
    assert queue_seconds([Dispatch(10e-6, 1e-3), Dispatch(10e-6, 1e-3)])[1] == pytest.approx(10e-6 + 2e-3)
    # three small ops: the device waits for each dispatch
    assert queue_seconds([Dispatch(10e-6, 2e-6)] * 3)[1] == pytest.approx(30e-6 + 2e-6)


def test_the_fit_recovers_known_constants_from_rows_the_model_made(rows):
    truth = GpuCosts(gemm_ceiling=0.7, gemm_misaligned=0.2, attention_share=0.8, stream_efficiency=0.75,
                     norm_efficiency=0.5, softmax_efficiency=0.6, cast_efficiency=0.55, host_op=8e-6,
                     host_gemm=20e-6, adam_fused_per_tensor=4e-6, adam_fused_efficiency=0.6, h2d_pinned=40e9)
    made = [OpRow(r.op, r.shape, r.dtype, predict_row(r, H100.device, truth) * 1e3) for r in rows
            if predict_row(r, H100.device, truth) is not None]
    got = fit_gpu(made, H100.device)
    for name in ("gemm_ceiling", "gemm_misaligned", "attention_share", "stream_efficiency", "norm_efficiency",
                 "softmax_efficiency", "cast_efficiency", "host_op", "host_gemm", "adam_fused_per_tensor",
                 "adam_fused_efficiency", "h2d_pinned"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.03), name


def test_gpu_costs_ride_in_a_cluster_file_and_other_gpus_keep_the_published_defaults(tmp_path):
    path = tmp_path / "h100.yaml"
    H100.save(path)
    assert gpu_costs(Cluster.load(path)) == gpu_costs(H100)
    assert gpu_costs(Cluster.preset("dgx-a100-80gb")) == GpuCosts()
    with pytest.raises(ValueError, match="gemm_ceiling"):
        GpuCosts(gemm_ceiling=1.5)

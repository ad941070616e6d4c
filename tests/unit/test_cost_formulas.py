"""Cost-model formulas against hand-computed values, and their monotonicity."""

import math

import pytest

from cost_models.compute import Efficiency, op_time, wave_efficiency
from cost_models.memory import live_micro_batches, param_bytes
from cost_models.schedule import bubble_fraction, pipeline_time
from planner.config import ConfigError, ParallelConfig


def test_bubble_fractions_by_hand():
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("1f1b", 1, 8) == 0.0


def test_more_micro_batches_never_increase_the_gpipe_bubble():
    fracs = [bubble_fraction("gpipe", 8, m) for m in range(1, 200)]
    assert all(a >= b for a, b in zip(fracs, fracs[1:]))


def test_pipeline_time_is_m_plus_p_minus_1_slots():
    total, bubble = pipeline_time("1f1b", 4, 8, slot=2.0)
    assert total == pytest.approx((8 + 4 - 1) * 2.0) and bubble == pytest.approx(3 * 2.0)
    total, bubble = pipeline_time("interleaved", 4, 8, slot=2.0, virtual_stages=3)
    assert total == pytest.approx((8 + 3 / 3) * 2.0)


def test_adam_mixed_precision_bytes_per_parameter():
    pb = param_bytes("bf16", 0, 8)
    assert (pb.weights, pb.gradients, pb.optimizer) == (2, 2, 12) and pb.total == 16
    assert param_bytes("fp32", 0, 1).total == 16  # 4 weights + 4 grads + 8 (m, v)
    assert param_bytes("bf16", 1, 8).optimizer == 12 / 8
    z2 = param_bytes("bf16", 2, 8)
    assert (z2.gradients, z2.weights) == (2 / 8, 2)
    z3 = param_bytes("bf16", 3, 4)
    assert (z3.weights, z3.gradients, z3.optimizer) == (0.5, 0.5, 3)
    totals = [param_bytes("bf16", z, 8).total for z in range(4)]
    assert totals == sorted(totals, reverse=True)


def test_live_micro_batches_per_schedule():
    assert live_micro_batches("gpipe", 0, 4, 16) == 16
    assert [live_micro_batches("1f1b", i, 4, 16) for i in range(4)] == [4, 3, 2, 1]
    assert live_micro_batches("1f1b", 0, 4, 2) == 2  # never more than there are
    assert live_micro_batches("interleaved", 0, 4, 16, 2) == pytest.approx(4 + 3 / 2)


def test_wave_quantization_by_hand():
    # 2048 x 4608 output: 8 x 36 = 288 tiles on 108 SMs = 2.67 waves of 3.
    assert wave_efficiency(2048, 4608, 108) == pytest.approx(288 / 324)
    assert wave_efficiency(256 * 108, 128, 108) == 1.0
    assert wave_efficiency(100, 100, 0) == 1.0  # CPU: no SMs


def test_roofline_compute_and_memory_bound():
    eff = Efficiency(matmul=0.5, conv=0.5, memory=0.5, kernel_overhead=1e-6)
    # 1e12 FLOPs at 100 TFLOP/s x 0.5 = 20 ms; 1 MB at 1 TB/s x 0.5 = 2 us: compute-bound.
    assert op_time("linear", 1e12, 1e6, 100e12, 1e12, eff) == pytest.approx(0.02 + 1e-6)
    # An elementwise op on 1 GB: memory-bound, 2 ms.
    assert op_time("elementwise", 0, 1e9, 100e12, 1e12, eff) == pytest.approx(2e-3 + 1e-6)
    assert op_time("view", 0, 1e9, 100e12, 1e12, eff) == 0.0
    assert math.isclose(op_time("linear", 1e12, 0, 100e12, 1e12, eff, shape_efficiency=0.5), 0.04 + 1e-6)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(data=0), "data must be a positive integer"),
    (dict(schedule="zigzag"), "schedule='zigzag' is not one of"),
    (dict(recompute="some"), "recompute='some'"),
    (dict(zero=4), "zero must be 0, 1, 2 or 3"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(schedule="interleaved", pipeline=2), "virtual_stages >= 2"),
    (dict(virtual_stages=2), "needs schedule='interleaved'"),
    (dict(pipeline=3, stage_boundaries=("a",)), "3 stages need 2"),
])
def test_parallel_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        ParallelConfig(**kwargs)


def test_parallel_config_round_trip_and_micro_batches():
    cfg = ParallelConfig(data=2, tensor=2, pipeline=2, micro_batch_size=2, schedule="interleaved",
                         virtual_stages=2, stage_boundaries=("a", "b", "c"))
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.num_devices == 8 and cfg.num_stages == 4
    assert cfg.micro_batches(16) == 4
    with pytest.raises(ConfigError, match="global batch 10 is not a multiple of micro_batch_size 2 x data 2"):
        cfg.micro_batches(10)
    with pytest.raises(ConfigError, match="unknown ParallelConfig field"):
        ParallelConfig.from_dict({"dat": 2})

"""Calibration fits and the calibrated cluster: alpha-beta, per-kind overheads, and how the cost models use them."""

import dataclasses

import pytest

from cost_models.calibration.calibrate import build_cluster, fit_alpha_beta, for_world
from cost_models.calibration.ops import BLOCK, KINDS, OpTiming, fit_compute
from cost_models.calibrated import call_overheads, calibrated_efficiency, fitted_collective, overlap_hidden
from cost_models.comm import collective_time
from cost_models.compute import Efficiency, op_time
from cost_models.hardware import Cluster
from cost_models.mesh_axes import axis_collective_time
from cost_models.simulate import ComputeCosts

PEAK, BW = 50e9, 10e9


def test_fit_alpha_beta_recovers_exact_constants():
    pts = [(n, 80e-6 + n * 2e-10) for n in (8, 1024, 1 << 16, 1 << 20, 1 << 22)]
    a, b = fit_alpha_beta(pts)
    assert a == pytest.approx(80e-6, rel=1e-6) and b == pytest.approx(2e-10, rel=1e-6)


def test_fit_alpha_beta_keeps_alpha_non_negative_and_refuses_one_size():
    a, b = fit_alpha_beta([(1000, 1e-7), (10**6, 1e-3), (10**7, 1e-2)])
    assert a >= 0 and b > 0
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta([(8, 1e-5), (8, 2e-5)])


def _timings(scale=1.0):
    small = [OpTiming(k, "small", 10e-6 * scale, 20e-6 * scale, 1e3, 1e3) for k in KINDS]
    medium = [OpTiming("linear", "medium", 10e-6 + 2e9 / (PEAK * 0.5), 0.0, 2e9, 1e6),
              OpTiming("conv", "medium", 10e-6 + 1e9 / (PEAK * 0.25), 0.0, 1e9, 1e6),
              OpTiming("elementwise", "medium", 10e-6 + 1e8 / (BW * 0.8), 0.0, 1e6, 1e8)]
    return small + medium


def test_fit_compute_overheads_efficiencies_and_mix():
    fit = fit_compute(_timings(), PEAK, BW)
    assert fit.matmul == pytest.approx(0.5, rel=1e-3) and fit.conv == pytest.approx(0.25, rel=1e-3)
    assert fit.memory == pytest.approx(0.8, rel=1e-3)
    over = {k: (f, b) for k, f, b in fit.kind_overheads}
    assert over["linear"][0] == pytest.approx(10e-6 - max(1e3 / PEAK, 1e3 / BW), rel=1e-6)  # minus its roofline
    # A layer of alternating kinds twice as slow as its ops alone: every overhead doubles.
    alone_f = sum(over[k][0] for k in BLOCK)
    alone_b = sum(over[k][1] for k in BLOCK)
    mixed = fit_compute(_timings(), PEAK, BW, block=(2 * alone_f, 3 * alone_b, 5e-5, 7e-5))
    assert mixed.mix_forward == pytest.approx(2.0) and mixed.mix_backward == pytest.approx(3.0)
    assert dict((k, f) for k, f, _ in mixed.kind_overheads)["norm"] == pytest.approx(2 * over["norm"][0])
    assert (mixed.call_forward, mixed.call_backward) == (5e-5, 7e-5)
    with pytest.raises(ValueError, match="missing"):
        fit_compute(_timings()[1:], PEAK, BW)


def _results(ranks=2):
    comm = []
    for op, a, b in (("all_reduce", 300e-6, 1e-9), ("all_gather", 250e-6, 8e-10), ("reduce_scatter", 260e-6, 8e-10),
                     ("broadcast", 150e-6, 3e-10), ("p2p", 80e-6, 2e-10)):
        comm += [[op, 2, n, a + b * n] for n in (8, 1024, 1 << 17, 1 << 20)]
    ops = [dataclasses.asdict(t) for t in _timings()]
    return [{"rank": r, "ops": ops, "block": [3e-4, 5e-4, 1e-4, 1.2e-4], "cpu_share": 0.5, "sync_all_reduce": 300e-6 + 8e-9 + 50e-6, "peak_flops": PEAK,
             "memory_bandwidth": BW, "comm": comm if r == 0 else []} for r in range(ranks)]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_calibrated_cluster_round_trips_and_prices_with_its_fits(tmp_path, suffix):
    cl = build_cluster(_results())
    cl.save(tmp_path / f"c{suffix}")
    back = Cluster.load(tmp_path / f"c{suffix}")
    assert back == cl
    # Rates are scaled by the CPU share (0.5) the busy ranks got; fixed costs divided by it.
    assert back.device.peak("fp32") == pytest.approx(PEAK * 0.5)
    # Every alpha carries the 50 us a small all-reduce takes longer right after computing.
    assert dict(back.measurements)["fit.comm.wake"] == pytest.approx(50e-6, rel=1e-6)
    assert back.intra_node.latency == pytest.approx(80e-6 + 50e-6, rel=1e-6)
    assert back.intra_node.bandwidth == pytest.approx(1 / 2e-10, rel=1e-6)
    eff = calibrated_efficiency(back)
    assert eff is not None and eff.matmul == pytest.approx(0.5, rel=1e-3)
    assert dict((k, f) for k, f, _ in eff.kind_overheads)["view"] > 0
    assert fitted_collective(back, "all_reduce", 2) == pytest.approx((350e-6, 1e-9), rel=1e-6)
    ar = collective_time(back, "all_reduce", 1 << 20, [0, 1])
    assert ar.algorithm == "measured" and ar.seconds == pytest.approx(350e-6 + (1 << 20) * 1e-9, rel=1e-6)
    assert axis_collective_time(back, {"data": 2}, "data", "all_reduce", 1 << 20).seconds == pytest.approx(ar.seconds)
    assert call_overheads(back) == pytest.approx((1e-4 / 0.5, 1.2e-4 / 0.5))
    # Group sizes that were not measured fall back to the alpha-beta link model.
    four = for_world(back, 4)
    assert four.num_devices == 4 and collective_time(four, "all_reduce", 1024, [0, 1, 2, 3]).algorithm != "measured"


def test_collectives_follow_the_measured_table_where_it_is_not_affine():
    # gloo on loopback: 1 KiB - 128 KiB all-reduces cost as much as 1 MiB, far above alpha + beta n.
    results = _results()
    table = {8: 300e-6, 1024: 2e-3, 1 << 17: 2.2e-3, 1 << 20: 3e-3}
    results[0]["comm"] = [r for r in results[0]["comm"] if r[0] != "all_reduce"] + \
        [["all_reduce", 2, n, t] for n, t in table.items()]
    results[0]["overlap"] = [0.4, 1e-2, 2e-3, 1.1e-2]
    results[1]["overlap"] = [0.6, 1e-2, 2e-3, 1.1e-2]
    cl = build_cluster(results)
    wake = dict(cl.measurements)["fit.comm.wake"]
    beta = fitted_collective(cl, "all_reduce", 2)[1]

    def ar(n):
        return collective_time(cl, "all_reduce", n, [0, 1]).seconds
    assert ar(1024) == pytest.approx(2e-3 + wake) and ar(4) == pytest.approx(300e-6 + wake)
    assert ar(516) == pytest.approx((300e-6 + 2e-3) / 2 + wake)           # halfway between 8 and 1024 bytes
    assert ar(1 << 21) == pytest.approx(3e-3 + beta * (1 << 20) + wake)   # fitted beta past the table
    assert ar(0) == 0.0
    assert overlap_hidden(cl) == pytest.approx(0.5)                      # median over the ranks
    assert dict(cl.measurements)["raw.overlap.overlapped"] == pytest.approx(1.1e-2)


def test_uncalibrated_clusters_are_unchanged():
    cl = Cluster.preset("dgx-a100-80gb")
    assert calibrated_efficiency(cl) is None and fitted_collective(cl, "all_reduce", 2) is None
    assert call_overheads(cl) == (0.0, 0.0) and overlap_hidden(cl) == 1.0
    assert collective_time(cl, "all_reduce", 1 << 20, [0, 1]).algorithm in ("ring", "tree")


def test_kind_overheads_replace_kernel_overhead_and_price_views():
    eff = Efficiency(matmul=1.0, conv=1.0, memory=1.0, kernel_overhead=1e-5,
                     kind_overheads=(("view", 2e-6, 3e-6), ("linear", 4e-5, 9e-5)))
    assert op_time("linear", 0, 0, 1e12, 1e12, eff) == pytest.approx(4e-5)
    assert op_time("linear", 0, 0, 1e12, 1e12, eff, kernels=2, backward=True) == pytest.approx(9e-5)
    assert op_time("elementwise", 0, 0, 1e12, 1e12, eff, kernels=2, backward=True) == pytest.approx(2e-5)
    assert op_time("view", 0, 0, 1e12, 1e12, eff, backward=True) == pytest.approx(3e-6)
    assert op_time("view", 0, 0, 1e12, 1e12, Efficiency.default_for(Cluster.preset("dgx-h100").device)) == 0.0
    with pytest.raises(ValueError, match="kind_overheads"):
        Efficiency(matmul=1.0, conv=1.0, memory=1.0, kernel_overhead=0.0, kind_overheads=(("x", -1.0, 0.0),))


def test_compute_costs_add_the_calibrated_call_overhead():
    from cost_models.prediction import MemoryBreakdown, StagePrediction

    cl = build_cluster(_results())
    mem = MemoryBreakdown(0, 0, 0, 0, 0, 0)
    pred = type("P", (), {"stages": (StagePrediction(0, "a", "b", 1, 1e-3, 2e-3, mem),),
                          "time": type("T", (), {"optimizer": 0.0})()})()
    costs = ComputeCosts.from_prediction(pred, cl)
    assert costs.forward[0] == pytest.approx(1e-3 + 2e-4) and costs.backward[0] == pytest.approx(2e-3 + 2.4e-4)
    assert ComputeCosts.from_prediction(pred).forward[0] == 1e-3


def test_optimizer_fixed_cost_per_tensor_is_measured_and_priced():
    from cost_models.calibration.ops import OPTIMIZER_KINDS, time_optimizer_steps
    from cost_models.calibrated import optimizer_per_step, optimizer_per_tensor

    measured = time_optimizer_steps(tensors=8, few=2, steps=3)
    assert set(measured) == set(OPTIMIZER_KINDS)
    assert all(fixed >= 0 and per > 0 for fixed, per in measured.values())
    # (which optimizer costs more per tensor is a timing on a shared machine: not asserted here)
    results = _results()
    for r, scale in zip(results, (1.0, 3.0)):
        r["optimizer"] = {"sgd": 4e-6 * scale, "adamw": 2e-5 * scale}
        r["optimizer_fixed"] = {"adamw": 1e-5 * scale}
    cl = build_cluster(results)
    # median over the ranks, divided by the CPU share (0.5) like every fixed cost
    assert optimizer_per_tensor(cl, "adamw") == pytest.approx(2 * 2e-5 * 2)
    assert optimizer_per_step(cl, "adamw") == pytest.approx(2 * 1e-5 * 2)
    assert optimizer_per_tensor(cl, "sgd_momentum") == 0.0 and optimizer_per_step(cl, "sgd") == 0.0
    assert optimizer_per_tensor(Cluster.preset("dgx-a100-80gb"), "sgd") == 0.0

"""Calibrated op curves: interpolation, which nodes they price, the cluster file, and planner.evaluate."""

import math

import pytest

from cost_models.calibration.calibrate import build_cluster
from cost_models.calibrated import calibrated_efficiency, curve_mix, op_curves
from cost_models.hardware import Cluster
from cost_models.calibration.curves import time_op_curves
from cost_models.op_curves import FAMILIES, PROBE, PROBE_VIEWS, curve_time, fit_curve_mix, node_family, probe_ops
from tests.unit.test_calibrate import _results

# linear: 1 us fixed below 1e4 FLOPs, then 10 GFLOP/s; forward and backward (x2)
LINEAR = ((1e4, 1e-6), (1e6, 1e-4), (1e8, 1e-2))


def test_curve_time_interpolates_in_log_space_and_extends_past_the_ends():
    assert curve_time(LINEAR, 10) == pytest.approx(1e-6)            # below: the fixed cost
    assert curve_time(LINEAR, 1e6) == pytest.approx(1e-4)
    assert curve_time(LINEAR, 1e7) == pytest.approx(1e-3)           # a power law between points
    assert curve_time(((1.0, 1.0), (4.0, 16.0)), 2.0) == pytest.approx(4.0)
    assert curve_time(LINEAR, 1e9) == pytest.approx(1e-1)           # above: proportional to size
    assert curve_time(((1.0, 3e-6),), 1e9) == pytest.approx(3e-6)   # one point: size-independent
    with pytest.raises(ValueError, match="at least one"):
        curve_time((), 1.0)


@pytest.mark.parametrize("kind, target, attrs, family", [
    ("linear", "torch.nn.Linear", {}, "linear"),
    ("attention", "torch.nn.functional.scaled_dot_product_attention", {}, "attention"),
    ("norm", "torch.nn.LayerNorm", {}, "layer_norm"),
    ("norm", "torch.nn.BatchNorm2d", {}, None),
    ("elementwise", "torch.nn.GELU", {}, "gelu"),
    ("elementwise", "torch.nn.functional.relu", {}, "relu"),
    ("elementwise", "add", {}, "add"),
    ("elementwise", "torch.nn.Dropout", {"p": 0.0}, "identity"),
    ("elementwise", "torch.nn.Dropout", {"p": 0.1}, None),
    ("elementwise", "torch.tanh", {}, None),
    ("embedding", "torch.nn.Embedding", {}, "embedding"),
    ("conv", "torch.nn.Conv2d", {}, None),
])
def test_node_family(kind, target, attrs, family):
    assert node_family(kind, target, attrs) == family


def _curve_results():
    results = _results()
    rows = []
    for fam in FAMILIES:
        pts = LINEAR if fam in ("linear", "attention") else ((256, 2e-6), (1 << 20, 4e-4))
        if fam == "identity":
            pts = ((1.0, 3e-6),)
        if fam == "linear_thin":  # far below the FLOP curve here: test_thin_linear covers it
            pts = ((256, 1e-9), (1 << 20, 1e-8))
        rows += [[fam, s, t, 2 * t] for s, t in pts]
    curves = {fam: (tuple((s, f) for f_, s, f, _ in rows if f_ == fam), tuple((s, b) for f_, s, _, b in rows if f_ == fam))
              for fam in FAMILIES}
    total_f = sum(curve_time(curves[f][0], s) for f, s in probe_ops(**PROBE))
    total_b = sum(curve_time(curves[f][1], s) for f, s in probe_ops(**PROBE))
    for r in results:
        r["curves"] = rows
        # the probe block takes 1.25x (forward) and 1.5x (backward) its ops' curve times
        r["probe"] = [1.25 * total_f, 1.5 * total_b]
    return results, total_f, total_b


def test_cluster_file_carries_the_curves_and_their_in_layer_factor(tmp_path):
    results, _, _ = _curve_results()
    cl = build_cluster(results)
    cl.save(tmp_path / "c.yaml")
    back = Cluster.load(tmp_path / "c.yaml")
    curves = op_curves(back)
    assert set(curves) == set(FAMILIES)
    # unpreempted timings are divided by the CPU share the ranks got (0.5), like every fixed cost
    assert [x for pt in curves["linear"][0] for x in pt] == pytest.approx([x for s, t in LINEAR for x in (s, t / 0.5)])
    assert [x for pt in curves["linear"][1] for x in pt] == pytest.approx(
        [x for s, t in LINEAR for x in (s, 2 * t / 0.5)])
    # the factor: the probe's time less its views (at the calibrated view overhead) over its ops' curve sum
    view = {k: (f, b) for k, f, b in calibrated_efficiency(back).kind_overheads}["view"]
    _, total_f, total_b = _curve_results()
    mix_f, mix_b = curve_mix(back)
    assert mix_f == pytest.approx((1.25 * total_f / 0.5 - PROBE_VIEWS * view[0]) / (total_f / 0.5), rel=1e-9)
    assert mix_b == pytest.approx((1.5 * total_b / 0.5 - PROBE_VIEWS * view[1]) / (total_b / 0.5), rel=1e-9)
    assert 1.0 < mix_f < 1.25 and 1.0 < mix_b < 1.5
    assert op_curves(Cluster.preset("dgx-a100-80gb")) == {} and curve_mix(Cluster.preset("dgx-h100")) == (1.0, 1.0)


def test_fit_curve_mix_is_clamped():
    curves = {fam: (((1.0, 1e-6),), ((1.0, 1e-6),)) for fam in FAMILIES}
    n = len(probe_ops(**PROBE))
    assert fit_curve_mix(curves, (2 * n * 1e-6, n * 1e-6), (0.0, 0.0)) == pytest.approx((2.0, 1.0))
    assert fit_curve_mix(curves, (100.0, 0.0), (0.0, 0.0)) == (3.0, 0.5)


def test_evaluate_prices_fp32_nodes_from_the_curves():
    import planner
    from planner.evaluator import Evaluator
    from codegen.emit import capture_ref

    results, _, _ = _curve_results()
    cl = build_cluster(results)
    graph = capture_ref("examples/models/mlp.py:build", {"in_features": 64, "hidden": 256, "num_layers": 2,
                                                         "out_features": 16}, batch_size=4)
    ev = Evaluator(graph, cl)
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="fp32")
    mix_f, mix_b = curve_mix(cl)
    fc = next(n for n in graph.nodes if n.kind == "linear")
    cost = ev.node_cost(fc, "replicate", cfg)
    flops = fc.fwd_flops / 2                                   # micro-batch 2 of the captured 4
    assert cost.fwd == pytest.approx(curve_time(tuple((s, t / 0.5) for s, t in LINEAR), flops) * mix_f)
    assert cost.bwd == pytest.approx(curve_time(tuple((s, 2 * t / 0.5) for s, t in LINEAR), flops) * mix_b)
    # only fp32 was calibrated; an explicit Efficiency turns the curves off
    assert ev._curve_times(fc, 0.5, "bf16", fc.param_count) is None
    plain = Evaluator(graph, cl, efficiency=calibrated_efficiency(cl))
    assert plain.node_cost(fc, "replicate", cfg).fwd != pytest.approx(cost.fwd)


def test_time_op_curves_measures_every_family_on_this_machine():
    rows = time_op_curves(quick=True)
    fams = {r[0] for r in rows}
    assert fams == set(FAMILIES)
    for fam, size, f, b in rows:
        assert size > 0 and f >= 0 and b >= 0 and math.isfinite(f + b), (fam, size, f, b)
    big = max((r for r in rows if r[0] == "linear"), key=lambda r: r[1])
    small = min((r for r in rows if r[0] == "linear"), key=lambda r: r[1])
    assert big[2] > 10 * small[2]   # a 268 MFLOP GEMM costs far more than a 16 kFLOP one


def test_thin_linear_is_priced_by_its_weight_when_that_costs_more():
    from cost_models.op_curves import node_curve_times

    node = type("N", (), {"kind": "linear", "target": "torch.nn.Linear", "attrs": (), "fwd_flops": 2 * 2 * 256 * 256,
                          "output_meta": ()})()
    flops_curve = ((1e3, 1e-6), (1e9, 1e-3))
    thin = ((4096, 5e-6), (1 << 20, 5e-4))
    curves = {"linear": (flops_curve, flops_curve), "linear_thin": (thin, thin)}
    f_flops = curve_time(flops_curve, node.fwd_flops)
    f_thin = curve_time(thin, 256 * 256)
    assert f_thin > f_flops
    # two rows through a 256 x 256 weight: the weight sets the time
    assert node_curve_times(node, curves, (1.0, 2.0), 1.0, weights=256 * 256) == pytest.approx((f_thin, 2 * f_thin))
    # without the weight count (or without the thin curve) the FLOP curve prices it
    assert node_curve_times(node, curves, (1.0, 1.0), 1.0) == pytest.approx((f_flops, f_flops))
    assert node_curve_times(node, {"linear": curves["linear"]}, (1.0, 1.0), 1.0, weights=65536) == \
        pytest.approx((f_flops, f_flops))

"""The in-run factor (planner/app/calibrate_run.py): its arithmetic, its use by planner.evaluate, bad input."""

import dataclasses

import pytest

import planner
from planner.evaluator import Evaluator
from codegen.emit import capture_ref
from cost_models.calibration.calibrate import build_cluster
from cost_models.calibrated import in_run_factors
from cost_models.hardware import Cluster
from planner.app.calibrate_run import FACTOR_RANGE, InRunError, PROBE_FILE, in_run_factor, measure_in_run
from tests.unit.test_op_curves import _curve_results


def test_factor_scales_only_the_per_op_part():
    # 10 ms measured, 9 ms predicted of which 6 ms is the per-op sum (3 ms fixed): (10 - 3) / 6
    assert in_run_factor(10e-3, 9e-3, 6e-3) == pytest.approx(7 / 6)
    assert in_run_factor(9e-3, 9e-3, 6e-3) == pytest.approx(1.0)
    assert in_run_factor(8e-3, 9e-3, 6e-3) == pytest.approx(5 / 6)


def test_factor_outside_its_range_or_without_a_per_op_part_is_dropped():
    assert in_run_factor(30e-3, 9e-3, 6e-3) is None          # (30 - 3) / 6 = 4.5: a disturbed run
    assert in_run_factor(3.5e-3, 9e-3, 6e-3) is None         # 0.08: a broken trace
    assert in_run_factor(1e-3, 1e-3, 0.0) is None
    assert in_run_factor(0.0, 1e-3, 1e-3) is None
    lo, hi = FACTOR_RANGE
    assert in_run_factor(lo, 1.0, 1.0) == pytest.approx(lo) and in_run_factor(hi, 1.0, 1.0) == pytest.approx(hi)


def _with(cluster: Cluster, **fits) -> Cluster:
    merged = {**dict(cluster.measurements), **{f"fit.in_run.{k}": v for k, v in fits.items()}}
    return dataclasses.replace(cluster, measurements=tuple(sorted(merged.items())))


def test_evaluate_scales_every_node_price_by_the_factor_and_nothing_else():
    results, _, _ = _curve_results()
    base = build_cluster(results)
    assert in_run_factors(base) == (1.0, 1.0)
    scaled = _with(base, forward=1.25, backward=0.8)
    assert in_run_factors(scaled) == (1.25, 0.8)
    graph = capture_ref(f"{PROBE_FILE}:build", {}, batch_size=2)
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="fp32")
    a, b = Evaluator(graph, base), Evaluator(graph, scaled)
    nodes = [n for n in graph.nodes if n.kind not in ("input", "output")]
    assert len(nodes) > 30
    for n in nodes:
        plain, got = a.node_cost(n, "replicate", cfg), b.node_cost(n, "replicate", cfg)
        assert got.fwd == pytest.approx(1.25 * plain.fwd) and got.bwd == pytest.approx(0.8 * plain.bwd)
        assert got.saved == plain.saved and got.params == plain.params
    dp = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", data=2)
    sa = a.evaluate(dp, 8).stages[0]
    sb = b.evaluate(dp, 8).stages[0]
    assert sb.forward == pytest.approx(1.25 * sa.forward) and sb.backward == pytest.approx(0.8 * sa.backward)
    # an explicit Efficiency prices from it alone: no calibrated curve, no in-run factor
    from cost_models.calibrated import calibrated_efficiency
    assert Evaluator(graph, scaled, efficiency=calibrated_efficiency(scaled)).in_run == (1.0, 1.0)


def test_measure_in_run_refuses_what_it_cannot_measure():
    results, _, _ = _curve_results()
    two = build_cluster(results)
    with pytest.raises(InRunError, match="at least 2 ranks"):
        measure_in_run(dataclasses.replace(two, devices_per_node=1))
    with pytest.raises(InRunError, match="already carries fit.in_run"):
        measure_in_run(_with(two, forward=1.1))
    with pytest.raises(InRunError, match="at least 3"):
        measure_in_run(two, steps=2)
    with pytest.raises(InRunError, match="at least one launch"):
        measure_in_run(two, launches=0)


def test_probe_model_runs_and_its_batches_are_a_function_of_the_seed():
    import torch

    from planner.app import probe_model

    model = probe_model.build()
    (idx,), targets = probe_model.example_batch(3, seed=5)
    assert idx.shape == targets.shape == (3, probe_model.SEQ) and idx.dtype == torch.long
    assert model(idx).shape == (3, probe_model.SEQ, probe_model.VOCAB)
    assert torch.equal(probe_model.example_batch(3, seed=5)[0][0], idx)
    assert probe_model.example_inputs(2, "meta")[0].shape == (2, probe_model.SEQ)


def test_calibrate_machine_keeps_the_calibration_when_the_probe_fails_and_skips_it_when_asked(monkeypatch):
    import cost_models.calibration.calibrate
    import planner.app.calibrate_run as cr

    results, _, _ = _curve_results()
    base = build_cluster(results)
    monkeypatch.setattr(cost_models.calibration.calibrate, "calibrate", lambda *a, **k: base)
    calls = []

    def failing(cluster, backend, **kw):
        calls.append((backend, kw["launches"]))
        raise InRunError("the probe training run failed (exit 1)")
    monkeypatch.setattr(cr, "with_in_run", failing)
    lines = []
    got = cr.calibrate_machine(2, backend="mpi", progress=lines.append)
    assert got is base and calls == [("mpi", cr.LAUNCHES)]
    assert any(line.startswith("warning: the in-run probe gave nothing") and "exit 1" in line for line in lines)
    calls.clear()
    assert cr.calibrate_machine(2, quick=False, run_probe=False, progress=None) is base and calls == []
    monkeypatch.setattr(cr, "with_in_run", lambda c, b, **kw: _with(c, forward=1.1))
    assert in_run_factors(cr.calibrate_machine(2, quick=False, progress=None)) == (1.1, 1.0)


def test_calibrate_command_has_a_switch_for_the_probe():
    from planner.app.cli import build_parser

    p = build_parser()
    assert p.parse_args(["calibrate", "--out", "c.yaml"]).run_probe is True
    assert p.parse_args(["calibrate", "--out", "c.yaml", "--no-run-probe"]).run_probe is False

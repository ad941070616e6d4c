"""The runtime's fixed costs: measured through runtime.execute.stage.StageRunner, fitted, stored in the
Cluster file and charged by the simulator (stage call, loss on the last stage, ZERO_GRAD)."""

import pytest

from cost_models.calibration.calibrate import build_cluster
from cost_models.calibration.stage import fit_loss, time_stage_calls, time_zero_grad
from cost_models.calibrated import call_overheads, loss_costs, zero_grad_cost
from cost_models.hardware import Cluster
from cost_models.prediction import MemoryBreakdown, StagePrediction
from cost_models.simulate import ComputeCosts, simulate
from runtime.program import Instr, Program
from runtime.vocab import MeshAxis
from tests.unit.test_calibrate import _results


def _stage_results(scale=1.0):
    return {"call": [1e-5 * scale, 3e-5 * scale], "loss": [[32, 2e-5 * scale, 4e-5 * scale],
                                                          [65536, 6e-5 * scale, 1e-4 * scale]],
            "zero_grad": [3e-7 * scale, 1e-11 * scale]}


def _prediction(stages=2):
    mem = MemoryBreakdown(0, 0, 0, 0, 0, 0)
    return type("P", (), {"stages": tuple(StagePrediction(i, "a", "b", 1, 1e-3, 2e-3, mem) for i in range(stages)),
                          "time": type("T", (), {"optimizer": 5e-4})()})()


def test_loss_fit_is_a_line_through_the_two_sizes():
    (f0, f1), (b0, b1) = fit_loss([[65536, 6e-5, 1e-4], [32, 2e-5, 4e-5]])
    assert f0 + f1 * 32 == pytest.approx(2e-5) and f0 + f1 * 65536 == pytest.approx(6e-5)
    assert b0 + b1 * 65536 == pytest.approx(1e-4)
    # a larger size that measured faster (noise) gives no negative slope
    (f0, f1), _ = fit_loss([[32, 5e-5, 4e-5], [65536, 3e-5, 1e-4]])
    assert f1 == 0.0 and f0 == pytest.approx(5e-5)


def test_runtime_fixed_costs_round_trip_and_are_divided_by_the_cpu_share(tmp_path):
    results = _results()
    for r, scale in zip(results, (1.0, 3.0)):
        r["stage"] = _stage_results(scale)
    cl = build_cluster(results)
    cl.save(tmp_path / "c.yaml")
    back = Cluster.load(tmp_path / "c.yaml")
    # medians over the two ranks (scale 2), over the CPU share 0.5 -> x4; the StageRunner call
    # replaces the layer chain's (the "block" figures)
    assert call_overheads(back) == pytest.approx((4e-5, 12e-5))
    f, b = loss_costs(back, 65536)
    assert f == pytest.approx(4 * 6e-5) and b == pytest.approx(4 * 1e-4)
    assert loss_costs(back, 0) == (0.0, 0.0)
    assert zero_grad_cost(back, 10, 1e6) == pytest.approx(4 * (10 * 3e-7 + 1e6 * 1e-11))
    m = dict(back.measurements)
    assert m["raw.loss.cross_entropy.32.forward"] == pytest.approx(4e-5)
    # an older file without them prices none of it
    old = build_cluster(_results())
    assert loss_costs(old, 65536) == (0.0, 0.0) and zero_grad_cost(old, 10, 1e6) == 0.0


def test_simulator_charges_the_loss_to_the_last_stage_and_times_zero_grad():
    results = _results()
    for r in results:
        r["stage"] = _stage_results()
    cl = build_cluster(results)
    costs = ComputeCosts.from_prediction(_prediction(), cl, loss_elements=32, grad_tensors=4, grad_bytes=4096)
    call_f, call_b = call_overheads(cl)
    loss_f, loss_b = loss_costs(cl, 32)
    assert costs.forward[0] == pytest.approx(1e-3 + call_f)
    assert costs.forward[1] == pytest.approx(1e-3 + call_f + loss_f)
    assert costs.backward[1] == pytest.approx(2e-3 + call_b + loss_b)
    assert costs.zero_grad == pytest.approx(zero_grad_cost(cl, 4, 4096)) and costs.zero_grad > 0
    # uncalibrated: the prediction as it is
    plain = ComputeCosts.from_prediction(_prediction())
    assert plain.forward[1] == 1e-3 and plain.zero_grad == 0.0
    prog = Program(rank=0, world_size=1, mesh=((MeshAxis.PIPELINE, 1), ("data", 1), ("tensor", 1)), coords=(0, 0, 0),
                   stages=(0,), num_stages=1, num_micro_batches=1, micro_batch_size=1,
                   instrs=(Instr("ZERO_GRAD"), Instr("F", stage=0, micro=0), Instr("B", stage=0, micro=0), Instr("STEP")))
    one = ComputeCosts(forward={0: 1e-3}, backward={0: 2e-3}, optimizer=5e-4, zero_grad=2e-4)
    tl = simulate([prog], one, cl)
    zg = next(e for e in tl.events if e.op == "ZERO_GRAD")
    assert zg.duration == pytest.approx(2e-4)
    assert max(e.end for e in tl.events) == pytest.approx(2e-4 + 1e-3 + 2e-3 + 5e-4)


def test_stage_call_and_loss_figures_are_differences_of_the_timed_variants(monkeypatch):
    """The arithmetic, with the timings under the test's control: a call's fixed cost is the
    shallow stage less its layers (from the two depths' difference), the loss is the last stage
    less the middle one, and noise that makes a difference negative gives 0, never less."""
    import cost_models.calibration.stage as cs

    times = {(cs.LAYERS[0], None, False): (3e-5, 5e-5), (cs.LAYERS[1], None, False): (7e-5, 13e-5)}
    (r0, c0), (r1, c1) = cs.LOSS_SHAPES
    times[(1, c0, False)], times[(1, c0, True)] = (4e-5, 6e-5), (5e-5, 9e-5)
    times[(1, c1, False)], times[(1, c1, True)] = (8e-5, 9e-5), (7e-5, 12e-5)   # forward: noise
    monkeypatch.setattr(cs, "_stage_once", lambda layers, classes, rows, last: (layers, classes, last))
    monkeypatch.setattr(cs, "_median_calls", lambda key, reps: times[key])
    got = cs.time_stage_calls(quick=True)
    per_f, per_b = (7e-5 - 3e-5) / 4, (13e-5 - 5e-5) / 4
    assert got["call"] == pytest.approx([3e-5 - per_f, 5e-5 - per_b])
    assert got["loss"][0] == pytest.approx([r0 * c0, 1e-5, 3e-5])
    assert got["loss"][1] == pytest.approx([r1 * c1, 0.0, 3e-5])


def test_stage_calls_and_zero_grad_are_measured_through_the_runtime():
    """The real StageRunner runs and every figure is a finite non-negative time; which size costs
    more is left to the machine (on a loaded one a difference can come out as 0)."""
    import math

    got = time_stage_calls(quick=True)
    assert len(got["call"]) == 2 and all(0 <= t < 5e-3 for t in got["call"])
    (n0, f0, b0), (n1, f1, b1) = got["loss"]
    assert n0 < n1
    assert all(math.isfinite(t) and 0 <= t < 1.0 for t in (f0, b0, f1, b1))
    per_tensor, per_byte = time_zero_grad(reps=5)
    assert per_tensor > 0 and per_byte >= 0

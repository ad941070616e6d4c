"""`meshplan calibrate`, `run --track-memory`, `compare` and `simulate` end to end on real processes (gloo)."""

import dataclasses

import pytest

from cost_models.calibrated import (after_reduce_costs, calibrated_efficiency, executor_costs, fitted_collective,
                                    in_run_factors, tensor_embedding_costs, tensor_wrapper_costs, vocab_loss_costs)
from cost_models.hardware import Cluster
from planner.app.calibrate_run import FACTOR_RANGE, in_run_factor
from planner.app.cli import main


# a hang guard, not a timing bound: with both cores saturated by other processes calibration and the
# runs take 4-5x their quiet time (measured: past 300 s)
@pytest.mark.timeout(900)
def test_calibrate_then_compare_a_traced_run(tmp_path, capsys):
    cluster_file = tmp_path / "cluster.yaml"
    assert main(["calibrate", "--device", "cpu", "--out", str(cluster_file)]) == 0
    text = capsys.readouterr().out
    assert "all_reduce     group 2" in text and "linear" in text and f"wrote {cluster_file}" in text
    cluster = Cluster.load(cluster_file)
    assert cluster.num_devices == 2 and calibrated_efficiency(cluster) is not None
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p"):
        assert fitted_collective(cluster, op, 2) is not None
    assert any(k.startswith("raw.comm.all_reduce.g2.") for k, _ in cluster.measurements)
    # the executor's own time per instruction, from the reference pipeline run by the runtime (gloo)
    assert "runtime executor, between instructions" in text
    assert "tensor parallelism besides its all-reduces: wrapper" in text and "vocab loss" in text
    assert "right after a 2 MiB all-reduce through it" in text
    assert all(t >= 0 for t in after_reduce_costs(cluster))
    assert dict(cluster.measurements)["raw.after_reduce.zero_grad_own"] > 0
    gap, issue, extra = executor_costs(cluster)
    assert {"F", "B", "WAIT"} <= set(gap) and {"SEND", "RECV", "BROADCAST", "ALLREDUCE"} <= set(issue)
    assert all(0 < t < 0.05 for t in issue.values()) and set(extra) == {"F", "B"}
    assert tensor_wrapper_costs(cluster)[0] > 0
    assert vocab_loss_costs(cluster, 32768)[0] > 0 and tensor_embedding_costs(cluster, 16384)[0] > 0
    # the in-run probe: a small transformer trained through the runtime, three launches
    assert "in-run probe 5/5: training a 2-rank data-parallel transformer" in text
    m = dict(cluster.measurements)
    assert all(m[f"raw.in_run.forward.launch{i}"] > 0 for i in range(5))
    assert m["raw.in_run.forward.per_op"] < m["raw.in_run.forward.predicted"]  # fixed costs come on top
    _check_in_run_fit(cluster, text)

    build = tmp_path / "build"
    assert main(["codegen", "examples/models/mlp.py:build", "--batch", "8", "--data", "2", "--micro-batch", "2",
                 "--cluster", str(cluster_file), "-o", str(build)]) == 0
    assert main(["run", str(build), "--steps", "4", "--track-memory", "--probe-comm", "--timeout", "60"]) == 0
    capsys.readouterr()
    assert main(["compare", str(build), "--cluster", str(cluster_file)]) == 0
    text = capsys.readouterr().out
    assert "step time: predicted" in text and "measured" in text
    # the run's 1 MiB all-reduce beside the calibrated one
    assert "machine state: a 1 MiB all-reduce over all ranks took" in text and "at calibration (x" in text
    for row in ("F ", "B ", "ALLREDUCE", "STEP"):
        assert f"\n  {row}" in text
    # Peak memory measured on both ranks (parameters, gradients and activations: well over 8 KiB).
    mem_rows = [ln.split() for ln in text.splitlines() if ln.strip()[:1].isdigit() and "%" in ln]
    assert len(mem_rows) == 2 and all(float(r[1]) > 0.008 for r in mem_rows)
    assert (build / "compare_schedule.png").stat().st_size > 10_000 and (build / "compare_schedule.svg").is_file()

    assert main(["simulate", str(build), "--cluster", str(cluster_file)]) == 0
    assert "simulated step (steady state) on 'local-calibrated'" in capsys.readouterr().out
    assert (build / "predicted_timeline.json").is_file()


def _check_in_run_fit(cluster, text: str) -> None:
    """The in-run probe ends one of two documented ways, and which is up to the machine's load, not
    to the code: a fit within FACTOR_RANGE, or (a disturbed probe: another process took the cores)
    no fit, the per-op prices kept, and the output saying so. Each is checked in full."""
    m = dict(cluster.measurements)
    factors = in_run_factors(cluster)
    for i, name in enumerate(("forward", "backward")):
        # the factor is what the recorded measurements give, whichever way it went
        want = in_run_factor(m[f"raw.in_run.{name}.measured"], m[f"raw.in_run.{name}.predicted"],
                             m[f"raw.in_run.{name}.per_op"])
        if want is not None:
            assert m.get(f"fit.in_run.{name}") == want and FACTOR_RANGE[0] <= factors[i] <= FACTOR_RANGE[1]
            assert f"per-op prices x{want:.3f}" in text
        else:
            assert f"fit.in_run.{name}" not in m and factors[i] == 1.0
            assert f"per-op prices x1 (kept: the ratio is outside {FACTOR_RANGE})" in text


def test_in_run_fit_check_accepts_each_documented_outcome_and_only_those():
    """The check above, fed both outcomes (the measurements injected: no processes, no timing)."""
    from planner.app.calibrate_run import _fmt

    base = {"raw.in_run.forward.measured": 10e-3, "raw.in_run.forward.predicted": 9e-3,
            "raw.in_run.forward.per_op": 6e-3}
    fitted = {**base, **{k.replace("forward", "backward"): v for k, v in base.items()}}
    fitted["fit.in_run.forward"] = fitted["fit.in_run.backward"] = in_run_factor(10e-3, 9e-3, 6e-3)
    disturbed = {**fitted, "raw.in_run.backward.measured": 40e-3}
    del disturbed["fit.in_run.backward"]
    for m in (fitted, disturbed):
        cluster = Cluster.preset("local", devices=2)
        cluster = dataclasses.replace(cluster, measurements=m)
        text = "  forward instructions " + _fmt(m, "forward") + "; backward " + _fmt(m, "backward")
        _check_in_run_fit(cluster, text)
    # a fit that is absent although its measurements were fine is not accepted
    broken = dict(fitted)
    del broken["fit.in_run.forward"]
    with pytest.raises(AssertionError):
        _check_in_run_fit(dataclasses.replace(Cluster.preset("local", devices=2), measurements=broken),
                          "  forward instructions " + _fmt(broken, "forward"))


def test_compare_needs_a_traced_run(tmp_path, capsys):
    build = tmp_path / "build"
    assert main(["codegen", "examples/models/mlp.py:build", "--batch", "8", "--data", "2", "-o", str(build)]) == 0
    capsys.readouterr()
    assert main(["compare", str(build), "--cluster", "dgx-a100-80gb"]) == 2
    assert "no timeline.json: run it first" in capsys.readouterr().err

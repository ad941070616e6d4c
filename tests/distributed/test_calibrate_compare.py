"""`meshplan calibrate`, `run --track-memory`, `compare` and `simulate` end to end on real processes (gloo)."""

import pytest

from cost_models.calibrated import (after_reduce_costs, calibrated_efficiency, executor_costs, fitted_collective,
                                    in_run_factors, tensor_embedding_costs, tensor_wrapper_costs, vocab_loss_costs)
from cost_models.hardware import Cluster
from planner.cli import main


@pytest.mark.timeout(300)
def test_calibrate_then_compare_a_traced_run(tmp_path, capsys):
    cluster_file = tmp_path / "cluster.yaml"
    assert main(["calibrate", "--out", str(cluster_file)]) == 0
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
    assert 0.7 <= in_run_factors(cluster)[0] <= 1.6 and 0.7 <= in_run_factors(cluster)[1] <= 1.6
    assert "fit.in_run.forward" in m and "fit.in_run.backward" in m

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


def test_compare_needs_a_traced_run(tmp_path, capsys):
    build = tmp_path / "build"
    assert main(["codegen", "examples/models/mlp.py:build", "--batch", "8", "--data", "2", "-o", str(build)]) == 0
    capsys.readouterr()
    assert main(["compare", str(build), "--cluster", "dgx-a100-80gb"]) == 2
    assert "no timeline.json: run it first" in capsys.readouterr().err

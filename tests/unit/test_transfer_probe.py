"""The run's probe all-reduce (rank_main --probe-comm) and what `compare` makes of it: the same
transfer in the run and at calibration, and a warning when the machine moved data at another speed."""

import json

import pytest

from cost_models.calibration.calibrate import build_cluster
from cost_models.calibrated import measured_collective
from planner.app.compare import TRANSFER_DRIFT, Comparison, _transfer
from runtime.program.trace import PROBE_BYTES, probe_all_reduce
from tests.unit.test_calibrate import _results


class _CountingGroup:
    def __init__(self):
        self.calls = []

    def all_reduce(self, tensor, op="sum", async_op=False):
        self.calls.append(tensor.numel() * tensor.element_size())


class _Comm:
    def __init__(self):
        self.g = _CountingGroup()

    def group(self, ranks):
        assert list(ranks) == [0, 1]
        return self.g


def test_the_probe_times_back_to_back_all_reduces_over_all_ranks():
    comm = _Comm()
    got = probe_all_reduce(comm, 2, "cpu", rounds=5)
    assert got is not None and got >= 0.0
    assert comm.g.calls == [PROBE_BYTES] * 6  # a warm-up, then the rounds
    assert probe_all_reduce(comm, 1, "cpu") is None


def _comparison(transfer):
    return Comparison(build="b", cluster="c", measured_step=1.0, measured_steps=(1.0,), typical_step=1,
                      predicted_step=1.0, analytic_step=1.0, kinds=(), memory=(), transfer=transfer)


def test_compare_sets_the_run_beside_the_calibration_and_warns_on_drift():
    same = _comparison((1.2e-3, 1e-3))
    assert same.transfer_ratio == pytest.approx(1.2)
    assert "x1.20" in same.report() and "warning" not in same.report()
    slow = _comparison((TRANSFER_DRIFT * 1.1e-3, 1e-3))
    assert "warning: the machine moved data at a different speed" in slow.report()
    fast = _comparison((0.5e-3, 1e-3))
    assert "warning" in fast.report()
    assert _comparison(None).transfer_ratio is None and "machine state" not in _comparison(None).report()


def test_the_calibrated_side_is_the_measured_table_without_the_wake_up(tmp_path):
    cl = build_cluster(_results())
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank_0000.json").write_text(json.dumps({"rank": 0, "probe": {"all_reduce_bytes": PROBE_BYTES,
                                                                         "seconds": 2e-3}}))
    got = _transfer(tmp_path, cl, 2)
    assert got == pytest.approx((2e-3, measured_collective(cl, "all_reduce", 2, PROBE_BYTES, wake=False)))
    assert got[1] < measured_collective(cl, "all_reduce", 2, PROBE_BYTES)  # the wake-up is left out
    (run / "rank_0000.json").write_text(json.dumps({"rank": 0}))
    assert _transfer(tmp_path, cl, 2) is None  # a run without --probe-comm

"""Reading and zeroing gradients right after an all-reduce went through them: the calibrated
figures (the slowest rank's), and what the simulator charges a build that reduces gradients."""

import pytest

from cost_models.calibration.calibrate import build_cluster
from cost_models.calibrated import after_reduce_costs
from cost_models.hardware import Cluster
from cost_models.simulate import ComputeCosts
from planner.app.build_costs import reduces_grads
from tests.unit.test_calibrate import _results
from tests.unit.test_calibrate_stage import _prediction, _stage_results
from tests.unit.test_simulate import four_bucket_backward, two_stage_1f1b


def _with_after(per_rank):
    results = _results()
    for r, after in zip(results, per_rank):
        r["stage"] = _stage_results()
        r["after_reduce"] = after
    return results


def test_the_slowest_rank_sets_the_figures_and_they_round_trip(tmp_path):
    cl = build_cluster(_with_after([[2e-11, 4e-10, 1e-4, 9e-4, 6e-5, 4e-5], [3e-11, 1e-11, 1e-4, 6e-5, 6e-5, 4e-5]]))
    cl.save(tmp_path / "c.yaml")
    back = Cluster.load(tmp_path / "c.yaml")
    assert after_reduce_costs(back) == pytest.approx((3e-11, 4e-10))
    assert dict(back.measurements)["raw.after_reduce.zero_grad"] == pytest.approx(9e-4)
    assert after_reduce_costs(build_cluster(_results())) == (0.0, 0.0)  # calibrated before they were measured


def test_the_simulator_charges_them_to_step_and_zero_grad_of_reduced_gradients():
    cl = build_cluster(_with_after([[2e-11, 4e-10, 0, 0, 0, 0]] * 2))
    own = ComputeCosts.from_prediction(_prediction(), cl, grad_tensors=4, grad_bytes=1e6)
    reduced = ComputeCosts.from_prediction(_prediction(), cl, grad_tensors=4, grad_bytes=1e6, reduced_grad_bytes=1e6)
    assert reduced.optimizer - own.optimizer == pytest.approx(2e-11 * 1e6)
    assert reduced.zero_grad - own.zero_grad == pytest.approx(4e-10 * 1e6)
    assert reduced.forward == own.forward and reduced.backward == own.backward


def test_only_programs_that_reduce_gradients_with_other_ranks_count():
    assert reduces_grads({p.rank: p for p in four_bucket_backward(1024)})
    assert not reduces_grads({p.rank: p for p in two_stage_1f1b()})  # a pipeline: sends, no gradient reduce

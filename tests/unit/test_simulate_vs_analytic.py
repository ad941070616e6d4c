"""The simulator against the planner's analytic step time, on the Programs codegen lowers for real plans.

Every schedule (GPipe, 1F1B, interleaved), with data- and tensor-parallel
collectives and ZeRO. Without a pipeline the two agree within 5%; with one,
the analytic step is an upper bound and the simulator agrees within 5% with
the closed form of asynchronous p2p (see cost_models/simulate.py).
"""

import pytest

import planner
from planner.app.commands import make_fixed_plan
from codegen.lower import lower
from cost_models.simulate import ComputeCosts, flow_shop_step_time, simulate
from tests.parallel_cases import graph_of

CASES = {
    "d2": dict(data=2), "t2": dict(tensor=2), "d2_zero1": dict(data=2, zero=1), "d2_zero2": dict(data=2, zero=2),
    "d2_zero3": dict(data=2, zero=3), "d2t2": dict(data=2, tensor=2),
    "p2_gpipe": dict(pipeline=2, schedule="gpipe"), "p2_1f1b": dict(pipeline=2, schedule="1f1b"),
    "p4_1f1b": dict(pipeline=4, schedule="1f1b"),
    "p2_interleaved": dict(pipeline=2, schedule="interleaved", virtual_stages=2),
    "d2p2": dict(data=2, pipeline=2), "d2t2p2": dict(data=2, tensor=2, pipeline=2),
}


def _simulated(model, case, preset="dgx-a100-80gb", dtype="fp32"):
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype=dtype, **CASES[case])
    cluster = planner.Cluster.preset(preset, devices=cfg.num_devices)
    plan = make_fixed_plan(graph_of(model), cluster, cfg, 16)
    timeline = simulate(lower(plan, graph_of(model)), ComputeCosts.from_prediction(plan.prediction, cluster),
                        cluster)
    return cfg, plan.prediction, timeline.step_times()[0]


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("case", list(CASES))
def test_simulated_step_matches_the_analytic_one(model, case):
    cfg, pred, sim = _simulated(model, case)
    if cfg.pipeline == 1:
        assert sim == pytest.approx(pred.step_time, rel=0.05)
        return
    # The analytic (m + p - 1) x slowest slot, p2p synchronous, is an upper bound ...
    assert sim <= pred.step_time * (1 + 1e-9)
    # ... and the closed form of what the Programs do (async p2p, flow-shop fill) matches.
    p, v, m = cfg.pipeline, cfg.virtual_stages, pred.num_micro_batches
    slots = [sum(s.forward + s.backward for s in pred.stages if s.index % p == i) for i in range(p)]
    hop = pred.time.pipeline_comm / (2 * m * v)
    rest = pred.time.data_comm + pred.time.zero_comm + pred.time.optimizer
    closed = flow_shop_step_time(slots, m, virtual_stages=v, hop=hop, rest=rest)
    assert sim == pytest.approx(closed, rel=0.05)


@pytest.mark.parametrize("case", ["d2", "t2", "d2_zero3", "p2_1f1b", "d2t2p2"])
def test_on_an_h100_in_bf16_the_host_s_dispatch_is_simulated_as_the_analytic_step_prices_it(case):
    # the same Programs on the fitted H100 preset under autocast: a small model, so the host's dispatch of
    # its kernels sets the pace of some instructions (StagePrediction.forward / backward hold the longer)
    cfg, pred, sim = _simulated("gpt", case, "dgx-h100", "bf16")
    assert any(s.host_forward > 0 for s in pred.stages)
    if cfg.pipeline == 1:
        assert sim == pytest.approx(pred.step_time, rel=0.05)
    else:
        assert sim <= pred.step_time * (1 + 1e-9)


def test_flow_shop_reduces_to_the_uniform_formula():
    # Balanced stages, free p2p: (m + p - 1) slots (GPipe/1F1B), interleaved (m v + p - 1) chunks.
    assert flow_shop_step_time([3.0] * 4, 8) == pytest.approx((8 + 4 - 1) * 3.0)
    assert flow_shop_step_time([3.0] * 4, 8, virtual_stages=3) == pytest.approx((8 * 3 + 4 - 1) * 1.0)
    with pytest.raises(ValueError, match="micro_batches"):
        flow_shop_step_time([1.0], 0)

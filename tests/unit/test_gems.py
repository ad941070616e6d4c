"""GEMS bi-directional pipelines: schedule simulation, closed form, config rules, cost model."""

import pytest
import torch

import planner
from cost_models.gems import device_order, simulate, uniform_step_time
from cost_models.hardware import Cluster
from examples.models import gpt
from planner import ConfigError, ParallelConfig


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (0.5, 1.7)])
def test_simulation_matches_the_closed_form(p, T, f, b):
    step, busy = simulate([f] * p, [b] * p, T)
    assert step == pytest.approx(uniform_step_time(p, T, f, b))
    assert all(x == pytest.approx(2 * T * (f + b)) for x in busy)


def test_closed_form_by_hand():
    # p=2, one pair (eta=2), f=1, b=2: 2*2*3 - 1*1*1 = 11
    assert uniform_step_time(2, 1, 1.0, 2.0) == 11.0


def test_device_order_holds_stage_r_and_p_minus_1_minus_r():
    order = device_order(4, 1)
    assert [str(t) for t in order[0]] == ["FA s0 m0", "BA s0 m0", "FB s3 m1", "BB s3 m1"]
    assert {t.stage for t in order[1]} == {1, 2}


def test_p2p_and_uneven_stages_only_add_time():
    base, _ = simulate([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 1)
    assert simulate([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 1, p2p=0.1)[0] > base
    assert simulate([1.0, 2.0, 1.0], [2.0, 2.0, 2.0], 1)[0] > base


@pytest.mark.parametrize("kwargs,needle", [
    (dict(pipeline=1, bidirectional=True), "pipeline >= 2"),
    (dict(pipeline=2, data=2, bidirectional=True, zero=1), "ZeRO stage 0 only"),
    (dict(pipeline=2, bidirectional=True, schedule="gpipe"), "own \\(GEMS\\) schedule"),
    (dict(replicas_per_direction=2), "needs bidirectional=True"),
])
def test_config_rules(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        ParallelConfig(**kwargs)


def test_batch_must_be_2T_micro_batches():
    cfg = ParallelConfig(data=2, pipeline=2, micro_batch_size=4, bidirectional=True, replicas_per_direction=2)
    assert cfg.micro_batches(32) == 4
    with pytest.raises(ConfigError, match="set micro_batch_size to 8"):
        cfg.micro_batches(64)


@pytest.fixture(scope="module")
def small():
    with torch.device("meta"):
        model = gpt.build(preset="small")
    return planner.capture(model, gpt.example_inputs(batch_size=1, device="meta", preset="small"))


def test_cost_model_two_stages_per_device_and_less_bubble(small):
    """Against one replica pushing the same batch through the same pipeline (GEMS's baseline)."""
    cl = Cluster.preset("dgx-a100-80gb", devices=4)
    bidi = planner.evaluate(small, cl, ParallelConfig(pipeline=4, micro_batch_size=4, bidirectional=True),
                            global_batch_size=8)
    one = planner.evaluate(small, cl, ParallelConfig(pipeline=4, micro_batch_size=8), global_batch_size=8)
    assert bidi.step_time == pytest.approx(bidi.time.total)
    assert bidi.bubble_fraction < one.bubble_fraction  # the reverse replica fills the bubble
    assert bidi.memory.parameters > one.stages[1].memory.parameters  # two stages' weights per device
    assert bidi.time.data_comm > 0  # devices r and p-1-r all-reduce their copies
    # 1F1B with more micro-batches has a smaller bubble but keeps p - i of them live on stage i.
    many = planner.evaluate(small, cl, ParallelConfig(pipeline=4, micro_batch_size=1), global_batch_size=8)
    assert many.bubble_fraction < bidi.bubble_fraction


def test_search_considers_bidirectional_plans(small):
    cl = Cluster.preset("dgx-a100-80gb", devices=4)
    plan = planner.optimize(small, cl, global_batch_size=16, progress=False, runtime=None,
                            constraints={"bidirectional": True, "pipeline": 4})
    assert plan.config.bidirectional and plan.config.pipeline == 4
    with pytest.raises(planner.NoFeasiblePlan, match="cannot run .*bidirectional"):
        planner.optimize(small, cl, global_batch_size=16, progress=False,
                         constraints={"bidirectional": True, "pipeline": 4})
    assert "bidi" in plan.summary() or "bidirectional" in plan.summary() or plan.config.short() in plan.summary()

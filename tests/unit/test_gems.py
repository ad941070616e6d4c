"""GEMS bi-directional pipelines: schedule simulation, closed form, config rules, cost model."""

import pytest
import torch

import planner
from planner.evaluator import Evaluator
from planner.strategies.bidirectional.costs import device_order, uniform_step_time
from planner.strategies.bidirectional.costs import step_time as simulate
from cost_models.hardware import Cluster
from examples.models import gpt
from codegen.lower import lower
from runtime.program.schedules import bidirectional, bidirectional_position
from cost_models.simulate import ComputeCosts
from cost_models.simulate import simulate as simulate_programs
from planner import ConfigError, ParallelConfig
from planner.capabilities import RuntimeSupport
from runtime.program import PAIR_AXIS
from runtime.vocab import MeshAxis
from tests.fixed_machine import local_cluster


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
    plan = planner.optimize(small, cl, global_batch_size=16, progress=False,
                            constraints={"bidirectional": True, "pipeline": 4})
    assert plan.config.bidirectional and plan.config.pipeline == 4
    assert "bidirectional (GEMS" in plan.summary() and "0/3" in plan.summary()
    # a runtime without it: the search says so instead of returning a plan it cannot run
    with pytest.raises(planner.NoFeasiblePlan, match="cannot run .*bidirectional"):
        planner.optimize(small, cl, global_batch_size=16, progress=False,
                         runtime=RuntimeSupport(not_run=("bidirectional",)),
                         constraints={"bidirectional": True, "pipeline": 4})


# ---- lowering: the schedule as Programs ---------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("T", [1, 2, 3])
def test_lowered_schedule_is_the_cost_models_device_order(p, T):
    sched = bidirectional(p, T)
    for dev, tasks in enumerate(device_order(p, T)):
        assert [(a.op, a.stage, a.micro) for a in sched[dev]] == [(t.pass_, t.stage, t.micro) for t in tasks]
        for a in sched[dev]:
            assert bidirectional_position(a.stage, a.micro, p) == dev


@pytest.fixture(scope="module")
def tiny():
    return planner.capture(gpt.build(preset="tiny"), gpt.example_inputs(batch_size=2, preset="tiny"))


def _bidi_plan(graph, p, d, T, mb=2, cluster="dgx-a100-80gb"):
    cl = local_cluster(p * d) if cluster == "local" else Cluster.preset(cluster, devices=p * d)
    cfg = ParallelConfig(pipeline=p, data=d, micro_batch_size=mb, bidirectional=True, replicas_per_direction=T,
                         dtype="fp32")
    return planner.make_plan(graph, cl, cfg, global_batch_size=mb * d * 2 * T)


@pytest.mark.parametrize("p,d,T", [(2, 1, 1), (2, 2, 2), (3, 1, 2), (3, 2, 1), (4, 1, 2), (4, 2, 1)])
def test_lowered_programs_hold_two_stages_and_reduce_over_the_pair(tiny, p, d, T):
    progs = lower(_bidi_plan(tiny, p, d, T), tiny)   # lower() runs check_programs: no deadlock
    for r, prog in progs.items():
        pos = prog.coord(MeshAxis.PIPELINE)
        assert prog.stages == tuple(sorted({pos, p - 1 - pos}))
        assert prog.num_micro_batches == 2 * T
        # forwards of replica A (even micro-batches) on stage pos, of B (odd) on stage p-1-pos
        for ins in prog.instrs:
            if ins.op == "F":
                assert ins.stage == (pos if ins.micro % 2 == 0 else p - 1 - pos)
        grads = [ins for ins in prog.instrs if ins.kind == "grads"]
        group = prog.group(PAIR_AXIS)
        assert len(group) == d * (1 if 2 * pos == p - 1 else 2)
        if len(group) == 1:
            assert not grads   # the middle position of an odd pipeline sums both replicas locally
        else:
            assert grads and all(g.axis == PAIR_AXIS for g in grads)
            assert [g.stage for g in grads] == sorted((g.stage for g in grads), reverse=True), "higher stage first"
            assert {g.stage for g in grads} == set(prog.stages)
        assert any(ins.kind == "loss" and ins.axis == MeshAxis.PIPELINE and ins.op == "ALLREDUCE"
                   for ins in prog.instrs)
        assert prog.derived_axes == ((PAIR_AXIS,) if grads else ())


@pytest.mark.parametrize("p,d,T", [(2, 1, 1), (2, 2, 2), (3, 1, 2), (4, 1, 2), (4, 2, 4)])
@pytest.mark.parametrize("cluster", ["dgx-a100-80gb", "local"])
def test_cost_model_step_time_matches_simulating_the_lowered_programs(tiny, p, d, T, cluster):
    """The analytic GEMS step (gems.step_time of the per-device order, pair all-reduce after the
    step) against the discrete-event simulation of the Programs the runtime executes. They
    differ by the pair all-reduce of the higher stage, which the Programs overlap with the
    last backward, and by per-message p2p times (the cost model uses the largest cut's)."""
    plan = _bidi_plan(tiny, p, d, T, cluster=cluster)
    cl = plan.cluster
    tl = simulate_programs(lower(plan, tiny), ComputeCosts.from_prediction(plan.prediction), cl)
    assert tl.step_times()[0] == pytest.approx(plan.prediction.step_time, rel=0.05)


def test_optimized_bidirectional_plan_lowers(tiny):
    cl = local_cluster(4)
    plan = planner.optimize(tiny, cl, global_batch_size=8, progress=False,
                            constraints={"bidirectional": True, "pipeline": 4, "dtype": "fp32"})
    assert plan.config.bidirectional
    progs = lower(plan, tiny)
    assert sorted(progs) == [0, 1, 2, 3] and progs[0].stages == (0, 3)


def test_codegen_command_takes_bidirectional_flags(tmp_path, capsys):
    from planner.app.cli import main

    out = tmp_path / "build"
    rc = main(["codegen", "examples/models/gpt.py:build", "--arg", "preset=tiny", "--batch", "16", "--pipeline", "2",
               "--micro-batch", "4", "--bidirectional", "--replicas-per-direction", "2", "-o", str(out)])
    assert rc == 0
    plan = planner.Plan.load(out / "plan.json")
    assert plan.config.bidirectional and plan.config.replicas_per_direction == 2
    assert "@pair" in (out / "rank_0000.py").read_text()


# ---- stage boundaries under the pair memory constraint ---------------------------------------


def _brute_force(weights, p, sizes, cap):
    import itertools

    from planner.strategies.bidirectional.strategy import pairs_fit

    n, best = len(weights), None
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = [0, *cuts, n]
        bounds = [(edges[k], edges[k + 1]) for k in range(p)]
        if pairs_fit(bounds, sizes, cap):
            slow = max(sum(weights[lo:hi]) for lo, hi in bounds)
            best = slow if best is None else min(best, slow)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_pair_aware_bounds_match_brute_force(seed):
    import random
    from types import SimpleNamespace

    from planner.stage_split import balanced_partition
    from planner.strategies.bidirectional.strategy import _Sizes, bidirectional_bounds, pairs_fit

    rng = random.Random(seed)
    n, p = rng.randint(4, 9), rng.choice([2, 3, 4])
    p = min(p, n)
    costs = [SimpleNamespace(params=rng.choice([1, 1, 2, 8]), saved=rng.choice([0, 1, 3]), working=0.0,
                             temporary=0.0) for _ in range(n)]
    weights = [float(rng.randint(1, 5)) for _ in range(n)]
    cfg = ParallelConfig(pipeline=p, bidirectional=True, dtype="fp32")
    sizes = _Sizes(cfg, costs, weights)
    cap = rng.uniform(0.3, 1.0) * sizes.device((0, n), None)
    want = _brute_force(weights, p, sizes, cap)
    got = bidirectional_bounds(cfg, costs, weights, cap, balanced_partition)
    assert [lo for lo, _ in got] == sorted(lo for lo, _ in got) and got[0][0] == 0 and got[-1][1] == n
    assert all(hi == lo2 for (_, hi), (lo2, _) in zip(got, got[1:])) and all(lo < hi for lo, hi in got)
    if want is None:       # nothing fits: the time-balanced split
        assert got == balanced_partition(weights, p, None)
    else:
        assert pairs_fit(got, sizes, cap)
        assert max(sum(weights[lo:hi]) for lo, hi in got) == pytest.approx(want, rel=1e-6)


def test_evaluator_moves_stage_boundaries_until_each_pair_fits():
    import dataclasses

    from examples.models import mlp
    from planner.stage_split import balanced_partition

    with torch.device("meta"):
        model = mlp.build(in_features=64, hidden=256, num_layers=8)
    graph = planner.capture(model, mlp.example_inputs(batch_size=1, device="meta", in_features=64))
    base = Cluster.preset("dgx-a100-80gb", devices=4)
    cfg = ParallelConfig(pipeline=4, micro_batch_size=4, bidirectional=True)

    def run(mib):
        cl = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=int(mib * 2**20)))
        ev = Evaluator(graph, cl)
        costs = [ev.layer_cost(layer, cfg) for layer in graph.layers]
        weights = [c.forward + c.backward + c.recompute + c.comm_forward + c.comm_backward for c in costs]
        return ev.evaluate(cfg, 8), ev.stage_bounds(cfg, costs, 8), balanced_partition(weights, 4, None)

    roomy, bounds, plain = run(80 * 1024)
    assert bounds == plain and roomy.fits            # every pair fits: the time-balanced split
    tight, bounds, plain = run(roomy.peak_memory / 2**20 - 0.5)
    assert bounds != plain and tight.fits             # moved so that each device's two stages fit
    assert tight.peak_memory < roomy.peak_memory and tight.step_time >= roomy.step_time

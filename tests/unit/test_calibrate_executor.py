"""The executor's own time per instruction and the tensor-parallel wrappers: the reference
pipeline, reading a trace, the Cluster file round trip, and what the simulator and the
planner charge for them (the rest of tensor parallelism's extras: test_calibrate_tensor_parallel)."""

import pytest

from codegen.lower import check_programs
from cost_models.calibration.calibrate import build_cluster
from cost_models.calibration.executor import reference_programs, trace_costs
from cost_models.calibrated import call_overheads, executor_costs, tensor_wrapper_costs
from cost_models.hardware import Cluster
from cost_models.simulate import ComputeCosts, simulate
from runtime.program.schedules import one_f_one_b as one_f_one_b_schedule
from runtime.program.trace import Event, Timeline
from tests.unit.test_calibrate import _results
from tests.unit.test_calibrate_stage import _prediction
from tests.unit.test_simulate import CL, two_stage_1f1b


def one_f_one_b(stage, stages, micro):
    """[(op, micro-batch), ...] of `stage` in the 1F1B schedule the reference pipeline runs."""
    return [(a.op, a.micro) for a in one_f_one_b_schedule(stages, micro)[stage]]


@pytest.mark.parametrize("stages,micro", [(2, 4), (3, 4), (4, 2)])
def test_one_f_one_b_runs_every_micro_batch_once_each_way(stages, micro):
    for s in range(stages):
        order = one_f_one_b(s, stages, micro)
        assert sorted(order) == sorted([("B", m) for m in range(micro)] + [("F", m) for m in range(micro)])
        assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(micro))
        # the warm-up: as many forwards as stages after this one (at most all of them)
        warm = next(i for i, (op, _) in enumerate(order) if op == "B")
        assert warm == min(stages - s, micro)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_reference_programs_are_valid_and_finish_in_the_simulator(world):
    progs = reference_programs(world)
    check_programs({p.rank: p for p in progs})  # no deadlock, every send received
    tl = simulate(progs, ComputeCosts(forward={s: 1.0 for s in range(world)},
                                      backward={s: 2.0 for s in range(world)}), CL)
    ops = {e.op for e in tl.events}
    assert {"F", "B", "STEP", "ZERO_GRAD", "BROADCAST", "ALLREDUCE"} <= ops
    assert ({"SEND", "RECV"} <= ops) == (world > 1)


def _event(rank, step, index, op, start, end, track="compute"):
    return Event(rank, step, index, f"{op} {index}", op, start, end, track)


def test_trace_costs_reads_gaps_and_issue_times_from_a_timeline():
    prog = two_stage_1f1b()[0]  # F, SEND, F, SEND, RECV, WAIT, B, RECV, WAIT, B, WAIT, WAIT, STEP
    events = []
    for step in range(3):
        t = 10.0 * step
        for i, ins in enumerate(prog.instrs):
            if ins.is_async:  # issued in 0.5 s, completes much later (its end is not a gap)
                events.append(_event(0, step, i, ins.op, t, t + 7.0, "comm"))
                t += 0.5
            else:  # 0.25 s long, then 0.1 s (0.2 s after a WAIT) before the next one
                events.append(_event(0, step, i, ins.op, t, t + 0.25))
                t += 0.25 + (0.2 if ins.op == "WAIT" else 0.1)
    # step 0 is warm-up: make it wildly different, it must not count
    events = [e if e.step else Event(e.rank, 0, e.index, e.name, e.op, e.start * 9, e.end * 9, e.track)
              for e in events]
    got = trace_costs(Timeline(tuple(events)), prog, skip_steps=1)
    assert got["gap"]["F"] == pytest.approx(0.1) and got["gap"]["B"] == pytest.approx(0.1)
    assert got["gap"]["WAIT"] == pytest.approx(0.2)
    assert got["issue"]["SEND"] == pytest.approx(0.5) and got["issue"]["RECV"] == pytest.approx(0.5)
    assert "STEP" not in got["gap"]  # the last instruction of a step has no next one


def _executor_results(scale):
    return {"gap": {"F": 2e-6 * scale, "WAIT": 1e-6 * scale}, "issue": {"SEND": 10e-6 * scale, "RECV": 8e-6 * scale},
            "extra": {"F": 5e-6 * scale, "B": 7e-6 * scale}}


def test_executor_figures_round_trip_and_are_divided_by_the_cpu_share(tmp_path):
    results = _results()
    for r, scale in zip(results, (1.0, 3.0)):
        r["executor"] = _executor_results(scale)
        r["stage"] = {"call": [1e-5, 3e-5], "loss": [[32, 2e-5, 4e-5], [65536, 6e-5, 1e-4]],
                      "zero_grad": [3e-7, 1e-11], "tensor_wrapper": [2e-5 * scale, 1e-5 * scale]}
    cl = build_cluster(results)
    cl.save(tmp_path / "c.yaml")
    back = Cluster.load(tmp_path / "c.yaml")
    gap, issue, extra = executor_costs(back)
    # medians over the two ranks (x2), over the CPU share 0.5 -> x4 the scale-1 figure
    assert gap == pytest.approx({"F": 8e-6, "WAIT": 4e-6})
    assert issue == pytest.approx({"SEND": 40e-6, "RECV": 32e-6})
    assert extra == pytest.approx({"F": 20e-6, "B": 28e-6})
    assert tensor_wrapper_costs(back) == pytest.approx((8e-5, 4e-5))
    # the extra of a forward / backward instruction is charged with the stage call
    costs = ComputeCosts.from_prediction(_prediction(), back)
    call_f, call_b = call_overheads(back)
    assert costs.forward[0] == pytest.approx(1e-3 + call_f + 20e-6)
    assert costs.backward[0] == pytest.approx(2e-3 + call_b + 28e-6)
    assert costs.gap == gap and costs.issue == issue
    # an older file without them charges none of it
    old = build_cluster(_results())
    assert executor_costs(old) == ({}, {}, {}) and tensor_wrapper_costs(old) == (0.0, 0.0)


def test_simulator_advances_a_rank_by_the_gaps_and_issue_times():
    progs = two_stage_1f1b()
    base = dict(forward={0: 1.0, 1: 1.0}, backward={0: 2.0, 1: 2.0})
    plain = simulate(progs, ComputeCosts(**base), CL)
    slow = simulate(progs, ComputeCosts(**base, gap={"F": 0.1, "B": 0.1, "WAIT": 0.05},
                                        issue={"SEND": 0.2, "RECV": 0.3}), CL)
    p0 = [e for e in plain.events if e.rank == 0]
    s0 = [e for e in slow.events if e.rank == 0]
    # rank 0 starts F s0 m0 at 0, then F m1 after a 0.1 gap and a 0.2 SEND issue
    assert [e.start for e in s0 if e.op == "F"] == pytest.approx([0.0, 1.3])
    assert [e.start for e in p0 if e.op == "F"] == pytest.approx([0.0, 1.0])
    # the second SEND is issued 0.1 s after the second forward ends
    sends = [e for e in s0 if e.op == "SEND"]
    assert sends[1].start == pytest.approx(2.4)
    assert slow.step_times()[0] > plain.step_times()[0] + 1.0
    # a collective without its own issue time takes ALLREDUCE's
    assert ComputeCosts(**base, issue={"ALLREDUCE": 0.4}).issue_time("REDUCESCATTER") == 0.4
    assert ComputeCosts(**base, issue={"ALLREDUCE": 0.4}).issue_time("SEND") == 0.0


def test_planner_charges_a_wrapper_per_in_layer_all_reduce_of_a_tensor_parallel_layer():
    import dataclasses

    import planner
    from planner.evaluator import Evaluator
    from codegen.emit import capture_ref

    graph = capture_ref("examples/models/mlp.py:build", {"in_features": 64, "hidden": 256, "num_layers": 4,
                                                         "out_features": 16}, batch_size=4)
    base = build_cluster(_results())
    wrapped = dataclasses.replace(base, measurements=tuple(sorted(
        dict(base.measurements, **{"fit.tensor_wrapper.forward": 2e-5, "fit.tensor_wrapper.backward": 1e-5,
                                   "fit.tensor_wrapper.forward_per_element": 1e-9}).items())))
    cfg = planner.ParallelConfig(micro_batch_size=2, dtype="fp32", tensor=2)
    # every shardable layer sharded (the ILP may replicate layers this small)
    ev, ev_w = Evaluator(graph, base, sharding="all"), Evaluator(graph, wrapped, sharding="all")
    roles = ev.sharding.roles
    linears = [n for n in graph.nodes if n.kind == "linear" and n.name in roles]
    with_ar = [n for n in linears if roles[n.name].fwd_allreduce or roles[n.name].bwd_allreduce]
    assert with_ar  # a tensor-parallel MLP has column / row pairs
    for n in linears:
        role = roles[n.name].role
        a, b = ev.node_cost(n, role, cfg), ev_w.node_cost(n, role, cfg)
        wraps = n in with_ar
        # per micro-batch of 2 (the graph was captured at 4): the values it all-reduces
        elements = max(roles[n.name].fwd_allreduce, roles[n.name].bwd_allreduce) / 2 / 4
        assert b.on("tensor").forward - a.on("tensor").forward == pytest.approx(2e-5 + 1e-9 * elements if wraps else 0.0)
        assert b.on("tensor").backward - a.on("tensor").backward == pytest.approx(1e-5 if wraps else 0.0)
        assert (b.fwd, b.bwd) == (a.fwd, a.bwd)
    # the whole step: four micro-batches of two, each paying every wrapper both ways
    grown = ev_w.evaluate(cfg, 8).time.tensor_comm - ev.evaluate(cfg, 8).time.tensor_comm
    per_micro = sum(3e-5 + 1e-9 * max(roles[n.name].fwd_allreduce, roles[n.name].bwd_allreduce) / 8 for n in with_ar)
    assert grown == pytest.approx(4 * per_micro)

"""runtime.program.schedules and codegen.lower: schedules as data, lowering passes, and the Programs they make."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.lower import LoweringError, check_programs, lower
from codegen.strategies.pipeline import p2p_pass
from cost_models.memory import live_micro_batches
from runtime.program.schedules import (ScheduleError, build_schedule, format_schedule, forwards_in_flight, interleaved,
                               one_f_one_b)
from runtime.program import Instr, Program
from runtime.vocab import MeshAxis
from tests.parallel_cases import graph_of, plan_for


def _valid(sched, p, m, v):
    for i, acts in sched.items():
        stages = [c * p + i for c in range(v)]
        done_f = set()
        for a in acts:
            assert a.stage in stages
            if a.op == "F":
                done_f.add((a.stage, a.micro))
            else:
                assert (a.stage, a.micro) in done_f, f"B before F at position {i}: {a}"
        assert sorted((a.stage, a.micro) for a in acts if a.op == "F") == [(s, k) for s in stages for k in range(m)]
        assert sorted((a.stage, a.micro) for a in acts if a.op == "B") == [(s, k) for s in stages for k in range(m)]


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 9), name=st.sampled_from(["gpipe", "1f1b"]))
def test_gpipe_and_1f1b_run_every_micro_batch_once(p, m, name):
    _valid(build_schedule(name, p, m), p, m, 1)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 4), groups=st.integers(1, 3), v=st.integers(2, 3))
def test_interleaved_runs_every_chunk_and_micro_batch_once(p, groups, v):
    _valid(interleaved(p, p * groups, v), p, p * groups, v)


def test_1f1b_warm_up_and_printing():
    s = one_f_one_b(3, 4)
    assert [a.op for a in s[0][:3]] == ["F", "F", "F"] and [a.op for a in s[2][:2]] == ["F", "B"]
    assert format_schedule(one_f_one_b(2, 2)).splitlines() == ["p0: F0.0 F0.1 B0.0 B0.1", "p1: F1.0 B1.0 F1.1 B1.1"]


def _peak_in_flight(actions):
    """The most forwards whose backward has not run yet, walking the action list."""
    live = peak = 0
    for a in actions:
        live += 1 if a.op == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p,m", [(1, 4), (2, 4), (3, 6), (4, 8), (4, 2)])
def test_forwards_in_flight_is_the_peak_of_the_action_lists(name, v, p, m):
    if name == "interleaved" and m % p:
        return
    sched = build_schedule(name, p, m, v)
    for i in range(p):
        assert forwards_in_flight(name, i, p, m, v) == _peak_in_flight(sched[i])
        if name != "interleaved":  # the cost model's live micro-batches are that peak
            assert live_micro_batches(name, i, p, m) == _peak_in_flight(sched[i])


def test_interleaved_needs_a_multiple_of_the_pipeline_size():
    with pytest.raises(ScheduleError, match="multiple of pipeline 2"):
        interleaved(2, 3, 2)


def test_p2p_pass_posts_receives_one_compute_ahead_and_waits_sends_at_the_end():
    import re

    acts = [Instr("F", 1, 0), Instr("F", 1, 1), Instr("B", 1, 0), Instr("B", 1, 1)]
    out = p2p_pass(acts, iter(range(100)), lambda s, m: s, 3, act_bytes={0: 64, 1: 32}, grad_bytes={0: 64, 1: 32})
    text = [re.sub(r" h\d+", "", str(i)) for i in out]
    assert text[:5] == ["RECV act s0 m0 <- r0 (64 B)", "RECV act s0 m1 <- r0 (64 B)", "WAIT", "F s1 m0",
                        "SEND act s1 m0 -> r2 (32 B)"]
    assert text.index("RECV grad s1 m0 <- r2 (32 B)") < text.index("F s1 m1") < text.index("B s1 m0")
    assert text[text.index("B s1 m0") + 1] == "SEND grad s0 m0 -> r0 (64 B)"
    assert text[-4:] == ["WAIT"] * 4 and all(h.op == "WAIT" for h in out[-4:])
    sends = {i.handle for i in out if i.op == "SEND"}
    assert {i.handle for i in out[-4:]} == sends


def test_check_programs_finds_a_deadlock():
    mesh = ((MeshAxis.PIPELINE, 2), ("data", 1), ("tensor", 1))
    progs = {r: Program(rank=r, world_size=2, mesh=mesh, coords=(r, 0, 0), stages=(r,), num_stages=2,
                        num_micro_batches=1, micro_batch_size=1,
                        instrs=(Instr("RECV", 0, 0, peer=1 - r, kind="act", handle=0), Instr("WAIT", handle=0),
                                Instr("SEND", 0, 0, peer=1 - r, kind="act", handle=1)))
             for r in (0, 1)}
    with pytest.raises(LoweringError, match="deadlock"):
        check_programs(progs)


CONFIGS = [
    dict(data=2), dict(tensor=2), dict(pipeline=2, schedule="gpipe"), dict(pipeline=2, schedule="interleaved",
                                                                           virtual_stages=2),
    dict(data=2, tensor=2, pipeline=2), dict(data=2, zero=1), dict(data=2, pipeline=2, zero=3),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_lowered_programs_are_consistent_and_round_trip(cfg):
    graph = graph_of("gpt")
    progs = lower(plan_for("gpt", **cfg), graph, bucket_bytes=4096)
    check_programs(progs)
    for p in progs.values():
        assert Program.from_json(p.to_json()) == p
        assert p.instrs[0].op == "ZERO_GRAD" and "STEP" in [i.op for i in p.instrs]
        sends = [i for i in p.instrs if i.op == "SEND" and i.kind == "act"]
        assert all(i.nbytes == 2 * 16 * 32 * 4 for i in sends)  # (micro-batch 2, T 16, C 32) fp32
        if cfg.get("data", 1) > 1:
            op = "REDUCESCATTER" if cfg.get("zero", 0) else "ALLREDUCE"
            coll = [i for i in p.instrs if i.op == op and i.kind == "grads"]
            assert coll and sum(i.nbytes for i in coll) >= sum(b.numel * 4 for b in p.buckets)
            assert len(coll) == len(p.buckets) > 1


def test_lowering_refuses_what_the_runtime_cannot_run():
    import dataclasses

    graph = graph_of("gpt")
    plan = plan_for("gpt", pipeline=2, schedule="interleaved", virtual_stages=2)
    with pytest.raises(LoweringError, match="multiple of pipeline 2"):
        lower(dataclasses.replace(plan, global_batch_size=6), graph)
    plan = plan_for("gpt", data=2)   # fp16 lowers: the runtime scales the loss (runtime/execute/loss_scale.py)
    assert lower(dataclasses.replace(plan, config=plan.config.replace(dtype="fp16")), graph)

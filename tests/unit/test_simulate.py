"""The Program simulator on hand-built Programs with known answers."""

import dataclasses

import pytest

from cost_models.comm import collective_time
from cost_models.hardware import Cluster
from cost_models.simulate import ComputeCosts, SimulationDeadlock, simulate
from runtime.program import Instr, Program
from runtime.vocab import MeshAxis

CL = Cluster.preset("dgx-a100-80gb")


def prog(rank, world, mesh, instrs, stages=(0,), num_stages=1, m=1):
    coords, rest = [], rank
    for _, size in reversed(mesh):
        coords.append(rest % size)
        rest //= size
    return Program(rank=rank, world_size=world, mesh=tuple(mesh), coords=tuple(reversed(coords)), stages=stages,
                   num_stages=num_stages, num_micro_batches=m, micro_batch_size=1, instrs=tuple(instrs))


def I(op, **kw):
    return Instr(op, **kw)


def two_stage_1f1b():
    mesh = [(MeshAxis.PIPELINE, 2), ("data", 1), ("tensor", 1)]
    r0 = [I("F", stage=0, micro=0), I("SEND", kind="act", stage=0, micro=0, peer=1, handle=0),
          I("F", stage=0, micro=1), I("SEND", kind="act", stage=0, micro=1, peer=1, handle=1),
          I("RECV", kind="grad", stage=0, micro=0, peer=1, handle=2), I("WAIT", handle=2), I("B", stage=0, micro=0),
          I("RECV", kind="grad", stage=0, micro=1, peer=1, handle=3), I("WAIT", handle=3), I("B", stage=0, micro=1),
          I("WAIT", handle=0), I("WAIT", handle=1), I("STEP")]
    r1 = [I("RECV", kind="act", stage=0, micro=0, peer=0, handle=0), I("RECV", kind="act", stage=0, micro=1, peer=0, handle=1),
          I("WAIT", handle=0), I("F", stage=1, micro=0), I("B", stage=1, micro=0),
          I("SEND", kind="grad", stage=0, micro=0, peer=0, handle=2),
          I("WAIT", handle=1), I("F", stage=1, micro=1), I("B", stage=1, micro=1),
          I("SEND", kind="grad", stage=0, micro=1, peer=0, handle=3), I("WAIT", handle=2), I("WAIT", handle=3), I("STEP")]
    return [prog(0, 2, mesh, r0, (0,), 2, 2), prog(1, 2, mesh, r1, (1,), 2, 2)]


def test_two_stage_1f1b_takes_m_plus_p_minus_1_slots():
    costs = ComputeCosts(forward={0: 1.0, 1: 1.0}, backward={0: 2.0, 1: 2.0})
    tl = simulate(two_stage_1f1b(), costs, CL)
    assert tl.step_times()[0] == pytest.approx((2 + 2 - 1) * 3.0)
    b = [e for e in tl.events if e.rank == 0 and e.op == "B"]
    assert [(e.start, e.end) for e in b] == [(4.0, 6.0), (7.0, 9.0)]
    assert tl.source == "predicted"


def test_ring_allreduce_after_backward():
    mesh = [(MeshAxis.PIPELINE, 1), ("data", 4), ("tensor", 1)]
    n = 10**9
    progs = [prog(r, 4, mesh, [I("F", stage=0, micro=0), I("B", stage=0, micro=0),
                                I("ALLREDUCE", kind="grads", stage=0, bucket=0, axis="data", handle=0, nbytes=n),
                                I("WAIT", handle=0), I("STEP")]) for r in range(4)]
    costs = ComputeCosts(forward={0: 0.01}, backward={0: 0.02})
    tl = simulate(progs, costs, CL)
    ar = collective_time(CL, "all_reduce", n, [0, 1, 2, 3]).seconds
    assert tl.step_times()[0] == pytest.approx(0.03 + ar)
    comm = [e for e in tl.events if e.op == "ALLREDUCE"]
    assert len(comm) == 4 and all(e.track == "comm" for e in comm)


def four_bucket_backward(n):
    """Two data-parallel ranks: one backward, then four gradient all-reduces of n bytes issued from it."""
    mesh = [(MeshAxis.PIPELINE, 1), ("data", 2), ("tensor", 1)]
    instrs = [I("B", stage=0, micro=0)] + \
        [I("ALLREDUCE", kind="grads", stage=0, bucket=k, axis="data", handle=k, nbytes=n) for k in range(4)] + \
        [I("WAIT", handle=k) for k in range(4)]
    return [prog(r, 2, mesh, instrs) for r in range(2)]


def test_bucketed_allreduce_overlaps_the_backward():
    n = 10**8
    progs = four_bucket_backward(n)
    one = collective_time(CL, "all_reduce", n, [0, 1]).seconds
    tl = simulate(progs, ComputeCosts(forward={0: 0.0}, backward={0: 4 * one}), CL)
    # bucket k is ready at (k+1)/4 of the backward: three of four hide behind it
    assert tl.step_times()[0] == pytest.approx(5 * one)
    assert tl.overlap_fraction() == pytest.approx(0.75)


def test_deadlock_is_reported_not_hung():
    mesh = [(MeshAxis.PIPELINE, 2), ("data", 1), ("tensor", 1)]
    r0 = [I("RECV", kind="grad", stage=0, micro=0, peer=1, handle=0), I("WAIT", handle=0)]
    r1 = [I("RECV", kind="act", stage=0, micro=0, peer=0, handle=0), I("WAIT", handle=0)]
    with pytest.raises(SimulationDeadlock, match=r"rank 0: #1 WAIT h0[\s\S]*rank 1: #1 WAIT h0"):
        simulate([prog(0, 2, mesh, r0), prog(1, 2, mesh, r1)], ComputeCosts({}, {}), CL)


def test_bad_input():
    progs = two_stage_1f1b()
    with pytest.raises(ValueError, match="all 2 ranks"):
        simulate(progs[:1], ComputeCosts({0: 1.0}, {0: 1.0}), CL)
    with pytest.raises(ValueError, match="no forward cost for stage 1"):
        simulate(progs, ComputeCosts({0: 1.0}, {0: 1.0}), CL)


def test_calibrated_overlap_charges_the_unhidden_part_to_the_backward():
    # Same Programs as above on a cluster whose calibration found a quarter of an overlapped
    # all-reduce hidden: the three overlapped buckets lengthen the backward by 3 * 0.75 * one.
    n = 10**8
    progs = four_bucket_backward(n)
    cl = dataclasses.replace(CL, measurements=(("fit.comm.overlap_hidden", 0.25),))
    one = collective_time(cl, "all_reduce", n, [0, 1]).seconds
    tl = simulate(progs, ComputeCosts(forward={0: 0.0}, backward={0: 4 * one}), cl)
    assert tl.step_times()[0] == pytest.approx((4 + 3 * 0.75) * one)
    b = [e for e in tl.events if e.op == "B"]
    assert all(e.end - e.start == pytest.approx((4 + 3 * 0.75) * one) for e in b)


def test_an_overlap_slower_than_serial_charges_more_than_the_collective():
    # Calibrated hidden below 0 (MPI here: overlapping costs more than the two one after the
    # other): each overlapped bucket lengthens the backward by 1.3 x its time; the fit is
    # clamped at -1 (twice).
    n = 10**8
    progs = four_bucket_backward(n)
    for fit, factor in ((-0.3, 1.3), (-5.0, 2.0)):
        cl = dataclasses.replace(CL, measurements=(("fit.comm.overlap_hidden", fit),))
        one = collective_time(cl, "all_reduce", n, [0, 1]).seconds
        tl = simulate(progs, ComputeCosts(forward={0: 0.0}, backward={0: 4 * one}), cl)
        assert tl.step_times()[0] == pytest.approx((4 + 3 * factor) * one)


def test_steps_run_back_to_back_and_the_steady_step_includes_the_start_skew():
    from cost_models.simulate import simulate_steady

    # rank 1 (the last stage) ends its step with a loss broadcast that rank 0 waits for, so in
    # the next step rank 0 starts late and rank 1 waits for its first activation
    progs = two_stage_1f1b()
    mesh = [(MeshAxis.PIPELINE, 2), ("data", 1), ("tensor", 1)]
    tail0 = [I("BROADCAST", kind="loss", axis=MeshAxis.PIPELINE, peer=1, handle=9, nbytes=8), I("WAIT", handle=9)]
    progs = [prog(0, 2, mesh, list(progs[0].instrs) + tail0, (0,), 2, 2),
             prog(1, 2, mesh, list(progs[1].instrs) + tail0, (1,), 2, 2)]
    costs = ComputeCosts(forward={0: 1.0, 1: 1.0}, backward={0: 2.0, 1: 2.0}, optimizer=0.5)
    one = simulate(progs, costs, CL)
    three = simulate(progs, costs, CL, steps=3)
    assert sorted(three.step_times()) == [0, 1, 2]
    assert three.step_times()[0] == pytest.approx(one.step_times()[0])
    steady = simulate_steady(progs, costs, CL)
    assert {e.step for e in steady.events} == {0} and min(e.start for e in steady.events) == 0.0
    # every instruction of every rank once
    assert len(steady.events) == len(one.events)
    # the later step is no shorter than the first, where both ranks started together
    assert steady.step_times()[0] >= one.step_times()[0] - 1e-9
    with pytest.raises(ValueError, match="steps >= 1"):
        simulate(progs, costs, CL, steps=0)

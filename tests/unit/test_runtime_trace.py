"""runtime.program.trace: Timeline JSON, Chrome trace export, and the overlap measure."""

import json

from runtime.program.trace import Event, Recorder, Timeline


def _tl():
    ev = [Event(0, 0, 0, "F s0 m0", "F", 0.0, 1.0), Event(0, 0, 1, "B s0 m0", "B", 1.0, 3.0),
          Event(0, 0, 2, "ALLREDUCE grads s0 b0 @data h0", "ALLREDUCE", 2.0, 4.0, "comm"),
          Event(0, 0, 3, "WAIT h0", "WAIT", 3.0, 4.0),
          Event(1, 0, 0, "F s0 m0", "F", 0.0, 1.5)]
    return Timeline(tuple(ev))


def test_timeline_json_round_trip(tmp_path):
    tl = _tl()
    tl.save(tmp_path / "t.json")
    assert Timeline.load(tmp_path / "t.json") == tl
    assert Timeline.merge([tl.for_rank(1), tl.for_rank(0)]).events == tuple(sorted(tl.events, key=lambda e: (e.start, e.rank)))


def test_chrome_trace_has_one_process_per_rank_and_comm_track(tmp_path):
    tl = _tl()
    tl.save_chrome(tmp_path / "trace.json")
    d = json.loads((tmp_path / "trace.json").read_text())
    xs = [e for e in d["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 5 and {e["pid"] for e in xs} == {0, 1}
    ar = next(e for e in xs if e["cat"] == "ALLREDUCE")
    assert ar["tid"] == 1 and ar["ts"] == 2e6 and ar["dur"] == 2e6


def test_overlap_fraction_counts_collective_time_under_backward():
    assert _tl().overlap_fraction() == 0.5      # [2, 4] overlaps B [1, 3] for 1 of 2 s
    assert Timeline(()).overlap_fraction() is None
    assert _tl().step_times() == {0: 4.0}


def test_recorder_collects_events():
    rec = Recorder(3)
    t0 = rec.now()
    rec.add(0, 1, "STEP", "STEP", t0, rec.now())
    tl = rec.timeline()
    assert tl.ranks == (3,) and tl.events[0].duration >= 0


def test_clock_id_is_stable_and_fits_in_int64():
    from runtime.program.trace import clock_id

    a, b = clock_id(), clock_id()
    assert a == b and 0 <= a < 2 ** 63


def test_shared_origin_takes_rank_zeros_reading_on_the_same_clock_only():
    from runtime.program.trace import shared_origin

    def from_root(clock, now_ns):
        return lambda values: [clock, now_ns]

    # rank 0 read 5 s on clock 7; this rank reads 9 s
    assert shared_origin(from_root(7, 5_000_000_000), clock=7, now=9_000_000_000) == 5.0
    assert shared_origin(from_root(7, 5_000_000_000), clock=8, now=9_000_000_000) == 9.0
    sent = []
    shared_origin(lambda v: sent.append(list(v)) or v, clock=3, now=42)
    assert sent == [[3, 42]]


def _overlap_pairwise(tl: Timeline) -> float | None:
    """The overlap measure by its definition: every collective against every backward interval."""
    from runtime.program.trace import _union

    total = hidden = 0.0
    for rank in tl.ranks:
        evs = [e for e in tl.events if e.rank == rank]
        busy = _union([(e.start, e.end) for e in evs if e.op == "B"])
        for e in evs:
            if e.op == "ALLREDUCE" and "grads" in e.name and e.track == "comm":
                total += e.duration
                hidden += sum(max(0.0, min(e.end, hi) - max(e.start, lo)) for lo, hi in busy)
    return hidden / total if total > 0 else None


def test_overlap_fraction_equals_its_definition_on_random_timelines():
    import random

    rng = random.Random(7)
    for trial in range(50):
        ev = []
        for rank in range(2):
            for i in range(rng.randint(0, 30)):
                a, d = rng.uniform(0, 20), rng.choice([0.0, rng.uniform(0, 3)])
                op, track, name = rng.choice([("B", "compute", "B s0 m0"), ("F", "compute", "F s0 m0"),
                                              ("ALLREDUCE", "comm", "ALLREDUCE grads s0 b0 @data h0")])
                ev.append(Event(rank, 0, i, name, op, a, a + d, track))
        tl = Timeline(tuple(ev))
        want, got = _overlap_pairwise(tl), tl.overlap_fraction()
        assert (want is None) == (got is None), trial
        if want is not None:
            assert abs(got - want) < 1e-9, trial


def test_overlap_fraction_and_json_are_not_quadratic_in_the_steps():
    """20,000 events (10,000 steps of a data-parallel rank): the pairwise measure took about a minute."""
    import time

    ev = []
    for step in range(10_000):
        t = step * 1.0
        ev += [Event(0, step, 0, "B s0 m0", "B", t, t + 0.5),
               Event(0, step, 1, "ALLREDUCE grads s0 b0 @data h0", "ALLREDUCE", t + 0.25, t + 0.75, "comm")]
    tl = Timeline(tuple(ev))
    t0 = time.process_time()
    assert abs(tl.overlap_fraction() - 0.5) < 1e-9
    # a generous CPU-time bound (no wall clock: a loaded machine must not fail it); the quadratic
    # version needs 10,000 x 10,000 interval pairs, far more than this allows
    assert time.process_time() - t0 < 10.0

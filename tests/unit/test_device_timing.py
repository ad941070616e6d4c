"""Instruction timing on the device (runtime/execute/device_clock.py through the Recorder) driven on CPU by a
fake device clock, the Timeline's host tracks and clock field, and `meshplan compare`'s table from a
timeline with device and host tracks."""

import json

import pytest
import torch

from planner.app.compare import HOST_BOUND_LEAD, measured_comparison
from runtime.program.trace import HOST_TRACKS, Event, Mark, Recorder, Timeline
from runtime.vocab import Clock, Track


class FakeEvent:
    def __init__(self, at: float):
        self.at = at          # device seconds from the origin event


class FakeClock:
    """A device clock whose device runs `lag` seconds behind the host; events count as done once
    `horizon` (device seconds) has passed them. Placement shifts by `offset`."""

    def __init__(self, host_now, lag: float = 0.0, offset: float = 0.0):
        self.host_now, self.lag, self.offset = host_now, lag, offset
        self.horizon = 0.0
        self.released = []
        self.waited = 0
        self.recorded = 0

    def record(self):
        self.recorded += 1
        return FakeEvent(self.host_now() + self.lag)

    def done(self, e):
        return e.at <= self.horizon

    def wait(self, e):
        self.waited += 1
        self.horizon = max(self.horizon, e.at)

    def elapsed(self, e):
        return e.at

    def release(self, e):
        self.released.append(e)

    def placement(self):
        return lambda s: s + self.offset


class Host:
    """A host clock the test moves by hand."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _recorder(lag=0.0, offset=0.0):
    host = Host()
    rec = Recorder(0, origin=0.0)
    rec.now = host            # the recorder's host clock (an instance attribute shadows the method)
    rec.device = FakeClock(host, lag, offset)
    return rec, host


def test_recorder_without_a_device_clock_records_host_intervals_as_before():
    rec = Recorder(2)
    a = rec.mark()
    b = rec.mark()
    assert a.event is None and b.event is None
    rec.add_interval(0, 1, "F s0 m0", "F", a, b)
    rec.add_interval(0, 2, "ALLREDUCE x", "ALLREDUCE", a, b, track=Track.COMM)
    rec.add(0, 3, "STEP", "STEP", 1.0, 2.0)
    tl = rec.timeline()
    assert tl.clock == Clock.HOST and not tl.has_host_track
    assert [e.track for e in tl.events] == ["compute", "comm", "compute"]
    assert tl.events[0].start == a.host and tl.events[0].end == b.host
    rec.enabled = False
    rec.add_interval(1, 1, "F s0 m0", "F", rec.mark(), rec.mark())
    assert len(rec.timeline().events) == 3


def test_device_intervals_are_read_when_done_and_sit_beside_the_host_ones():
    rec, host = _recorder(lag=0.5, offset=10.0)
    start = rec.mark()
    host.t = 1.0
    end = rec.mark()
    rec.add_interval(0, 4, "B s0 m0", "B", start, end)
    issue = rec.mark()
    host.t = 1.25
    rec.add_interval(0, 5, "ALLREDUCE grads", "ALLREDUCE", issue, rec.mark(), track=Track.COMM)
    assert [e.track for e in rec.events] == [Track.HOST, Track.HOST_COMM]
    rec.collect()                      # the device has passed nothing yet: nothing read, nothing waited for
    assert rec.device.waited == 0 and len(rec._open) == 2
    rec.device.horizon = 1.5           # the device is past the backward's end (1.0 + 0.5), not the all-reduce's
    rec.collect()
    assert len(rec._open) == 1 and len(rec.device.released) == 2
    tl = rec.timeline()                # waits for the rest
    assert rec.device.waited == 1 and not rec._open and tl.clock == Clock.CUDA
    b = next(e for e in tl.events if e.track == Track.COMPUTE)
    assert (b.start, b.end) == (10.5, 11.5)     # device time (host + lag), placed with the offset
    ar = next(e for e in tl.events if e.track == Track.COMM)
    assert (ar.start, ar.end) == (11.5, 11.75)
    hb = next(e for e in tl.events if e.track == Track.HOST)
    assert (hb.start, hb.end) == (0.0, 1.0)


def test_a_mark_takes_no_device_event_when_not_recording_or_not_asked():
    rec, _ = _recorder()
    assert rec.mark(device=False).event is None
    rec.enabled = False
    assert rec.mark().event is None
    rec.add_interval(0, 0, "F", "F", Mark(0.0, FakeEvent(0.0)), Mark(1.0, FakeEvent(1.0)))
    assert rec.device.recorded == 0 and not rec.events and not rec._open


class _Ticks:
    """A host clock that moves 1 us at every read. Recorder.mark reads the host clock just after the device
    event is recorded; with the real clock a loaded machine can put 0.1 ms or more between the two reads
    (CI once measured 0.13 ms), which is not what the test checks."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-6
        return self.t


class _SoloComm:
    """A communicator of one rank (every group a SoloGroup): the executor in this process."""

    world_size, rank, device = 1, 0, torch.device("cpu")

    def group(self, ranks):
        from runtime.comm import SoloGroup
        return SoloGroup(0)

    def barrier(self):
        pass


def test_the_executor_times_every_instruction_on_the_device_clock_and_the_host():
    """The real executor on the reference pipeline of one rank (cost_models/calibration/executor.py):
    with a device clock every blocking instruction gets a device interval and a host one, every
    asynchronous one a comm interval and a host_comm one, for every traced step."""
    from cost_models.calibration.executor import REF_ROWS, REF_MICRO_BATCHES, _batch, _runner, reference_programs
    from runtime.comm.context import DistContext
    from runtime.data import DataSource
    from runtime.executor import Executor

    program = reference_programs(1)[0]
    comm = _SoloComm()
    ctx = DistContext.create(comm, program.mesh)
    data = DataSource(_batch, {}, REF_ROWS * REF_MICRO_BATCHES, REF_ROWS, name="reference batches")
    rec = Recorder(0, origin=0.0)
    rec.now = _Ticks()                  # a mark's event and its host time differ by the lag alone, however loaded
    rec.device = FakeClock(rec.now, lag=1e-3)
    ex = Executor(program, ctx, {0: _runner(0, 1)}, None, None, data, rec)
    for step in range(2):
        ex.run_step(step)
        rec.collect()
    rec.enabled = False
    ex.run_step(2)                      # an untraced step records nothing, on neither clock
    tl = rec.timeline()
    assert tl.clock == Clock.CUDA and {e.step for e in tl.events} == {0, 1}
    for step in (0, 1):
        for i, ins in enumerate(program.instrs):
            tracks = sorted(e.track for e in tl.events if e.step == step and e.index == i)
            want = [Track.COMM, Track.HOST_COMM] if ins.is_async else [Track.COMPUTE, Track.HOST]
            assert tracks == sorted(want), (step, str(ins))
    for e in tl.events:
        if e.track in (Track.COMPUTE, Track.COMM):
            host = next(h for h in tl.events if h.track in HOST_TRACKS and (h.step, h.index) == (e.step, e.index))
            assert e.start == pytest.approx(host.start + 1e-3, abs=1e-4)   # the fake device's lag


def test_timeline_with_host_tracks_round_trips_and_old_files_load(tmp_path):
    ev = (Event(0, 1, 0, "F s0 m0", "F", 0.5, 1.5), Event(0, 1, 0, "F s0 m0", "F", 0.0, 0.25, Track.HOST),
          Event(0, 1, 1, "B s0 m0", "B", 1.5, 4.0), Event(0, 1, 1, "B s0 m0", "B", 0.25, 0.5, Track.HOST))
    tl = Timeline(ev, clock=Clock.CUDA)
    tl.save(tmp_path / "t.json")
    back = Timeline.load(tmp_path / "t.json")
    assert back == tl and back.clock == Clock.CUDA
    assert back.step_times() == {1: 3.5} and back.step_times(HOST_TRACKS) == {1: 0.5}
    assert Timeline.merge([back.for_rank(0)]).clock == Clock.CUDA
    # a file written before the clock field and the host tracks: host times, as it was
    old = {"format_version": 1, "source": "measured",
           "events": [{"rank": 0, "step": 0, "index": 0, "name": "F s0 m0", "op": "F", "start": 0.0, "end": 1.0,
                       "track": "compute"}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = Timeline.load(tmp_path / "old.json")
    assert loaded.clock == Clock.HOST and loaded.step_times() == {0: 1.0}
    with pytest.raises(ValueError, match="clock 'sundial'"):
        Timeline.from_dict({**old, "clock": "sundial"})


def test_chrome_trace_shows_the_host_tracks_of_a_gpu_run():
    ev = (Event(0, 0, 0, "B s0 m0", "B", 1.0, 2.0), Event(0, 0, 0, "B s0 m0", "B", 0.0, 0.5, Track.HOST))
    d = Timeline(ev, clock=Clock.CUDA).to_chrome()
    names = {e["tid"]: e["args"]["name"] for e in d["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "compute (device)", 1: "comm (device)", 2: "host", 3: "host_comm"}
    assert sorted(e["tid"] for e in d["traceEvents"] if e["ph"] == "X") == [0, 2]
    assert d["otherData"]["clock"] == "cuda"


def test_overlap_counts_only_the_device_backward_under_a_collective():
    ev = (Event(0, 0, 0, "B s0 m0", "B", 0.0, 1.0), Event(0, 0, 0, "B s0 m0", "B", 0.0, 4.0, Track.HOST),
          Event(0, 0, 1, "ALLREDUCE grads s0 b0 @data h0", "ALLREDUCE", 0.0, 2.0, Track.COMM))
    assert Timeline(ev, clock=Clock.CUDA).overlap_fraction() == 0.5


def _gpu_step(step: int, t0: float, lag: float) -> list[Event]:
    """One step on a GPU: the host queues F (1 ms, syncing on the loss), B (2 ms) and STEP (syncing on the
    norm); the device runs F for 1 ms, B for 10 ms, STEP for 1 ms; `lag`: how far B ends after the host
    queued it, beyond its queueing."""
    host = [(0, "F", 0.0, 1.0), (1, "B", 1.0, 3.0), (2, "STEP", 3.0, 3.0 + lag + 1.0)]
    device = [(0, "F", 0.0, 1.0), (1, "B", 1.0, 3.0 + lag), (2, "STEP", 3.0 + lag, 4.0 + lag)]
    ms = 1e-3
    return ([Event(0, step, i, op, op, t0 + a * ms, t0 + b * ms, Track.HOST) for i, op, a, b in host]
            + [Event(0, step, i, op, op, t0 + a * ms, t0 + b * ms) for i, op, a, b in device])


def test_compare_reads_the_device_clock_and_shows_the_host_beside_it():
    measured = Timeline(tuple(_gpu_step(1, 0.0, 8.0) + _gpu_step(2, 1.0, 8.0)), clock=Clock.CUDA)
    predicted = Timeline((Event(0, 0, 0, "F", "F", 0.0, 1e-3), Event(0, 0, 1, "B", "B", 1e-3, 11e-3),
                          Event(0, 0, 2, "STEP", "STEP", 11e-3, 12e-3)))
    kept = measured.step_times()
    cmp = measured_comparison(measured, kept, predicted, build="b", cluster="c", analytic_step=0.012, memory=())
    assert cmp.measured_step == pytest.approx(12e-3) and cmp.host_step == pytest.approx(12e-3)
    kinds = {k.op: k for k in cmp.kinds}
    assert kinds["B"].measured == pytest.approx(10e-3) and kinds["B"].host == pytest.approx(2e-3)
    assert kinds["B"].error == pytest.approx(0.0)
    assert cmp.host_lead == pytest.approx(8e-3) and cmp.host_bound is False
    text = cmp.report()
    assert "clock: CUDA events on the device" in text and "host ms" in text and "device-bound" in text
    # the same run with the device keeping up with the host: host-bound
    tight = Timeline(tuple(_gpu_step(1, 0.0, 0.0) + _gpu_step(2, 1.0, 0.0)), clock=Clock.CUDA)
    cmp = measured_comparison(tight, tight.step_times(), predicted, build="b", cluster="c", analytic_step=0.0,
                              memory=())
    assert cmp.host_lead == pytest.approx(0.0) and cmp.host_lead <= HOST_BOUND_LEAD * cmp.measured_step
    assert cmp.host_bound and "host-bound" in cmp.report()


def test_compare_of_a_cpu_run_is_unchanged():
    ev = tuple(Event(0, s, i, op, op, s + a, s + b) for s in (1, 2) for i, (op, a, b) in
               enumerate((("F", 0.0, 0.25), ("B", 0.25, 0.75))))
    measured = Timeline(ev)
    predicted = Timeline((Event(0, 0, 0, "F", "F", 0.0, 0.25), Event(0, 0, 1, "B", "B", 0.25, 1.0)))
    cmp = measured_comparison(measured, measured.step_times(), predicted, build="b", cluster="c",
                              analytic_step=1.0, memory=())
    assert cmp.clock == Clock.HOST and cmp.host_step is None and cmp.host_bound is None
    assert all(k.host is None for k in cmp.kinds)
    text = cmp.report()
    assert "clock: host perf_counter" in text and "host ms" not in text and "host timeline" not in text
    assert {k.op: round(k.error, 6) for k in cmp.kinds} == {"F": 0.0, "B": 0.5}


class _FakeCuda:
    """torch.cuda's events, synchronize and device guard over a fake GPU timer that runs `rate` times
    as fast as the host's clock (drift), `offset` seconds apart from it; events run when recorded."""

    def __init__(self, host, rate: float, offset: float):
        self.host, self.rate, self.offset = host, rate, offset
        outer = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self, stream=None):
                self.at = outer.offset + outer.host() * outer.rate

            def query(self):
                return self.at is not None

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return (other.at - self.at) * 1e3
        self.Event = Event


def test_cuda_clock_places_device_events_on_the_host_clock_and_corrects_drift(monkeypatch):
    import contextlib

    from runtime.execute import device_clock

    host = Host()
    fake = _FakeCuda(host, rate=1 + 1e-4, offset=123.0)     # 100 ppm fast, an arbitrary zero
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    host.t = 5.0
    clock = device_clock.CudaClock(torch.device("cuda"), host)
    host.t = 105.0
    e = clock.record()
    assert clock.done(e) and clock.elapsed(e) == pytest.approx(100.0 * (1 + 1e-4))
    host.t = 200.0
    place = clock.placement()                     # the second anchor at host time 200
    assert place(clock.elapsed(e)) == pytest.approx(105.0, abs=1e-9)   # 10 ms of drift corrected
    clock.release(e)
    assert clock.record() is e                    # events are reused
    # over a short run the drift is not corrected: the anchors' uncertainty would dominate it
    host.t = 0.0
    short = device_clock.CudaClock(torch.device("cuda"), host)
    host.t = 0.5
    e = short.record()
    host.t = device_clock.MIN_DRIFT_SPAN * 0.75
    assert short.placement()(short.elapsed(e)) == pytest.approx(0.5 * (1 + 1e-4))

"""`Timeline`: start and end of every instruction, per rank.

The runtime records a measured Timeline while it executes Programs; the
simulator writes a predicted one from the same Programs. Both save as JSON
and export Chrome / Perfetto trace JSON (open in ui.perfetto.dev or
chrome://tracing).

Times are seconds from the start of the run (ranks align their clocks at a
barrier). An asynchronous instruction (SEND, RECV, a collective) is one
event from its issue to its completion, on the rank's "comm" track; the
WAIT that blocks on it is a separate event on the "compute" track.

The Timeline's `clock` says what timed the compute and comm events: the host's
perf_counter around each instruction (Clock.HOST, a CPU run), or CUDA events on
the device (Clock.CUDA, a GPU run: runtime/execute/device_clock.py). A GPU run keeps the
host's intervals too, on the "host" and "host_comm" tracks: a step's device
span and its host span side by side (step_times(HOST_TRACKS)).
"""

from __future__ import annotations

import json
import statistics
from bisect import bisect_left, bisect_right
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from itertools import accumulate
from typing import Iterable, NamedTuple

from runtime.vocab import Clock, Track
from runtime.documents import read_document

# Version 1 files written before the host tracks and the clock field load unchanged (clock "host").
TIMELINE_FORMAT_VERSION = 1
# Steps a run traces unless told otherwise (`--trace`: all, `--no-trace`: none): enough for
# `meshplan compare` (warm-up plus steady state), while a long run's trace stays a few MB.
TRACE_WINDOW_STEPS = 100
# The tracks that time the instructions on the run's clock (the device's on a GPU), and the
# host's view of the same instructions (GPU runs only).
INSTRUCTION_TRACKS = (Track.COMPUTE, Track.COMM)
HOST_TRACKS = (Track.HOST, Track.HOST_COMM)
_HOST_TRACK_OF = {Track.COMPUTE: Track.HOST, Track.COMM: Track.HOST_COMM}


@dataclass(frozen=True)
class Event:
    """One instruction's interval on one rank. Seconds."""

    rank: int
    step: int
    index: int        # position in the rank's Program (-1 for events outside it)
    name: str         # the instruction as printed, e.g. "F s1 m3"
    op: str
    start: float
    end: float
    track: str = Track.COMPUTE   # compute (blocking), comm (asynchronous, issue to completion), host, host_comm

    @property
    def duration(self) -> float:
        return self.end - self.start


_EVENT_FIELDS = tuple(f.name for f in fields(Event))   # dataclasses.asdict deep-copies: 20x slower


@dataclass(frozen=True)
class Timeline:
    """Events of one or more ranks; `source` says "measured" or "predicted"; `clock` what timed the
    compute and comm tracks (Clock.HOST: perf_counter; Clock.CUDA: CUDA events, with the host's
    intervals on the host tracks)."""

    events: tuple[Event, ...]
    source: str = "measured"
    format_version: int = TIMELINE_FORMAT_VERSION
    clock: str = Clock.HOST

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({e.rank for e in self.events}))

    @property
    def has_host_track(self) -> bool:
        return any(e.track in HOST_TRACKS for e in self.events)

    def for_rank(self, rank: int) -> "Timeline":
        return Timeline(tuple(e for e in self.events if e.rank == rank), self.source, clock=self.clock)

    def for_step(self, step: int) -> "Timeline":
        return Timeline(tuple(e for e in self.events if e.step == step), self.source, clock=self.clock)

    def step_times(self, tracks: tuple[str, ...] = INSTRUCTION_TRACKS) -> dict[int, float]:
        """Seconds from the first event's start to the last event's end, per step (all ranks), over
        the events on `tracks` (default: the instructions on the run's clock; HOST_TRACKS: the host's
        view of a GPU run)."""
        out: dict[int, tuple[float, float]] = {}
        for e in self.events:
            if e.track not in tracks:
                continue
            lo, hi = out.get(e.step, (e.start, e.end))
            out[e.step] = (min(lo, e.start), max(hi, e.end))
        return {s: hi - lo for s, (lo, hi) in sorted(out.items())}

    def overlap_fraction(self, op: str = "ALLREDUCE", name_contains: str = "grads",
                         behind: tuple[str, ...] = ("B",)) -> float | None:
        """Fraction of the time spent in `op` collectives that ran while the same rank
        was busy in `behind` instructions (backward): 1.0 is fully hidden.

        None when there is no such collective. O(n log n) in the number of events: each
        collective is measured against the sorted, disjoint busy intervals through prefix sums
        (a long run has as many collectives as backward intervals; pairing them all was quadratic).
        """
        total = hidden = 0.0
        by_rank: dict[int, list[Event]] = {}
        for e in self.events:
            by_rank.setdefault(e.rank, []).append(e)
        for evs in by_rank.values():
            busy = _union([(e.start, e.end) for e in evs if e.op in behind and e.track == Track.COMPUTE])
            starts = [lo for lo, _hi in busy]
            ends = [hi for _lo, hi in busy]
            covered = list(accumulate((hi - lo for lo, hi in busy), initial=0.0))
            for e in evs:
                if e.op == op and name_contains in e.name and e.track == Track.COMM:
                    total += e.duration
                    hidden += _covered(starts, ends, covered, e.start, e.end)
        return hidden / total if total > 0 else None

    # ---- JSON -----------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format_version": self.format_version, "source": self.source, "clock": str(self.clock),
                "events": [{k: getattr(e, k) for k in _EVENT_FIELDS} for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        if d.get("format_version") != TIMELINE_FORMAT_VERSION:
            raise ValueError(f"Timeline format_version {d.get('format_version')!r} is not "
                             f"{TIMELINE_FORMAT_VERSION}; record it again")
        clock = d.get("clock", Clock.HOST)   # files written before the CUDA clock: host times
        if clock not in set(Clock):
            raise ValueError(f"Timeline clock {clock!r} is not one of {', '.join(Clock)}; record it again")
        return cls(tuple(Event(**e) for e in d["events"]), d.get("source", "measured"), clock=Clock(clock))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> "Timeline":
        return cls.from_dict(read_document(path, "timeline file"))

    @classmethod
    def merge(cls, timelines: Iterable["Timeline"]) -> "Timeline":
        tls = list(timelines)
        events = tuple(sorted((e for t in tls for e in t.events), key=lambda e: (e.start, e.rank)))
        return cls(events, tls[0].source if tls else "measured", clock=tls[0].clock if tls else Clock.HOST)

    def to_chrome(self) -> dict:
        """Chrome trace-event JSON: one process per rank, a compute and a comm thread (and, for a GPU
        run, the host's two beside them)."""
        tids = {Track.COMPUTE: 0, Track.COMM: 1, Track.HOST: 2, Track.HOST_COMM: 3}
        shown = tuple(tids) if self.has_host_track else INSTRUCTION_TRACKS
        device = " (device)" if self.clock == Clock.CUDA else ""
        out = []
        for r in self.ranks:
            out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
            for track in shown:
                name = f"{track}{device}" if track in INSTRUCTION_TRACKS else str(track)
                out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tids[track], "args": {"name": name}})
        for e in self.events:
            out.append({"name": e.name, "cat": e.op, "ph": "X", "pid": e.rank, "tid": tids.get(e.track, 0),
                        "ts": e.start * 1e6, "dur": max(e.duration, 0.0) * 1e6,
                        "args": {"step": e.step, "index": e.index}})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, "clock": str(self.clock)}}

    def save_chrome(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome()))


def write_run_timeline(out: str | Path, files: Iterable[Path]) -> Timeline | None:
    """Merge the ranks' Timeline `files` into out/timeline.json and out/trace.json (Perfetto) and return
    the merge (O(n log n) in the events). With no file, removes those two files (an earlier run's would
    pass for this one's) and returns None."""
    out = Path(out)
    tls = [Timeline.load(p) for p in files]
    if not tls:
        for name in ("timeline.json", "trace.json"):
            (out / name).unlink(missing_ok=True)
        return None
    merged = Timeline.merge(tls)
    merged.save(out / "timeline.json")
    merged.save_chrome(out / "trace.json")
    return merged


def _covered(starts: list[float], ends: list[float], prefix: list[float], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside the disjoint sorted intervals (starts[i], ends[i]); prefix[i] is
    the total length of the first i intervals."""
    if hi <= lo:
        return 0.0
    first = bisect_right(ends, lo)     # the first interval that ends after lo
    last = bisect_left(starts, hi)     # intervals [first, last) start before hi
    if first >= last:
        return 0.0
    inside = prefix[last] - prefix[first]
    inside -= max(0.0, lo - starts[first])     # the part of the first interval before lo
    inside -= max(0.0, ends[last - 1] - hi)    # the part of the last interval after hi
    return inside


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def clock_id() -> int:
    """A 63-bit id of the clock time.perf_counter reads: equal in every process of one kernel boot.

    On Linux perf_counter is CLOCK_MONOTONIC, one clock for every process on the machine (and in
    containers sharing its kernel), so the kernel's boot id names it. Elsewhere the host name does."""
    import hashlib
    import socket

    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        text = socket.gethostname()
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


PROBE_BYTES = 1 << 20


def probe_all_reduce(comm, world_size: int, device, nbytes: int = PROBE_BYTES, rounds: int = 16) -> float | None:
    """Median seconds of an all-reduce of `nbytes` over all `world_size` ranks (every rank calls
    it), back to back as calibration measures it; None with one rank. On this kind of machine
    the same transfer can take ~2.5x longer from one minute to the next (where the virtual
    CPUs sit on the host), and a run is only comparable with a calibration taken in the same
    state: `meshplan compare` sets this beside the calibrated time."""
    if world_size < 2:
        return None
    import torch

    group = comm.group(range(world_size))
    buf = torch.zeros(max(nbytes // 4, 1), device=device)
    group.all_reduce(buf)  # warm-up: connections, buffers
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        group.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shared_origin(broadcast, clock: int | None = None, now: int | None = None) -> float:
    """A perf_counter reading (s) to serve as time 0 on every rank: rank 0's, for the ranks that
    read the same clock as rank 0 (clock_id); the rank's own reading for the others.

    broadcast(values) -> values: rank 0's int64 list [clock id, perf_counter_ns] on every rank.
    Called right after a barrier. Ranks reading one clock then share an exact origin; setting
    each rank's own origin after the barrier instead leaves the barrier's exit skew between
    their timelines (measured: up to 0.6 ms between two local ranks), which a step's span,
    taken over all ranks, adds in full."""
    mine = clock_id() if clock is None else clock
    own = time.perf_counter_ns() if now is None else now
    root_clock, root_origin = broadcast([mine, own])
    return (root_origin if root_clock == mine else own) / 1e9


class Mark(NamedTuple):
    """A point of an instruction as the Recorder saw it: host seconds on the timeline, and the
    device's event recorded there (None on a CPU run, or where the device is not timed)."""

    host: float
    event: object = None


@dataclass
class Recorder:
    """Collects one rank's events while it runs (mutable; owned by the executor).

    `origin` is the perf_counter reading that counts as time 0 (shared_origin: rank
    0's, on the ranks that read its clock; else set after a barrier, so that all
    ranks of a run share it to within the barrier's skew).

    `device`: on a GPU, a runtime.execute.device_clock.CudaClock: each interval given to add_interval
    is then timed on the device as well (the compute and comm tracks, the timeline's clock
    Clock.CUDA) and the host's interval goes on the host tracks. The device intervals are read
    when their events are done: collect() between steps reads those the device has passed
    without waiting; timeline() waits for the rest (the run is over then).
    """

    rank: int
    origin: float = field(default_factory=time.perf_counter)
    events: list[Event] = field(default_factory=list)
    enabled: bool = True
    device: object = None
    # device intervals whose events are not read yet: (step, index, name, op, track, start event, end event)
    _open: list[tuple] = field(default_factory=list)
    # device intervals read: (step, index, name, op, track, start s, end s) in device seconds from the origin event
    _read: list[tuple] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def mark(self, device: bool = True) -> Mark:
        """The host time now, and (with a device clock, when recording and `device`) an event on the
        calling thread's current stream. An instruction's interval is two marks: add_interval."""
        if device and self.enabled and self.device is not None:
            event = self.device.record()
            return Mark(self.now(), event)
        return Mark(self.now())

    def add(self, step: int, index: int, name: str, op: str, start: float, end: float,
            track: str = Track.COMPUTE) -> None:
        """An event with the given host times as it is (no device timing)."""
        if self.enabled:
            self.events.append(Event(self.rank, step, index, name, op, start, end, track))

    def add_interval(self, step: int, index: int, name: str, op: str, start: Mark, end: Mark,
                     track: str = Track.COMPUTE) -> None:
        """An instruction from mark `start` to mark `end` on `track` (COMPUTE or COMM): as the host
        saw it on a CPU run; on a GPU the device's interval on `track` (read later) and the host's
        on the matching host track."""
        if not self.enabled:
            return
        if start.event is None or end.event is None:
            self.events.append(Event(self.rank, step, index, name, op, start.host, end.host, track))
            return
        self.events.append(Event(self.rank, step, index, name, op, start.host, end.host, _HOST_TRACK_OF[track]))
        self._open.append((step, index, name, op, track, start.event, end.event))

    def collect(self, wait: bool = False) -> None:
        """Read the device intervals whose events the device has passed (all of them with `wait`,
        which blocks until it has); a no-op without a device clock. Called between steps, after the
        step's own synchronization, it never waits for the device."""
        clock, still = self.device, []
        for item in self._open:
            s, e = item[5], item[6]
            if wait:
                clock.wait(e)
            if wait or (clock.done(s) and clock.done(e)):
                self._read.append((*item[:5], clock.elapsed(s), clock.elapsed(e)))
                clock.release(s)
                clock.release(e)
            else:
                still.append(item)
        self._open = still

    def timeline(self) -> Timeline:
        """The events recorded so far; with a device clock, its intervals placed on the timeline's
        clock (this waits for the device: call it when the run is over)."""
        if self.device is None:
            return Timeline(tuple(self.events))
        self.collect(wait=True)
        place = self.device.placement()
        measured = [Event(self.rank, step, index, name, op, place(a), place(b), track)
                    for step, index, name, op, track, a, b in self._read]
        return Timeline(tuple(self.events + measured), clock=Clock.CUDA)

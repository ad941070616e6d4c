"""`CudaClock`: CUDA events placed on a run's timeline, so the trace times what the device ran.

On a GPU the host only queues kernels: perf_counter around a backward measures how long the host
took to queue it, and the next instruction that synchronizes (the gradient norm's .item()) shows
the wait for it. The Recorder (runtime/program/trace.py) therefore brackets each instruction with a pair
of CUDA events as well, on the stream the instruction runs on, and resolves them later, at a point
where the device is known to be past them; it never synchronizes to do so until the timeline is
saved.

Placing device times on the timeline's clock (seconds from the run's origin, which every rank
shares through shared_origin): an origin event is recorded while the device is idle, at host time
`origin_at` on the timeline; an event e then sits at

    origin_at + elapsed_time(origin event, e) * scale

where `scale` (about 1) corrects the drift between the GPU's timer and the host's clock: a second
anchor, recorded when the timeline is saved (the device idle again), fixes it so that the last
anchor sits at its host time as well. Both anchors are placed to within the time it takes to
record an event (a few microseconds).
"""

from __future__ import annotations

from typing import Callable

import torch

# Seconds between the anchors below which the drift is not corrected (the anchors' placement,
# a few microseconds each, would dominate the correction).
MIN_DRIFT_SPAN = 1.0


class CudaClock:
    """Timed CUDA events on `device`, read as seconds on the host clock `now` (the Recorder's).

    record() -> an event recorded on the current stream (from a pool: events are reused once
    read); done(e): whether the device has passed it (no synchronization); elapsed(e): device
    seconds from the origin event to e (e must be done); wait(e): block until it is; release(e):
    back to the pool; placement(): f(elapsed) -> timeline seconds (synchronizes the device: call it
    when the timeline is saved, not during a step)."""

    def __init__(self, device: torch.device, now: Callable[[], float]):
        self.device = device
        self._now = now
        self._pool: list[torch.cuda.Event] = []
        torch.cuda.synchronize(device)
        self._origin, self._origin_at = self._anchor()

    def _anchor(self) -> tuple[torch.cuda.Event, float]:
        """An event recorded on an idle device and the host time it ran at (the device reaches an
        event on an idle stream as soon as it is recorded: between the two host readings)."""
        with torch.cuda.device(self.device):
            e = torch.cuda.Event(enable_timing=True)
            t0 = self._now()
            e.record()
            t1 = self._now()
            e.synchronize()
        return e, (t0 + t1) / 2

    def record(self) -> torch.cuda.Event:
        try:
            e = self._pool.pop()
        except IndexError:   # another thread (a communication callback) may take the last one
            e = torch.cuda.Event(enable_timing=True)
        e.record()   # the calling thread's current stream (a collective's callback: one after it)
        return e

    @staticmethod
    def done(e: torch.cuda.Event) -> bool:
        return e.query()

    @staticmethod
    def wait(e: torch.cuda.Event) -> None:
        e.synchronize()

    def elapsed(self, e: torch.cuda.Event) -> float:
        return self._origin.elapsed_time(e) * 1e-3

    def release(self, e: torch.cuda.Event) -> None:
        self._pool.append(e)

    def placement(self) -> Callable[[float], float]:
        torch.cuda.synchronize(self.device)
        end, end_at = self._anchor()
        span = self.elapsed(end)
        # over a short run the anchors' few microseconds of uncertainty would outweigh any drift
        scale = (end_at - self._origin_at) / span if span > MIN_DRIFT_SPAN else 1.0
        origin_at = self._origin_at
        return lambda seconds: origin_at + seconds * scale

"""A run's live progress: one line with ETA on a terminal (tqdm), plain lines otherwise.

Exactly one process draws it, so rank outputs never interleave with it: under `meshplan run`
the launcher (it reads rank 0's metrics.jsonl as the lines appear: `MetricsTail`; the ranks get
--no-progress), under the generated torchrun/mpirun/srun scripts rank 0 (on its stderr).
On a terminal the bar redraws at most every BAR_REFRESH_S; otherwise a plain line is printed
when PLAIN_INTERVAL_S have passed since the last one, and for the last step, so that a log
file grows by a few lines a minute however fast the steps are.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TextIO

PLAIN_INTERVAL_S = 10.0
BAR_REFRESH_S = 0.5


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal that can redraw a line (not a file, a pipe, TERM=dumb
    or a terminal of no width, such as `script`'s without a window)."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):   # closed or not a real stream
        return False
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):   # no descriptor to ask: trust isatty
        columns = None
    return tty and os.environ.get("TERM", "") != "dumb" and columns != 0


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class StepProgress:
    """Shows steps first_step .. first_step + num_steps - 1 as they end (`update` with a metrics line).

    Args:
        stream: where it draws (e.g. sys.stderr). bar: tqdm bar (True) or plain lines (False);
            None decides by is_terminal(stream). interval_s: seconds between plain lines.
        clock: seconds, monotonic (time.monotonic; tests pass their own).
    """

    def __init__(self, first_step: int, num_steps: int, stream: TextIO, *, bar: bool | None = None,
                 interval_s: float = PLAIN_INTERVAL_S, clock=time.monotonic):
        self._first = first_step
        self._total = num_steps
        self._stream = stream
        self._interval = interval_s
        self._clock = clock
        self._start = clock()
        self._last_line = self._start
        self._done = 0
        self._first_seen: tuple[float, int] | None = None   # (time, steps done) at the first update
        self._step_seconds = [0.0, 0]                      # sum and count of the lines' own `seconds`
        self._use_bar = bar if bar is not None else is_terminal(stream)
        self._bar = None

    def update(self, fields: dict) -> None:
        """One step ended; `fields` is its metrics line (step and loss are read)."""
        self._done = fields["step"] - self._first + 1
        loss = fields.get("loss")
        loss_text = f"loss {loss:.4f}" if isinstance(loss, (int, float)) else "loss -"
        now = self._clock()
        if isinstance(fields.get("seconds"), (int, float)):
            self._step_seconds[0] += fields["seconds"]
            self._step_seconds[1] += 1
        if self._first_seen is None:   # rates count from here: start-up is not a step
            self._first_seen = (now, self._done)
            if self._use_bar:
                from tqdm import tqdm

                self._bar = tqdm(total=self._total, file=self._stream, unit="step", dynamic_ncols=True,
                                 mininterval=BAR_REFRESH_S, leave=True)
        if self._bar is not None:
            self._bar.set_postfix_str(loss_text, refresh=False)
            self._bar.update(self._done - self._bar.n)
            return
        if now - self._last_line >= self._interval or self._done >= self._total:
            self._last_line = now
            self._stream.write(self._line(fields["step"], loss_text, now - self._start) + "\n")
            self._stream.flush()

    def _line(self, step: int, loss_text: str, elapsed: float) -> str:
        """The plain line after `elapsed` seconds: step, share done, loss, rate and ETA. The rate is the wall
        time per step since the first one seen (the processes' start-up is not a step), or the steps' own
        mean seconds where that is more (the launcher may read several lines at once). On the first line
        (one step seen) the wall time is the start-up's: the rate is the steps' own seconds alone, or none."""
        t0, n0 = self._first_seen
        now = self._start + elapsed
        per = (now - t0) / (self._done - n0) if self._done > n0 else math.nan
        total, count = self._step_seconds
        if count:
            per = total / count if math.isnan(per) else max(per, total / count)
        eta = per * (self._total - self._done)
        rate = f"{per:.3f} s/step, ETA {_duration(eta)}" if math.isfinite(eta) else "ETA -"
        return (f"step {step} ({self._done}/{self._total}, {100 * self._done / self._total:.0f}%)  {loss_text}  "
                f"{_duration(elapsed)} elapsed, {rate}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class MetricsTail:
    """The complete lines rank 0 appends to metrics.jsonl, read as they appear (the launcher's display).

    `ignore_inode`: the inode of a file that holds an earlier run's lines and that this run replaces
    (a resumed run rewrites the file: runtime.files.write_atomic makes a new one); its lines are not
    this run's. Lines of steps before `first_step` (kept by a resumed run) are skipped too.
    """

    def __init__(self, path: Path, first_step: int, ignore_inode: int | None = None):
        self._path = Path(path)
        self._first = first_step
        self._ignore = ignore_inode
        self._f = None
        self._partial = ""

    def read(self) -> list[dict]:
        """This run's lines written since the last call (parsed), oldest first."""
        if self._f is None:
            try:
                f = self._path.open(encoding="utf-8")
            except FileNotFoundError:
                return []
            if os.fstat(f.fileno()).st_ino == self._ignore:
                f.close()
                return []
            self._f = f
        text = self._partial + self._f.read()
        lines = text.split("\n")
        self._partial = lines.pop()   # a line still being written
        out = []
        for line in lines:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and isinstance(d.get("step"), int) and d["step"] >= self._first:
                out.append(d)
        return out

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class RunProgress:
    """The `meshplan run` launcher's display: rank 0's metrics.jsonl lines (MetricsTail) drawn by StepProgress.

    The launcher calls `poll()` while it waits for the ranks (it reads at most every `every_s`) and
    `close()` when they have exited, which shows the lines not yet shown. A fresh run's file is removed
    before the ranks start (rank 0 would empty it), so every line the tail finds is this run's."""

    def __init__(self, path: Path, first_step: int, num_steps: int, stream: TextIO, *, every_s: float = 0.2,
                 bar: bool | None = None):
        path = Path(path)
        if first_step == 0:
            path.unlink(missing_ok=True)
        ignore = path.stat().st_ino if first_step > 0 and path.exists() else None
        self._tail = MetricsTail(path, first_step, ignore)
        self._progress = StepProgress(first_step, num_steps, stream, bar=bar)
        self._every = every_s
        self._next = 0.0

    def poll(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._every
        for fields in self._tail.read():
            self._progress.update(fields)

    def close(self) -> None:
        self._next = 0.0
        self.poll()
        self._tail.close()
        self._progress.close()

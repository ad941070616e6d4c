"""A progress bar for long searches: on a terminal only, quiet otherwise or when asked."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Prints `label [####....] done/total  note` on one line, at most 10 times a second.

    Shown only when `enabled` is True, or when it is None and the stream is a
    terminal, and only once the work has taken longer than `after` seconds.
    """

    def __init__(self, total: int, label: str, *, enabled: bool | None = None, stream: TextIO | None = None,
                 after: float = 1.0) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.after = after
        self.start = time.perf_counter()
        self._last = 0.0
        self._shown = False

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.start < self.after or now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = int(width * min(done, self.total) / self.total)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  {note}   ")
        self.stream.flush()
        self._shown = True

    def close(self, note: str = "") -> None:
        if self._shown:
            self.stream.write(f"\r{self.label}: done in {time.perf_counter() - self.start:.1f} s  {note}\n")
            self.stream.flush()

"""TensorBoard event files of a run (`meshplan run --tensorboard DIR`): the scalars of metrics.jsonl.

tensorboard is an optional extra (`pip install 'meshplan[tensorboard]'`); without it a run
that asks for event files stops before training with that advice (`require_tensorboard`).
Rank 0 writes through torch.utils.tensorboard.SummaryWriter, whose writer thread does the file
I/O. A step is one event holding all its scalars (one Summary with a value per field, as
add_scalar would write them one event each: that cost about 170 us a step here), and the events
are handed to the writer every HAND_OVER_S seconds rather than every step: each hand-over wakes
the writer thread, which then competes with the training loop for the interpreter lock (the
writer itself only flushes the file every 120 s). Its queue holds QUEUE_EVENTS events rather
than the default 10, so that a writer thread slowed by a busy machine never makes a step wait. A resumed run passes its first step as purge_step:
TensorBoard then hides the earlier run's events of the steps this one trains again, as
metrics.jsonl drops their lines.
"""

from __future__ import annotations

import time
from pathlib import Path

QUEUE_EVENTS = 1000
HAND_OVER_S = 2.0


class TensorBoardMissing(ValueError):
    """--tensorboard was given but the tensorboard package is not installed."""


def require_tensorboard():
    """torch.utils.tensorboard.SummaryWriter, or TensorBoardMissing saying how to install it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise TensorBoardMissing(
            f"--tensorboard needs the tensorboard package, which cannot be imported ({e}); install it with "
            "pip install 'meshplan[tensorboard]', or leave out --tensorboard") from None
    return SummaryWriter


class TensorBoardLog:
    """Event files under `logdir`: one scalar per numeric field of each metrics line, at its step
    (the tag is the field's name; booleans as 0/1; null fields are left out)."""

    def __init__(self, logdir: str | Path, first_step: int = 0, *, clock=time.monotonic):
        writer = require_tensorboard()
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._summary = Summary
        self._writer = writer(log_dir=str(logdir), purge_step=first_step if first_step > 0 else None,
                              max_queue=QUEUE_EVENTS)
        self._clock = clock
        self._handed = clock()
        self._pending: list[tuple[object, int, float]] = []   # (Summary, step, wall time)

    def write(self, fields: dict) -> None:
        value = self._summary.Value
        values = [value(tag=key, simple_value=float(v)) for key, v in fields.items()
                  if key != "step" and isinstance(v, (int, float))]   # bool is an int
        self._pending.append((self._summary(value=values), fields["step"], time.time()))
        if self._clock() - self._handed >= HAND_OVER_S:
            self.hand_over()

    def hand_over(self) -> None:
        """Give the steps' events to the writer thread (it writes them to the file within 120 s, or at close)."""
        # SummaryWriter.file_writer: the FileWriter its add_scalar writes through (made in __init__)
        for summary, step, wall in self._pending:
            self._writer.file_writer.add_summary(summary, step, wall)
        self._pending.clear()
        self._handed = self._clock()

    def close(self) -> None:
        self.hand_over()
        self._writer.close()

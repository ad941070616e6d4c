"""TensorBoard event files of a run (`meshplan run --tensorboard DIR`): the scalars of metrics.jsonl.

tensorboard is an optional extra (`pip install 'meshplan[tensorboard]'`); without it a run
that asks for event files stops before training with that advice (`require_tensorboard`).
Rank 0 writes through torch.utils.tensorboard.SummaryWriter, whose writer thread does the file
I/O, so a step costs a few add_scalar calls. A resumed run passes its first step as purge_step:
TensorBoard then hides the earlier run's events of the steps this one trains again, as
metrics.jsonl drops their lines.
"""

from __future__ import annotations

from pathlib import Path


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

    def __init__(self, logdir: str | Path, first_step: int = 0):
        writer = require_tensorboard()
        self._writer = writer(log_dir=str(logdir), purge_step=first_step if first_step > 0 else None)

    def write(self, fields: dict) -> None:
        step = fields["step"]
        for key, value in fields.items():
            if key != "step" and isinstance(value, (int, float)):   # bool is an int
                self._writer.add_scalar(key, float(value), step)

    def close(self) -> None:
        self._writer.close()

"""What a run reports while it trains: metrics.jsonl, one line per step, and the loss check.

metrics.jsonl is written as training goes (a line per step, flushed), so a long run's history
is on disk whatever ends it. A fresh run starts a fresh file; a resumed run keeps the lines of
the steps before its checkpoint and appends its own after them (the lines of steps it will
run again, written by the run it resumes after its checkpoint, are dropped: they would
appear twice).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TextIO

from runtime.executor import RankFailure
from runtime.files import write_atomic


class NonFiniteLoss(RankFailure):
    """The loss became NaN or infinite: nothing after it means anything, so the run stops."""


def check_loss(loss: float, step: int, rank: int) -> None:
    """Raise NonFiniteLoss naming `step` when `loss` (the step's global mean loss) is NaN or infinite.

    One float comparison per step. There is no loss scaler (fp16 scaling would skip such a step
    instead): the run stops here."""
    if not math.isfinite(loss):
        raise NonFiniteLoss(
            f"the loss is {loss} at step {step} (rank {rank}, the first step with a non-finite loss); the run "
            "stops: lower --lr, check the data of that step, or resume from a checkpoint before it")


def open_metrics(path: Path, first_step: int) -> TextIO:
    """metrics.jsonl opened for appending this run's steps (see the module docstring).

    first_step: 0 for a fresh run (the file starts empty), else the step of the checkpoint
    the run resumed from (the file keeps its lines of earlier steps)."""
    path = Path(path)
    if first_step == 0 or not path.is_file():
        return path.open("w", encoding="utf-8")
    kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
            if _step_of(line) is not None and _step_of(line) < first_step]
    write_atomic(path, "".join(line if line.endswith("\n") else line + "\n" for line in kept).encode("utf-8"))
    return path.open("a", encoding="utf-8")


def write_metrics(f: TextIO, step: int, loss: float, seconds: float) -> None:
    """One step's line, flushed (a crash loses at most the step in flight)."""
    f.write(json.dumps({"step": step, "loss": loss, "seconds": seconds}) + "\n")
    f.flush()


def _step_of(line: str) -> int | None:
    """The step a metrics line is for; None for a line cut short (a run killed while writing it)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None

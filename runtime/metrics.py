"""What a run reports while it trains: metrics.jsonl, one line per step, and the loss check.

metrics.jsonl is written as training goes (a line per step, flushed), so a long run's history
is on disk whatever ends it. A fresh run starts a fresh file; a resumed run keeps the lines of
the steps before its checkpoint and appends its own after them (the lines of steps it will
run again, written by the run it resumes after its checkpoint, are dropped: they would
appear twice).

A step's line (rank 0 writes it; `step_fields` makes it, as a dict, so that more keys such as
evaluation results pass through to the file and TensorBoard unchanged):

  step, loss, seconds    the step's number, global mean loss and wall seconds (rank 0's clock)
  lr, grad_norm,         from the step's StepResult (runtime/executor.py); null when the run does
  loss_scale, skipped    not compute them (no schedule; a build made with --no-grad-norm that neither
                         clips nor scales the loss; no fp16 loss scaling)
  samples_per_s          global batch size / seconds
  tokens_per_s           samples_per_s x StepWork.tokens_per_sample (runtime/program/step_work.py)
  mfu                    model FLOPs utilisation: StepWork.flops / (seconds x StepWork.peak_flops);
                         null when the build records no peak for its dtype (or no StepWork)
  peak_memory_bytes      rank 0's peak memory in the step: on GPU the CUDA allocator's peak
                         (torch.cuda.max_memory_allocated, reset before every step); on CPU the
                         process's peak resident set so far (resource.getrusage ru_maxrss: the OS
                         keeps one peak per process and it cannot be reset, so it never falls).
                         Both are a counter read, not op counting (runtime/execute/memtrack.py counts).
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import TextIO

import torch

from runtime.launch.progress import StepProgress
from runtime.tensorboard_log import TensorBoardLog

from runtime.executor import RankFailure, StepResult
from runtime.files import write_atomic
from runtime.program.step_work import StepWork


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


def step_fields(result: StepResult, global_batch_size: int, work: StepWork | None,
                peak_memory_bytes: int | None) -> dict:
    """One step's line of metrics.jsonl as a dict (the fields of the module docstring, in that order)."""
    secs = result.seconds
    samples = global_batch_size / secs if secs > 0 else None
    mfu = None
    if work is not None and work.peak_flops and secs > 0:
        mfu = work.flops / (secs * work.peak_flops)
    return {"step": result.step, "loss": result.loss, "seconds": secs, "lr": result.lr,
            "grad_norm": result.grad_norm, "loss_scale": result.loss_scale, "skipped": result.skipped,
            "samples_per_s": samples,
            "tokens_per_s": samples * work.tokens_per_sample if samples is not None and work is not None else None,
            "mfu": mfu, "peak_memory_bytes": peak_memory_bytes}


def write_metrics(f: TextIO, fields: dict) -> None:
    """One step's line, flushed (a crash loses at most the step in flight)."""
    f.write(json.dumps(fields) + "\n")
    f.flush()


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak: the CUDA allocator's peak is reset; a CPU process's cannot be (see above)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Bytes: the CUDA allocator's peak since reset_peak_memory on GPU, else the process's peak
    resident set (ru_maxrss is KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class StepLog:
    """Rank 0's report of every step: metrics.jsonl and, when asked, TensorBoard and the progress display.

    Per step: `start_step()` before it runs (resets the CUDA peak), then `write(fields(result))`; a
    caller may add keys to the dict between the two (evaluation results). Nothing is reopened or
    recounted per step: one json line and flush, a few add_scalar calls, a progress update.

    Args:
        path: metrics.jsonl; first_step, num_steps: the steps this run trains (first_step > 0: resumed).
        global_batch_size, work: from the TrainSpec. device: rank 0's device (for peak memory).
        tensorboard: directory of the event files, or None. progress: draw the progress display on `stream`.
    """

    def __init__(self, path: Path, first_step: int, num_steps: int, global_batch_size: int,
                 work: StepWork | None, device: torch.device, *, tensorboard: str | None = None,
                 progress: bool = False, stream: TextIO | None = None):
        self._batch = global_batch_size
        self._work = work
        self._device = device
        self._tb = TensorBoardLog(tensorboard, first_step) if tensorboard else None
        self._progress = StepProgress(first_step, num_steps, stream or sys.stderr) if progress else None
        self._file = open_metrics(path, first_step)

    def start_step(self) -> None:
        reset_peak_memory(self._device)

    def fields(self, result: StepResult) -> dict:
        return step_fields(result, self._batch, self._work, peak_memory_bytes(self._device))

    def write(self, fields: dict) -> None:
        write_metrics(self._file, fields)
        if self._tb is not None:
            self._tb.write(fields)
        if self._progress is not None:
            self._progress.update(fields)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._progress is not None:
            self._progress.close()


def _step_of(line: str) -> int | None:
    """The step a metrics line is for; None for a line cut short (a run killed while writing it)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None

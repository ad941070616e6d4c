"""Learning-rate schedules: linear warm-up, then constant, cosine or linear decay to a floor.

`ScheduleSpec` is the build's schedule (TrainSpec.schedule); `build()` makes it from
torch.optim.lr_scheduler classes only, over an optimizer whose groups start at the peak lr
(OptimizerSpec.lr). Step t (0-based, the t-th optimizer step) uses, with W = warmup_steps,
D = decay_steps, lr the peak and m = min_lr:

    t < W             lr * (t + 1) / (W + 1)           (LinearLR: from lr / (W + 1), near 0, to lr)
    constant, t >= W  lr
    cosine, W<=t<=D   m + (lr - m) * (1 + cos(pi * (t - W) / (D - W))) / 2   (CosineAnnealingLR)
    linear, W<=t<=D   lr + (m - lr) * (t - W) / (D - W)                      (LinearLR)
    t >= D            m                                (cosine: ConstantLR; linear: LinearLR holds)

Two quirks of torch's classes this avoids: CosineAnnealingLR is periodic, so past T_max its lr
climbs back up (a ConstantLR at the floor takes over at D); and SequentialLR starts each later
scheduler at its milestone from that scheduler's closed form, relative to the optimizer's
initial_lr (so each phase is written relative to the peak, not to where the previous one ended).
`scheduler.step()` follows every `optimizer.step()` (runtime/executor.py STEP, runtime/reference.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch.optim import lr_scheduler

from runtime.documents import refuse_unknown_fields

# ConstantLR multiplies by its factor until total_iters and then divides it out again: the floor
# after the decay must never end, so its total_iters is beyond any run.
_FOREVER = 2**62


class ScheduleKind(StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


class LrScheduleError(ValueError):
    """A learning-rate schedule that cannot be built; the message names the field and what to give."""


@dataclass(frozen=True)
class ScheduleSpec:
    """kind: after the warm-up, constant lr or a cosine/linear decay; warmup_steps: steps of linear
    warm-up (0: none); min_lr: the floor the decay reaches (parameter units per step, at most the
    peak lr); decay_steps: the step at which the decay reaches min_lr (counted from step 0,
    warm-up included; required for cosine and linear, more than warmup_steps)."""

    kind: ScheduleKind = ScheduleKind.CONSTANT
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ScheduleKind(self.kind))
        except ValueError:
            raise LrScheduleError(f"unknown lr schedule {self.kind!r}; known: "
                                f"{', '.join(k.value for k in ScheduleKind)}") from None
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise LrScheduleError(f"warmup_steps must be a whole number of steps >= 0, got {self.warmup_steps!r}")
        if not self.min_lr >= 0:
            raise LrScheduleError(f"min_lr must be zero or positive, got {self.min_lr!r}")
        if self.kind is ScheduleKind.CONSTANT:
            if self.decay_steps is not None or self.min_lr:
                raise LrScheduleError("min_lr and decay_steps belong to a decaying schedule; give --lr-schedule "
                                    "cosine or linear, or leave them out")
            return
        d = self.decay_steps
        if d is None:
            raise LrScheduleError(f"the {self.kind.value} schedule needs decay_steps (--decay-steps: the step at "
                                "which the lr reaches min_lr)")
        if isinstance(d, bool) or not isinstance(d, int) or d <= self.warmup_steps:
            raise LrScheduleError(f"decay_steps ({d!r}) must be a whole number of steps greater than warmup_steps "
                                f"({self.warmup_steps})")

    def check_lr(self, lr: float) -> None:
        """min_lr must not exceed the peak lr."""
        if self.min_lr > lr:
            raise LrScheduleError(f"min_lr {self.min_lr!r} is above the peak lr {lr!r}; give a smaller --min-lr")

    def build(self, optimizer: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        """The scheduler over `optimizer`, whose groups' lr is the peak lr now (sets the lr of step 0)."""
        lr = optimizer.param_groups[0]["lr"]
        self.check_lr(lr)
        w = self.warmup_steps
        phases: list[lr_scheduler.LRScheduler] = []
        milestones: list[int] = []
        if w:
            phases.append(lr_scheduler.LinearLR(optimizer, start_factor=1.0 / (w + 1), end_factor=1.0,
                                                total_iters=w))
        if self.kind is ScheduleKind.COSINE:
            phases.append(lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.decay_steps - w, eta_min=self.min_lr))
            phases.append(lr_scheduler.ConstantLR(optimizer, factor=self.min_lr / lr, total_iters=_FOREVER))
            milestones = ([w] if w else []) + [self.decay_steps]
        elif self.kind is ScheduleKind.LINEAR:
            phases.append(lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=self.min_lr / lr,
                                                total_iters=self.decay_steps - w))
            milestones = [w] if w else []
        elif not w:   # constant without warm-up: a factor of one, so that every run has a scheduler
            phases.append(lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0))
        if len(phases) == 1:
            return phases[0]
        return lr_scheduler.SequentialLR(optimizer, phases, milestones=milestones)

    @property
    def is_constant(self) -> bool:
        return self.kind is ScheduleKind.CONSTANT and not self.warmup_steps

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, d: dict) -> "ScheduleSpec":
        refuse_unknown_fields(d, cls, "schedule", LrScheduleError)
        return cls(**d)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The lr the optimizer's next step uses (every group shares it)."""
    lr = optimizer.param_groups[0]["lr"]
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def scheduler_state(scheduler: lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer) -> dict:
    """What a checkpoint keeps of the schedule: the scheduler's state_dict and the groups' lr."""
    return {"scheduler": scheduler.state_dict(), "lr": [g["lr"] for g in optimizer.param_groups]}


def load_scheduler_state(scheduler: lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Undo `scheduler_state`: the scheduler continues where it was and the groups step with the saved lr
    (every group of a schedule shares one lr, so a layout with other groups takes the first)."""
    scheduler.load_state_dict(state["scheduler"])
    lrs = state["lr"]
    for i, g in enumerate(optimizer.param_groups):
        g["lr"] = lrs[i] if i < len(lrs) else lrs[0]

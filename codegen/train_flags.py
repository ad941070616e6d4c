"""`meshplan codegen` flags for the optimizer's implementation, weight-decay groups and lr schedule.

    --optimizer-impl auto|for-loop|foreach|fused   --no-decay 1d|none
    --lr-schedule constant|cosine|linear  --warmup-steps N  --min-lr LR  --decay-steps N

`add_flags` puts them on the codegen parser (planner/app/cli.py); `optimizer_and_schedule` makes
the build's OptimizerSpec and ScheduleSpec from the parsed arguments (their checks raise
ValueErrors that name the flag's field).
"""

from __future__ import annotations

import argparse

from runtime.lr_schedule import ScheduleKind, ScheduleSpec
from runtime.optim import NoDecay, OptimizerImpl, OptimizerSpec

MAX_STEPS = 2 ** 40   # as meshplan run --steps (planner/app/cli.py)


def add_flags(p: argparse.ArgumentParser, count, nonnegative_number) -> None:
    """count / nonnegative_number: planner.app.cli_args' argparse types."""
    p.add_argument("--optimizer-impl", default=OptimizerImpl.AUTO.value, choices=[m.value for m in OptimizerImpl],
                   help="torch's optimizer code path (default auto: fused AdamW / foreach SGD on CUDA, what "
                        "benchmarks/optimizer_impl.py measured fastest on CPU)")
    p.add_argument("--no-decay", default=NoDecay.ONE_D.value, choices=[m.value for m in NoDecay],
                   help="parameters without weight decay: 1d (default: biases and norm weights, those with fewer "
                        "than 2 dims) or none (decay every parameter)")
    p.add_argument("--lr-schedule", default=ScheduleKind.CONSTANT.value, choices=[m.value for m in ScheduleKind],
                   help="after the warm-up: constant --lr, or a cosine or linear decay to --min-lr at --decay-steps")
    p.add_argument("--warmup-steps", type=count(0, MAX_STEPS), default=0,
                   help="steps of linear warm-up from lr / (N + 1) to --lr (default 0)")
    p.add_argument("--min-lr", type=nonnegative_number, default=0.0,
                   help="the lr a cosine or linear decay ends at (default 0)")
    p.add_argument("--decay-steps", type=count(1, MAX_STEPS), default=None,
                   help="the step at which a cosine or linear decay reaches --min-lr, warm-up included")


def optimizer_and_schedule(args: argparse.Namespace) -> tuple[OptimizerSpec, ScheduleSpec]:
    opt = OptimizerSpec(name=args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                        impl=args.optimizer_impl, no_decay=args.no_decay)
    schedule = ScheduleSpec(kind=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
                            decay_steps=args.decay_steps)
    schedule.check_lr(opt.lr)
    return opt, schedule

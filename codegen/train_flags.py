"""`meshplan codegen` flags for the optimizer's implementation, weight-decay groups, lr schedule and
how the stages' compute runs.

    --optimizer-impl auto|for-loop|foreach|fused   --no-decay 1d|none
    --lr-schedule constant|cosine|linear  --warmup-steps N  --min-lr LR  --decay-steps N
    --compile/--no-compile  --loss-impl full|compiled|chunked  --loss-chunk-tokens N  --vocab-multiple N

`add_flags` puts them on the codegen parser (planner/app/cli.py); `optimizer_and_schedule` makes
the build's OptimizerSpec and ScheduleSpec from the parsed arguments (their checks raise
ValueErrors that name the flag's field); `execution_of` the build's Execution: the plan's, with
each execution flag given overriding its field.
"""

from __future__ import annotations

import argparse
import dataclasses

from runtime.execution import MAX_VOCAB_MULTIPLE, CompileScope, Execution, LossImpl
from runtime.execute.lr_schedule import ScheduleKind, ScheduleSpec
from runtime.execute.optim import NoDecay, OptimizerImpl, OptimizerSpec

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
    # execution options: default None, so that the plan's value holds unless a flag is given
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run each stage's repeated blocks through torch.compile, one compiled function per "
                        "distinct block (default: as the plan says; a plan made without it: off)")
    p.add_argument("--compile-scope", default=None, choices=[m.value for m in CompileScope],
                   help="with --compile: blocks (one compiled function per distinct repeated block, the other "
                        "layers eager) or stage (each stage's whole forward compiled, with --loss-impl compiled "
                        "the last stage's forward and loss as one graph; longer compilation, and a data-parallel "
                        "gradient sync starts after the stage's backward) (default: the plan's)")
    p.add_argument("--loss-impl", default=None, choices=[m.value for m in LossImpl],
                   help="the last stage's cross-entropy: full (the logits, then the loss in fp32), compiled (the "
                        "same through torch.compile: no fp32 copy of the logits; logits whole on each rank) or "
                        "chunked (fused with the output layer, chunks of tokens, no full logits) (default: the plan's)")
    p.add_argument("--loss-chunk-tokens", type=count(0), default=None, metavar="N",
                   help="tokens per chunk of the chunked loss (0: chosen from the vocabulary; default: the plan's)")
    p.add_argument("--vocab-multiple", type=count(1, MAX_VOCAB_MULTIPLE), default=None, metavar="N",
                   help="pad the output layer's rows (and a tied embedding's) to a multiple of N, per tensor rank; "
                        "logits, loss and checkpoints keep the real vocabulary (1: none; default: the plan's)")


def optimizer_and_schedule(args: argparse.Namespace) -> tuple[OptimizerSpec, ScheduleSpec]:
    opt = OptimizerSpec(name=args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                        impl=args.optimizer_impl, no_decay=args.no_decay)
    schedule = ScheduleSpec(kind=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
                            decay_steps=args.decay_steps)
    schedule.check_lr(opt.lr)
    return opt, schedule


def execution_of(args: argparse.Namespace, planned: Execution) -> Execution:
    """The build's Execution: `planned` (the plan's) with the execution flags that were given."""
    changes = {field: value for field, value in (("compile", args.compile), ("compile_scope", args.compile_scope),
                                                 ("loss", args.loss_impl),
                                                 ("loss_chunk_tokens", args.loss_chunk_tokens),
                                                 ("vocab_multiple", args.vocab_multiple)) if value is not None}
    return dataclasses.replace(planned, **changes)

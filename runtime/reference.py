"""The single-process reference a parallel run must equal.

The reference builds the whole model exactly as the build's `init` says,
reads the same global batches (same data factory, same seeds), walks each
batch in the same micro-batch chunks the data ranks use (so that BatchNorm
sees the same samples together; for models without batch-coupled layers
the chunking changes nothing but rounding), scales each chunk's mean loss
by 1/chunks, and takes one optimizer step per global batch.

BatchNorm running statistics: the parallel run updates them on each data rank
from that rank's micro-batches, then averages them over the ranks
(runtime/execute/running_stats.py). The reference does the same in one process: each
`stats_group` (the chunks one rank runs, in order) starts from the step's
statistics, and the groups' results are averaged.

The optimizer is the build's (runtime/execute/optim.py) over the whole model: the same weight-decay
groups, decided by each parameter's dims, and the implementation the ranks resolved
(`like_the_ranks`); its lr schedule (runtime/execute/lr_schedule.py) steps after every optimizer step.

It runs with as many threads as a rank (OMP_NUM_THREADS, 1 under `meshplan
run`): torch picks kernels by thread count, and two kernels round differently.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from runtime.batch_source import open_data
from runtime.data import DataSource, Split, call_model
from runtime.execute.evaluation import EvalResult, EvalSpec, count_correct
from runtime.losses import compute_loss
from runtime.materialize import build_model
from runtime.execute.running_stats import batchnorm_modules, load_statistics, statistics
from runtime.spec import TrainSpec
from runtime.program.shards import FeatureSplit
from runtime.vocab import DType
from runtime.documents import read_document


@dataclass
class ReferenceRun:
    losses: list[float]              # mean loss over the global batch, per step
    params: dict[str, torch.Tensor]  # final parameters by name
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)   # final buffers by name
    evals: list[EvalResult] = field(default_factory=list)            # held-out evaluations, by step
    grad_norms: list[float] = field(default_factory=list)    # per step, the float64 norm before clipping (unscaled)
    loss_scales: list[float | None] = field(default_factory=list)   # per step, the scale its backward used
    skipped: list[bool] = field(default_factory=list)        # per step, GradScaler skipped the optimizer step


@contextlib.contextmanager
def rank_threads():
    """Run with the thread count a rank process has (OMP_NUM_THREADS, default 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def autocast_for(spec: TrainSpec):
    return contextlib.nullcontext() if spec.dtype == DType.FP32 else \
        torch.autocast("cpu", dtype=getattr(torch, DType(spec.dtype).torch_name))


def reference_step(model: nn.Module, spec: TrainSpec, chunks: list, stats_groups: list[int] | None = None,
                   scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """Forward and backward of one global batch (gradients accumulate into .grad); the mean loss.

    stats_groups[c]: which rank runs chunk c (None: one rank); BatchNorm statistics are
    updated per group from the step's starting values, then averaged over the groups.
    scale: what each chunk's loss goes through before backward (GradScaler.scale), or None.
    """
    mods = batchnorm_modules(model)
    groups = stats_groups or [0] * len(chunks)
    if len(groups) != len(chunks):
        raise ValueError(f"{len(chunks)} chunks but BatchNorm groups for {len(groups)}; the reference's micro-batch "
                         "size differs from the run's")
    start = statistics(mods)
    state = {g: start for g in dict.fromkeys(groups)}
    total = 0.0
    cast = autocast_for(spec)
    for c, (inputs, targets) in enumerate(chunks):
        if mods:
            load_statistics(mods, state[groups[c]])
        with cast:
            loss = compute_loss(spec.loss, call_model(model, inputs), targets)
        part = loss / len(chunks)
        (scale(part) if scale is not None else part).backward()
        total += float(loss.detach()) / len(chunks)
        if mods:
            state[groups[c]] = statistics(mods)
    if mods and len(state) > 1:
        mean = []
        for k, m in enumerate(mods):
            vals = []
            for j, b in enumerate(m.buffers(recurse=False)):
                if b.is_floating_point():
                    acc = state[groups[0]][k][j].clone()
                    for g in list(state)[1:]:
                        acc += state[g][k][j]
                    vals.append(acc / len(state))
                else:
                    vals.append(state[groups[0]][k][j])
            mean.append(vals)
        load_statistics(mods, mean)
    elif mods:
        load_statistics(mods, state[groups[0]])
    return total


def reference_data(spec: TrainSpec, micro_batch_size: int | None = None, split: Split = Split.TRAIN) -> DataSource:
    return open_data(spec, micro_batch_size or spec.global_batch_size, split=split)


def evaluate_model(model: nn.Module, spec: TrainSpec, data: DataSource, batches: int, step: int) -> EvalResult:
    """The held-out evaluation a run does after `step` (runtime/execute/evaluation.py), in one process: the
    model in eval() mode under torch.no_grad, batches 0 .. batches - 1 of `data` (Split.EVAL) in the
    run's micro-batch chunks, each chunk's mean loss scaled by 1/chunks."""
    was = model.training
    model.eval()
    per_batch = []
    try:
        with torch.no_grad():
            for j in range(batches):
                chunks = data.micro_batches(j)
                loss, correct, counted = 0.0, 0, 0
                for inputs, targets in chunks:
                    with autocast_for(spec):
                        out = call_model(model, inputs)
                        loss += float(compute_loss(spec.loss, out, targets)) / len(chunks)
                    c, n = count_correct(spec.loss, out, targets)
                    correct, counted = correct + c, counted + n
                per_batch.append((loss, correct, counted))
    finally:
        model.train(was)
    return EvalResult.combine(step, per_batch)


def reference_run(spec: TrainSpec, steps: int, micro_batch_size: int | None = None, *,
                  stats_groups: list[int] | None = None,
                  perturb: Callable[[nn.Module], None] | None = None,
                  evaluation: EvalSpec | None = None) -> ReferenceRun:
    """Train the whole model in this process for `steps` steps (see the module docstring).

    perturb: applied to the freshly built model (the rounding-level twin of runtime/verify/__init__.py).
    evaluation: evaluate after the steps it names, as the run does (evaluate_model).
    """
    with rank_threads():
        model = build_model(spec)
        if perturb is not None:
            perturb(model)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = spec.optimizer.build(params)
        scheduler = spec.schedule.build(opt)
        data = reference_data(spec, micro_batch_size)
        held_out = reference_data(spec, micro_batch_size, Split.EVAL) if evaluation is not None else None
        scaler = spec.loss_scale.grad_scaler() if spec.loss_scale is not None else None
        losses, evals, norms, scales, skipped = [], [], [], [], []
        for step in range(steps):
            for p in params:
                p.grad = None
            scales.append(scaler.get_scale() if scaler is not None else None)
            losses.append(reference_step(model, spec, data.micro_batches(step), stats_groups,
                                         scaler.scale if scaler is not None else None))
            norm, skip = _optimizer_step(opt, params, spec.clip_grad, scaler)
            norms.append(norm)
            skipped.append(skip)
            scheduler.step()
            if evaluation is not None and evaluation.due(step):
                evals.append(evaluate_model(model, spec, held_out, evaluation.batches, step))
    return ReferenceRun(losses, {k: v.detach().clone() for k, v in model.named_parameters()},
                        {k: v.detach().clone() for k, v in model.named_buffers()}, evals, norms, scales, skipped)


def like_the_ranks(spec: TrainSpec, run_dir: str | os.PathLike) -> TrainSpec:
    """`spec` with the optimizer implementation the ranks of a finished run resolved and used (each
    records it in run_dir/rank_XXXX.json as "optimizer_impl"), so that the reference steps like
    with like; unchanged when no rank recorded one."""
    for f in sorted(Path(run_dir).glob("rank_*.json")):
        impl = read_document(f, "run record").get("optimizer_impl")
        if impl:
            return spec.replace(optimizer=spec.optimizer.with_impl(impl))
    return spec


def _optimizer_step(opt: torch.optim.Optimizer, params: list[nn.Parameter], clip: float | None,
                    scaler: torch.amp.GradScaler | None) -> tuple[float, bool]:
    """PyTorch's own loop: unscale_, the total norm, clip_grads_with_norm_ (with --clip-grad), step, update.
    (The total norm before clipping, whether the scaler skipped the step.)"""
    if scaler is not None:
        scaler.unscale_(opt)
    # The total norm in float64, a tensor at a time: ATen's CPU norm of one large float32 tensor is off
    # by 1e-4 and more (GPT-2's embedding; runtime/execute/grad_norm.py), which would be the reference's
    # error, not the run's. Clipping then multiplies by clip_grad_norm_'s float32 coefficient, as the ranks do.
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float64)
    if clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, clip, total.float())
    norm = float(total)
    if scaler is None:
        opt.step()
        return norm, False
    before = scaler.get_scale()
    # GradScaler.step hands a fused optimizer the step's found_inf and lets it skip itself; torch 2.13's
    # fused SGD then still creates its momentum buffers, from uninitialised memory, on a skipped first step
    # (NaN later). So a non-finite step does not reach the optimizer here, as in the ranks
    # (runtime/execute/grad_step.py); update() reads the found_inf that unscale_ recorded either way.
    if math.isfinite(norm):
        scaler.step(opt)
    scaler.update()
    return norm, scaler.get_scale() < before   # GradScaler backs off exactly when it skipped


def local_slice(full: torch.Tensor, split: tuple[int, FeatureSplit] | None, rank: int, num: int) -> torch.Tensor:
    """The part of a whole tensor that tensor rank `rank` of `num` holds: its slice along the
    split dimension, padded as the runtime pads it (StageSpec.split_of gives `split`)."""
    if split is None or full.dim() == 0 or (num == 1 and not split[1].padded(1)):
        return full
    dim, fs = split
    return fs.take(full, dim, rank, num)

"""`meshplan run --verify`: does the parallel run compute what the single-process run computes?

Two checks, both against the single-process reference (runtime/reference.py):

1. Step by step, from the same parameters. Every rank records, at each optimizer step, the
   parameters the step began with and their complete gradients (runtime/verify/step_record.py),
   and its BatchNorm statistics. For each step the reference model is given those
   parameters and statistics, runs the same global batch in the same chunks, and must
   produce the same loss, the same gradient of every parameter (each tensor's difference
   measured against its own size: |g - g_ref| <= rtol |g_ref| + atol sqrt(n) rms(G_ref))
   and the same running statistics. Rounding cannot accumulate here, so the tolerances are
   tight, and a gradient the run lost (a bucket not reduced, tied copies not summed, halo
   gradients dropped) shows at once.

2. The trajectory: the free-running reference trained from the start, against the run's
   losses and final parameters. Two correct runs part ways as rounding differences grow
   through training, faster in some models than others (a ReLU network near a sign flip, a
   BatchNorm over few samples). How fast is measured, not guessed: a twin of the reference
   whose every parameter starts a rounding step away (one float32 ulp; half a bf16/fp16 ulp
   under 16-bit autocast) is trained alongside, and the run may stray from the reference by
   at most MARGIN times the twin's largest distance so far (with a floor of the dtype's
   precision, relative to how far training moved the tensor).

Adam and AdamW normalize their update per element (about lr whatever the gradient's size), so
where a gradient element is itself at rounding level, rounding moves its parameter by a part of
lr that a twin summing in the reference's order does not show: under them a tensor may also
differ by a small fraction of lr per element per step (adam_allowance), the unit the optimizer
moves it in. Gradient errors stay caught by check 1, which Adam's normalization does not reach.

NaN or infinity anywhere (a loss, a gradient, a parameter, the run's or the reference's) fails
with its own message ("NaN in the gradient of fc.weight at step 3"), never as a large or zero
difference.

The tolerances come from the dtype (fp32 or a 16-bit autocast); --rtol/--atol override the
per-step ones. A model that draws random numbers in training (dropout with p > 0, also inside a
module capture keeps whole, such as nn.TransformerEncoderLayer) cannot equal the single-process
run sample by sample: the check says it does not apply (Verification.inapplicable) and compares
nothing, instead of reporting a mismatch.

The tolerances and the rounding-level tools are runtime/verify/rounding.py; what the checks found,
runtime/verify/verification.py.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import torch
from torch import nn

from runtime.launch.build_files import read_build, read_build_file
from runtime.checkpoint.restore import assemble_files
from runtime.data import map_inputs
from runtime.execute.evaluation import compare_evals, read_run_evals
from runtime.materialize import build_model
from runtime.parallel.registry import param_place
from runtime.program import Program
from runtime.reference import like_the_ranks, local_slice, rank_threads, reference_data, reference_run, reference_step
from runtime.spec import StageSpec, TrainSpec
from runtime.verify.step_record import load_records, step_files
from runtime.torch_records import WHOLE_MODEL_KEY, whole_model_view
from runtime.verify.rounding import (MARGIN, NORMALIZED_OPTIMIZERS, ROUNDING_SAMPLES, TOLERANCES, in_float64, l2_norm,
                                     adam_allowance, adam_sensitive, non_finite, nudge)
from runtime.verify.verification import Verification
from runtime.verify.grad_checks import check_norm, check_skip, check_trajectory_outcomes, read_outcomes
from runtime.vocab import DType


def stats_groups(programs: dict[int, Program], specs: dict[int, StageSpec], bidirectional: bool) -> list[int]:
    """For each chunk of a global batch (data shard r's micro-batches, in order), the group of
    ranks whose BatchNorm statistics it updates: its data shard (and, for GEMS, its direction).
    The tiles of one image (spatial stages) share a data shard (runtime.program.Program.data_shard)."""
    p0 = programs[0]
    _, shards = p0.data_shard()
    m = p0.num_micro_batches
    return [r * 2 + (j % 2) if bidirectional else r for r in range(shards) for j in range(m)]


def random_ops_problem(info: dict) -> str | None:
    """Why build.json's model rules out a sample-exact check (its random draws, planner/graph/randomness.py),
    or None."""
    ops = info.get("random_ops") or []
    if not ops:
        return None
    more = f" and {len(ops) - 3} more" if len(ops) > 3 else ""
    return (f"the model draws random numbers in training ({', '.join(ops[:3])}{more}): with dropout every rank "
            "draws its own masks, so the parallel run cannot equal the single-process run sample by sample. To "
            "verify the parallel arithmetic, set dropout to 0 (codegen again), run --verify, then train with it")


def verify_build(build: str | os.PathLike, steps: int, losses: dict[int, list[float]], *,
                 rtol: float | None = None, atol: float | None = None, first_step: int = 0) -> Verification:
    """Check a finished `--save-steps --save-params` run of `build` (see the module docstring).

    `losses`: rank -> its loss per step; `first_step`: the run resumed from a checkpoint of that
    step, so its steps are the reference's first_step .. first_step + steps - 1.
    """
    build = Path(build)
    info = read_build(build)
    problem = random_ops_problem(info)
    if problem:   # nothing to compare: say why, before reading anything else
        cmp = Verification(steps=steps)
        cmp.not_applicable(problem)
        return cmp
    spec = TrainSpec.from_dict(info["train"])
    if WHOLE_MODEL_KEY in info:   # a torch build: rank 0 records the whole model (runtime/torch_records.py)
        programs, specs = whole_model_view(info)
    else:
        programs = {int(r): Program.from_dict(d) for r, d in
                    read_build_file(build, "programs.json", "per-rank Programs file").items()}
        specs = {int(s): StageSpec.from_dict(d) for s, d in info["stages"].items()}
    tol = dict(TOLERANCES.get(spec.dtype, TOLERANCES[DType.FP32]))
    if rtol is not None:
        tol.update(grad_rtol=rtol, loss=rtol, stats=rtol, floor=rtol)
    if atol is not None:
        tol["grad_atol"] = atol
    cmp = Verification(steps=steps)
    missing = [r for r in sorted(programs) if r not in losses
               or not (build / "run" / f"steps_rank_{r:04d}.pt").is_file()]
    if missing:
        cmp.fail_incomplete(f"rank(s) {', '.join(map(str, missing))} left no results in {build / 'run'} (rank_XXXX.json with "
                 "their losses, steps_rank_XXXX.pt with their steps): they did not run or did not finish; see "
                 "their logs")
        return cmp
    spec = like_the_ranks(spec, build / "run")   # the optimizer implementation the ranks used
    mb = programs[0].micro_batch_size
    groups = stats_groups(programs, specs, _bidirectional(build))
    sensitive = _check_steps(cmp, build, spec, programs, mb, groups, steps, first_step, losses, tol)
    _check_trajectory(cmp, build, spec, programs, specs, mb, groups, steps, first_step, losses, tol, sensitive)
    return cmp


def _bidirectional(build: Path) -> bool:
    plan = read_build_file(build, "plan.json", "plan file")
    return bool(plan.get("config", {}).get("bidirectional"))


def _evaluate(model: nn.Module, spec: TrainSpec, state, start, chunks: list, groups: list[int],
              perturb_seed: int | None = None, scale: float | None = None) -> tuple[float, dict, dict]:
    """(loss, gradients, buffers after) of one step of `model` from the run's parameters (`state`)
    and statistics (`start`), moved one ulp when `perturb_seed` is given; with `scale` (fp16 loss
    scaling) each loss is multiplied by it before backward and the gradients divided after."""
    named, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    with torch.no_grad():
        for name, st in state.optimizer.items():
            if name in named:
                named[name].copy_(st["value"].view_as(named[name]))
        for name, b in start.buffers.items():
            if name in buffers:
                buffers[name].copy_(b)
    if perturb_seed is not None:
        nudge(model, perturb_seed, spec.dtype)
    for p in named.values():
        p.grad = None
    loss = reference_step(model, spec, chunks, groups, (lambda t: t * scale) if scale is not None else None)
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double() / (scale or 1.0)
             for n, p in named.items()}
    return loss, grads, {n: b.detach().double() for n, b in buffers.items() if b.is_floating_point()}


def _check_steps(cmp: Verification, build: Path, spec: TrainSpec, programs: dict[int, Program], mb: int,
                 groups: list[int], steps: int, first_step: int, losses: dict[int, list[float]],
                 tol: dict) -> dict[str, int]:
    """Check 1: each step's loss, gradients and statistics from the run's own parameters.

    Returns, for an Adam-family optimizer, per parameter the number of (element, step) pairs whose
    update rounding decides (adam_sensitive; for the trajectory's allowance); else {}.

    Each is measured against the step computed exactly (float64, no autocast); the run may be
    off by the dtype's floor plus MARGIN times the farthest of ROUNDING_SAMPLES rounding-level
    computations of the same step (the reference in the run's dtype, and rounding-level twins),
    which is how far rounding alone moves this step of this model.
    """
    adam = spec.optimizer if spec.optimizer.name in NORMALIZED_OPTIMIZERS else None
    sensitive: dict[str, int] = {}
    try:
        records = load_records(build / "run", len(programs))
    except FileNotFoundError as e:
        cmp.fail(f"{e}; run with --verify (it records the steps)")
        return sensitive
    mesh = programs[0].mesh
    exact_spec = spec.replace(dtype=DType.FP32.value, loss_scale=None)
    outcomes = read_outcomes(build / "run")
    with rank_threads():
        model = build_model(spec)
        model.train()
        exact = copy.deepcopy(model).double()
        data = reference_data(spec, mb)
        for k in range(steps):
            step = first_step + k
            if any(len(rec["steps"]) <= k for rec in records):
                cmp.fail(f"step {step}: a rank recorded only {min(len(r['steps']) for r in records)} steps")
                return sensitive
            files = step_files(records, k)
            state = assemble_files(files, mesh)
            start = assemble_files([{**f, "buffers": rec["steps"][k]["buffers_start"]}
                                    for f, rec in zip(files, records)], mesh)
            chunks = data.micro_batches(step)
            loss64, g64, b64 = _evaluate(exact, exact_spec, state, start,
                                         [(map_inputs(i, in_float64), t) for i, t in chunks], groups)
            loss_scale = outcomes.scale(k)
            samples = [_evaluate(model, spec, state, start, chunks, groups, seed, loss_scale)
                       for seed in [None, *range(1, ROUNDING_SAMPLES)]]
            if k >= len(losses.get(0, [])):
                cmp.fail(f"step {step}: rank 0 reported no loss for it")
                return sensitive
            if not _check_step_loss(cmp, step, losses[0][k], loss64, samples, tol):
                return sensitive
            if loss_scale is not None:   # fp16: the same scale overflows in the reference, or neither does
                overflowed = any(non_finite(g) for g in samples[0][1].values())
                check_skip(cmp, step, outcomes.was_skipped(k), overflowed, loss_scale)
                if overflowed or outcomes.was_skipped(k):
                    continue   # a skipped step's gradients hold inf: nothing else to compare
            _check_step_grads(cmp, step, state, g64, samples, tol, adam, sensitive, outcomes, k)
            _check_step_buffers(cmp, step, state, b64, samples, tol)
    return sensitive


def _check_step_loss(cmp: Verification, step: int, got: float, loss64: float, samples: list, tol: dict) -> bool:
    """The run's loss of `step` (`got`) against the exact one (`loss64`), allowed the rounding-level
    `samples`' spread; False (the failure recorded) when either is not finite and nothing more compares."""
    bad = non_finite(got) or non_finite(loss64)
    if bad:
        whose = "the run's loss" if non_finite(got) else "the exact loss from the run's parameters"
        cmp.fail_non_finite(f"{bad} in {whose} at step {step}: the run diverged or its data holds {bad}; a "
                            "non-finite run cannot be compared (lower --lr, check the data)")
        return False
    scale = max(abs(loss64), 1e-12)
    noise = max(abs(lo - loss64) for lo, _g, _b in samples) / scale
    rel = abs(got - loss64) / scale
    allow = tol["loss"] + MARGIN * noise
    cmp.max_step_loss_rel = max(cmp.max_step_loss_rel, rel)
    if not rel <= allow:
        cmp.fail(f"step {step}: loss {got:.7g}; computed exactly from the same parameters {loss64:.7g} "
                 f"(relative difference {rel:.2g}, allowed {allow:.2g})")
    return True


def _check_step_grads(cmp: Verification, step: int, state, g64: dict, samples: list, tol: dict, adam,
                      sensitive: dict[str, int], outcomes, k: int) -> None:
    """The run's gradients of `step` (`state.optimizer`) against the exact ones (`g64`), each allowed the
    rounding-level `samples`' spread; the global norm the run recorded for its k-th step (`outcomes`, where
    it recorded norms) against the gradients it stepped. With an Adam-family optimizer (`adam`) `sensitive` counts the
    elements whose update rounding decides."""
    rms = math.sqrt(sum(l2_norm(g) ** 2 for g in g64.values()) / max(1, sum(g.numel() for g in g64.values())))
    names = [n for n in state.optimizer if n in g64]
    for name in state.optimizer:
        if name not in g64:
            cmp.fail(f"step {step}: the run steps {name!r}, which the model does not have")
    spread = {n: max(l2_norm(sg[n] - g64[n]) for _l, sg, _b in samples) for n in names}
    if adam is not None:
        for n in names:
            noise = MARGIN * torch.stack([(sg[n] - g64[n]).abs() for _l, sg, _b in samples]).amax(0)
            sensitive[n] = sensitive.get(n, 0) + adam_sensitive(g64[n], noise, tol["adam_steps"], adam.eps)
    total = math.sqrt(sum(l2_norm(g64[n]) ** 2 for n in names)) or 1e-30
    # rounding's effect spreads over every tensor (a flipped ReLU changes all the gradients
    # before it): each tensor may move by the step's relative noise, as well as its own
    step_noise = math.sqrt(sum(v ** 2 for v in spread.values())) / total
    errs = {}
    for name in names:
        want = g64[name]
        bad = non_finite(state.optimizer[name]["grad"])
        if bad:
            cmp.fail_non_finite(f"{bad} in the gradient of {name} at step {step} (the run's)")
            errs[name] = math.inf
            continue
        err = errs[name] = l2_norm(state.optimizer[name]["grad"].view_as(want).double() - want)
        allow = tol["grad_rtol"] * l2_norm(want) + tol["grad_atol"] * math.sqrt(want.numel()) * rms \
            + MARGIN * max(spread[name], step_noise * l2_norm(want))
        ratio = err / max(allow, 1e-30)
        cmp.grads_compared += 1
        if ratio > cmp.max_grad_rel:
            cmp.max_grad_rel, cmp.worst_grad = ratio, f"{name} at step {step}"
        if not ratio <= 1.0:
            cmp.fail(f"step {step}: the gradient of {name} is {err:.3g} from the exact one from the same "
                     f"parameters (norm {l2_norm(want):.3g}; rounding moves this step's gradients "
                     f"{step_noise:.2g} (relative); allowed {allow:.3g})")
    cmp.grad_noise = max(cmp.grad_noise, step_noise)
    if k < len(outcomes.grad_norms):
        recorded = math.sqrt(sum(l2_norm(state.optimizer[n]["grad"]) ** 2 for n in names))
        check_norm(cmp, step, outcomes.norm(k), recorded, total, tol["grad_rtol"] + MARGIN * step_noise)
    cmp.max_grad_err = max(cmp.max_grad_err, math.sqrt(sum(e ** 2 for e in errs.values())) / total)


def _check_step_buffers(cmp: Verification, step: int, state, b64: dict, samples: list, tol: dict) -> None:
    """The floating-point buffers after `step` (BatchNorm statistics) against the exact ones."""
    for name, b in state.buffers.items():
        if name not in b64 or not b.is_floating_point():
            continue
        want = b64[name]
        scale = max(l2_norm(want), 1e-12)
        rel = l2_norm(b.double() - want) / scale
        spread = max(l2_norm(sb[name] - want) for _l, _g, sb in samples) / scale
        allow = tol["stats"] + MARGIN * spread
        cmp.stats_compared += 1
        cmp.max_stats_rel = max(cmp.max_stats_rel, rel)
        if not rel <= allow:
            cmp.fail(f"step {step}: buffer {name} after the step is {rel:.2g} (relative) from the exact one "
                     f"(allowed {allow:.2g})")


def _check_trajectory(cmp: Verification, build: Path, spec: TrainSpec, programs: dict[int, Program],
                      specs: dict[int, StageSpec], mb: int, groups: list[int], steps: int, first_step: int,
                      losses: dict[int, list[float]], tol: dict, sensitive: dict[str, int]) -> None:
    """Check 2: the run's losses and final parameters against the free-running reference.

    sensitive: from check 1 (Adam-family optimizers), per parameter the (element, step) pairs whose
    update rounding decides; scaled to this rank's slice and to the steps before a resumed run."""
    total = first_step + steps
    evaluation, run_evals = read_run_evals(build / "run")
    ref = reference_run(spec, total, micro_batch_size=mb, stats_groups=groups, evaluation=evaluation)
    twin = reference_run(spec, total, micro_batch_size=mb, stats_groups=groups,
                         perturb=lambda m: nudge(m, dtype=spec.dtype), evaluation=evaluation)
    if evaluation is not None:
        problems, cmp.max_eval_rel = compare_evals(run_evals, [e for e in ref.evals if e.step >= first_step],
                                                   twin.evals, tol["floor"], MARGIN)
        cmp.evals_compared = len(run_evals)
        for problem in problems:
            cmp.fail(problem)
    with rank_threads():
        init = dict(build_model(spec).named_parameters())
    _check_losses(cmp, losses, ref.losses[first_step:], twin.losses[first_step:], steps, first_step, tol)
    check_trajectory_outcomes(cmp, read_outcomes(build / "run"), ref, twin, first_step, steps, tol["floor"], MARGIN)
    _check_final_params(cmp, build, spec, programs, specs, ref, twin, init, steps, total, tol, sensitive)


def _check_losses(cmp: Verification, losses: dict[int, list[float]], ref_losses: list[float],
                  twin_losses: list[float], steps: int, first_step: int, tol: dict) -> None:
    """Every rank's losses against the reference's, allowed MARGIN times the rounding-level twin's distance
    so far (at least the floor); cmp.twin_loss_diff: that distance at the end."""
    envelope = 0.0
    for r, run in sorted(losses.items()):
        if len(run) != steps:
            cmp.fail(f"rank {r} reported {len(run)} losses for {steps} steps")
            continue
        envelope = 0.0
        for k, (a, b, c) in enumerate(zip(run, ref_losses, twin_losses)):
            bad = non_finite(a) or non_finite(b)
            if bad:
                whose = f"rank {r}'s loss" if non_finite(a) else "the single-process reference's loss"
                cmp.fail_non_finite(f"{bad} in {whose} at step {first_step + k}: a non-finite run cannot be compared "
                         "(lower --lr, check the data)")
                break
            envelope = max(envelope, abs(c - b))
            d = abs(a - b)
            cmp.max_loss_diff = max(cmp.max_loss_diff, d)
            cmp.max_loss_rel = max(cmp.max_loss_rel, d / max(abs(b), 1e-12))
            allow = max(tol["floor"] * abs(b), MARGIN * envelope)
            if not (math.isfinite(a) and d <= allow):
                cmp.fail(f"rank {r}, step {first_step + k}: loss {a:.7g}, the reference's {b:.7g} (|diff| {d:.3g} > "
                         f"{allow:.3g}: {MARGIN:g} x the rounding-level twin's {envelope:.3g}, at least "
                         f"{tol['floor']:.0e} relative)")
    cmp.twin_loss_diff = envelope


def _check_final_params(cmp: Verification, build: Path, spec: TrainSpec, programs: dict[int, Program],
                        specs: dict[int, StageSpec], ref, twin, init: dict, steps: int, total: int, tol: dict,
                        sensitive: dict[str, int]) -> None:
    """Each rank's final parameters (run/params_rank_*.pt) against its slice of the reference's, allowed
    the floor of how far training moved them, MARGIN times the twin's distance, or Adam's allowance."""
    for r, prog in programs.items():
        f = build / "run" / f"params_rank_{r:04d}.pt"
        if not f.is_file():
            cmp.fail(f"rank {r} saved no final parameters ({f.name})")
            continue
        tcoord, tsize = param_place(prog)
        for s, params in torch.load(f, weights_only=True).items():
            sp = specs[s]
            for local_name, value in params.items():
                name = sp.canonical(local_name)
                if name not in ref.params:
                    cmp.fail(f"rank {r} holds {local_name!r}, which the model does not have")
                    continue
                split = sp.split_of(local_name, value.dim())
                want = local_slice(ref.params[name], split, tcoord, tsize)
                other = local_slice(twin.params[name], split, tcoord, tsize)
                start = local_slice(init[name].detach(), split, tcoord, tsize)
                if tuple(want.shape) != tuple(value.shape):
                    cmp.fail(f"{local_name} on rank {r} is {tuple(value.shape)}, the reference's slice "
                             f"{tuple(want.shape)}")
                    continue
                bad = non_finite(value) or non_finite(want)
                if bad:
                    whose = f"parameter {local_name} on rank {r}" if non_finite(value) else \
                        f"the single-process reference's {name}"
                    cmp.fail_non_finite(f"{bad} in {whose} after step {total - 1}")
                    continue
                d = l2_norm(value.double() - want.double())
                # the floor scales with how far training moved the tensor (a bias starts at zero); under
                # Adam, rounding reaches the parameters through its normalized update (adam_allowance)
                allow = max(tol["floor"] * l2_norm(want.double() - start.double()),
                            MARGIN * l2_norm(other.double() - want.double()),
                            adam_allowance(spec.optimizer, total, value.numel(), tol["adam_steps"],
                                           sensitive.get(name, 0) * total / max(steps, 1)
                                           * value.numel() / max(ref.params[name].numel(), 1)), 1e-12)
                cmp.params_compared += 1
                cmp.max_param_diff = max(cmp.max_param_diff, d)
                if d / allow > cmp.max_param_rel:
                    cmp.max_param_rel, cmp.worst_param = d / allow, f"{local_name} on rank {r}"
                if not d <= allow:
                    cmp.fail(f"{local_name} on rank {r} after {steps} step(s) differs from the reference's by {d:.3g} "
                             f"(allowed {allow:.3g})")

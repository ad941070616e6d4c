"""--verify's checks of what happens at STEP: global gradient norms, fp16 loss scales, skipped steps.

The run records per step (run/rank_XXXX.json, runtime/grad_step.outcome_record) the global norm
of its unscaled, unclipped gradient, the loss scale the step's backward used and whether the
step was skipped. runtime/verify/__init__.py calls these:

  check 1 (per step, from the run's parameters): the reference in the run's dtype, its loss
  scaled by the run's scale, must overflow exactly where the run skipped (`check_skip`); on a
  step taken, the run's norm must be the norm of the gradients it recorded (each element counted
  once: a replica counted twice or a shard left out shows here) and, within the gradient
  tolerance, the exact gradient's norm (`check_norm`).

  check 2 (the trajectory): the free-running reference (torch.amp.GradScaler, clip_grads_with_norm_)
  must use the same scale and skip the same steps, and its total norms (float64) must equal
  the run's within the rounding-level twin's spread (`check_trajectory_outcomes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from runtime.documents import read_document

NORM_RTOL = 1e-5   # the run's norm against the norm of its own recorded gradients (float64 sums of float32)


@dataclass(frozen=True)
class RunOutcomes:
    """Rank 0's per-step record (this run's steps, in order); empty lists when the run recorded none."""

    grad_norms: list = field(default_factory=list)
    loss_scales: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def scale(self, k: int) -> float | None:
        return self.loss_scales[k] if k < len(self.loss_scales) else None

    def was_skipped(self, k: int) -> bool:
        return bool(self.skipped[k]) if k < len(self.skipped) else False

    def norm(self, k: int) -> float | None:
        return self.grad_norms[k] if k < len(self.grad_norms) else None


def read_outcomes(run_dir: Path) -> RunOutcomes:
    f = Path(run_dir) / "rank_0000.json"
    if not f.is_file():
        return RunOutcomes()
    d = read_document(f, "run record")
    return RunOutcomes(list(d.get("grad_norms", [])), list(d.get("loss_scales", [])), list(d.get("skipped", [])))


def check_skip(cmp, step: int, run_skipped: bool, ref_overflowed: bool, scale: float | None) -> None:
    """The run skipped step `step` exactly when the reference, at the same scale, overflowed."""
    cmp.skips_compared += 1
    if run_skipped != ref_overflowed:
        cmp.fail(f"step {step}: the run {'skipped' if run_skipped else 'took'} the optimizer step, but the "
                 f"reference from the same parameters at loss scale {scale:g} "
                 f"{'does not overflow' if run_skipped else 'overflows'}")


def check_norm(cmp, step: int, run_norm: float | None, recorded: float, exact: float, allow_rel: float) -> None:
    """The run's global norm against the norm of its own recorded gradients and the exact one."""
    if run_norm is None:
        cmp.fail(f"step {step}: the run recorded no gradient norm for a step it took")
        return
    cmp.norms_compared += 1
    own = abs(run_norm - recorded) / max(recorded, 1e-30)
    if not own <= NORM_RTOL:
        cmp.fail(f"step {step}: the run's global gradient norm {run_norm:.7g} is not the norm of its gradients "
                 f"{recorded:.7g} (relative {own:.2g}): some gradient element was counted twice or not at all")
    rel = abs(run_norm - exact) / max(exact, 1e-30)
    cmp.max_norm_rel = max(cmp.max_norm_rel, rel)
    if not rel <= allow_rel:
        cmp.fail(f"step {step}: the run's global gradient norm {run_norm:.7g}; computed exactly from the same "
                 f"parameters {exact:.7g} (relative {rel:.2g}, allowed {allow_rel:.2g})")


def check_trajectory_outcomes(cmp, run: RunOutcomes, ref, twin, first_step: int, steps: int, floor: float,
                              margin: float) -> None:
    """Scales and skips equal to the free-running reference's; norms within margin x the twin's spread,
    or margin x the relative gradient noise check 1 measured (cmp.grad_noise: a norm moves by at most as
    much as its gradient, and on a model whose ReLU/BatchNorm near-ties let rounding move gradients by
    percents, a twin one rounding step away may happen to stray less than the run's own rounding)."""
    for k in range(min(steps, len(run.skipped))):
        step = first_step + k
        want_scale, want_skip = ref.loss_scales[step], ref.skipped[step]
        if run.scale(k) != want_scale:
            cmp.fail(f"step {step}: the run's loss scale {run.scale(k)}, torch.amp.GradScaler's {want_scale}")
        if run.was_skipped(k) != want_skip:
            cmp.fail(f"step {step}: the run {'skipped' if run.was_skipped(k) else 'took'} the optimizer step; "
                     f"the reference (torch.amp.GradScaler) {'skipped' if want_skip else 'took'} it")
        if want_skip or run.was_skipped(k):
            continue
        got, want, other = run.norm(k), ref.grad_norms[step], twin.grad_norms[step]
        if got is None or not math.isfinite(want):
            continue
        d = abs(got - want)
        allow = max(floor * abs(want), margin * abs(other - want) if math.isfinite(other) else 0.0,
                    margin * getattr(cmp, "grad_noise", 0.0) * abs(want))
        if not d <= allow:
            cmp.fail(f"step {step}: global gradient norm {got:.7g}, the reference's total norm "
                     f"{want:.7g} (|diff| {d:.3g} > {allow:.3g})")

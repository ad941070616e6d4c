"""What `meshplan run --verify` found (runtime/verify/__init__.py fills it in): every figure the checks
measured, the problems they found, and the one summary the launcher prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field




@dataclass
class Verification:
    """What --verify found; `ok` when every check passed."""

    ok: bool = True
    steps: int = 0
    problems: list[str] = field(default_factory=list)
    # per step, from the run's own parameters
    max_step_loss_rel: float = 0.0
    max_grad_rel: float = 0.0      # largest |g - g_exact| / (its allowance), 1.0 = at the tolerance
    worst_grad: str = ""
    max_grad_err: float = 0.0      # largest relative distance of a step's whole gradient from the exact one
    grad_noise: float = 0.0        # ... and how far rounding alone moved it (the check's resolution)
    max_stats_rel: float = 0.0
    stats_compared: int = 0
    grads_compared: int = 0
    # trajectory
    max_loss_diff: float = 0.0
    max_loss_rel: float = 0.0
    max_param_diff: float = 0.0
    max_param_rel: float = 0.0     # largest tensor difference / its allowance
    worst_param: str = ""
    params_compared: int = 0
    twin_loss_diff: float = 0.0    # the rounding-level twin's largest loss distance from the reference
    evals_compared: int = 0        # held-out evaluations compared with the reference's (runtime/execute/evaluation.py)
    max_eval_rel: float = 0.0      # their largest difference / its allowance
    non_finite: bool = False       # a NaN or infinity was found (the figures above mean nothing then)
    norms_compared: int = 0        # steps whose global gradient norm was checked (runtime/verify/grad_checks.py)
    max_norm_rel: float = 0.0      # ... the largest relative distance from the exact norm
    skips_compared: int = 0        # steps whose skip (fp16 overflow) was checked against the reference
    incomplete: bool = False       # some rank left no results
    # why a sample-exact check does not apply to this model (it draws random numbers in training:
    # dropout); nothing was compared, and nothing differed. Empty when the check applied.
    inapplicable: str = ""

    def fail(self, problem: str) -> None:
        self.ok = False
        if len(self.problems) < 12:
            self.problems.append(problem)

    def fail_non_finite(self, problem: str) -> None:
        """A NaN or infinity: no difference means anything, so the summary gives none."""
        self.non_finite = True
        self.fail(problem)

    def fail_incomplete(self, problem: str) -> None:
        """Ranks left no results: there is nothing to compare, so the summary gives no figures."""
        self.incomplete = True
        self.fail(problem)

    def not_applicable(self, reason: str) -> None:
        """No sample-exact comparison applies to this model (`reason`): not a mismatch, not a pass."""
        self.ok = False
        self.inapplicable = reason

    def summary(self) -> str:
        if self.inapplicable:
            return f"NOT APPLICABLE: {self.inapplicable}; nothing was compared, so nothing was found to differ"
        if self.incomplete:
            return "\n".join(["FAILED: the run left no results to compare"] + [f"  - {p}" for p in self.problems])
        if self.non_finite:
            return "\n".join([f"FAILED: non-finite values in {self.steps} step(s), nothing to compare"]
                             + [f"  - {p}" for p in self.problems])
        head = "OK" if self.ok else "MISMATCH"
        lines = [f"{head}: {self.steps} step(s); per step from the run's parameters: loss within "
                 f"{self.max_step_loss_rel:.2g} (relative), gradients within {self.max_grad_err:.2g} of exact "
                 f"(rounding alone moves them {self.grad_noise:.2g}; {self.grads_compared} tensors, the worst at "
                 f"{self.max_grad_rel:.2g} of its tolerance: {self.worst_grad or '-'}), "
                 + (f"BatchNorm statistics within {self.max_stats_rel:.2g}" if self.stats_compared
                    else "no BatchNorm statistics")
                 + (f", global gradient norms within {self.max_norm_rel:.2g} of exact ({self.norms_compared} steps)"
                    if self.norms_compared else "")
                 + (f", fp16 overflow skips as the reference's ({self.skips_compared} steps)"
                    if self.skips_compared else "")
                 + f"; trajectory: loss |diff| {self.max_loss_diff:.3g} "
                 f"(a rounding-level twin of the reference strays {self.twin_loss_diff:.3g}), {self.params_compared} "
                 f"parameters within {self.max_param_rel:.2g} of their tolerance (worst {self.worst_param or '-'})"
                 + (f"; {self.evals_compared} evaluation(s) within {self.max_eval_rel:.2g} of their tolerance"
                    if self.evals_compared else "")]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

"""What happens to the gradients between the last gradient collective and optimizer.step().

At the Program's STEP instruction, on every rank, in this order (clip_grad_norm_ and
torch.amp.GradScaler's order in a single-process loop):

  1. unscale: with fp16 loss scaling, multiply the gradients the optimizer steps by 1/scale;
  2. record: the --verify hook (runtime/verify/step_record.py) copies the unscaled, unclipped gradients;
  3. norm: the global gradient norm (runtime/execute/grad_norm.py; one all-reduce over every rank);
  4. a non-finite norm (an overflow somewhere) skips the optimizer step on every rank when the
     loss is scaled, and stops the run with an error naming the step when it is not but the
     gradients are to be clipped (clipping by an infinite norm would zero or poison them);
  5. clip: multiply by min(1, max_norm / (norm + 1e-6)) (clip_grad_norm_'s coefficient).

After the step the scale is updated (runtime/execute/loss_scale.py). The step's backward used the
scale: `begin` folds it into each StageRunner's loss factor before the first micro-batch.

A build that asks for no reported norm (TrainSpec.grad_norm False) and neither clips nor scales the loss
skips steps 3 to 5: the step then reads no gradient besides the optimizer's, and its outcome holds no norm.

The host reads the norm only where the step needs its value: to decide a skip (loss scaling).
Clipping multiplies by a coefficient computed on the device; without loss scaling the norm is
left on the device (`pending_norm`) and read with the step's loss after the optimizer step, when
a non-finite norm under clipping stops the run (the step's parameters are then lost anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.execute.grad_norm import GlobalGradNorm
from runtime.execute.loss_scale import LossScaler

CLIP_EPS = 1e-6   # torch.nn.utils.clip_grad_norm_'s


class NonFiniteGradientError(RuntimeError):
    """The global gradient norm is inf or NaN and nothing may skip the step."""


@dataclass(frozen=True)
class StepOutcome:
    """grad_norm: the global norm of the unscaled, unclipped gradient (None on a skipped step);
    loss_scale: the scale this step's backward used (None without loss scaling); skipped: no
    optimizer step was taken on any rank."""

    grad_norm: float | None
    loss_scale: float | None
    skipped: bool


class GradientStep:
    """One rank's part of the STEP sequence (module docstring).

    Args:
        norm: the GlobalGradNorm over the optimizer's tensors (None: the step computes no norm; then it
            neither clips nor scales the loss).
        params: the tensors the optimizer steps (their .grad is changed in place).
        clip: clip the global norm to this (None: no clipping).
        scaler: the LossScaler (None: the loss is not scaled).
        rank: this rank (rank 0 logs skipped steps).
        log: where rank 0's one-line notes go.
    """

    def __init__(self, norm: GlobalGradNorm | None, params: list[torch.Tensor], *, clip: float | None = None,
                 scaler: LossScaler | None = None, rank: int = 0, log: Callable[[str], None] = print):
        if norm is None and (clip is not None or scaler is not None):
            raise ValueError("clipping and loss scaling need the global gradient norm")
        if scaler is not None:
            low = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
            if low:
                raise ValueError(f"loss scaling needs float32 master weights, but the optimizer steps {low} "
                                 "tensors; build the model in float32 (autocast computes in fp16)")
        self._norm = norm
        self._params = params
        self._clip = clip
        self._scaler = scaler
        self._rank = rank
        self._log = log
        self._bases: dict[int, float] = {}
        self._outcome: StepOutcome | None = None
        self._pending: torch.Tensor | None = None   # the squared norm, on the device, not yet read

    @property
    def scaler(self) -> LossScaler | None:
        return self._scaler

    def begin(self, runners: dict) -> None:
        """Before the step's first backward: each runner's loss factor times the current scale."""
        if self._scaler is None:
            return
        for s, r in runners.items():
            base = self._bases.setdefault(s, r.loss_scale)
            r.loss_scale = base * self._scaler.scale

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params if p.grad is not None]

    def prepare(self, step: int, record: Callable[[], None] | None = None) -> bool:
        """Steps 1 to 5 of the module docstring; True when the optimizer step is to be skipped."""
        grads = self.grads()
        scale = self._scaler.scale if self._scaler is not None else None
        if self._scaler is not None:
            self._scaler.unscale_(grads)
        if record is not None:
            record()
        if self._norm is None:     # nothing asks for the norm
            self._outcome = StepOutcome(None, None, False)
            return False
        if self._scaler is None:   # nothing to decide on the host: the norm stays on the device
            total = self._norm.compute_squared()
            if self._clip is not None:
                coef = torch.clamp(self._clip / (total.sqrt().to(torch.float32) + CLIP_EPS), max=1.0)
                for device, group in _by_device(grads).items():
                    torch._foreach_mul_(group, coef.to(device))
            self._pending = total
            self._outcome = StepOutcome(None, None, False)
            return False
        norm = self._norm.compute()
        if not math.isfinite(norm):
            if self._scaler is not None:
                self._outcome = StepOutcome(None, scale, True)
                return True
            if self._clip is not None:
                raise NonFiniteGradientError(
                    f"the global gradient norm is {norm} at step {step}: a gradient holds inf or NaN, which "
                    "--clip-grad cannot scale; lower --lr, check the data, or train fp16 with loss scaling")
        elif self._clip is not None:
            coef = torch.clamp(self._clip / (torch.tensor(norm, dtype=torch.float32) + CLIP_EPS), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.device))
        self._outcome = StepOutcome(norm, scale, False)
        return False

    def pending_norm(self) -> torch.Tensor | None:
        """The step's squared global norm (0-dim float64 on the device) when it is still to be read, else None."""
        return self._pending

    def finish(self, step: int, squared: float | None = None) -> StepOutcome:
        """After the step: update the scale (and say so on rank 0 after a skip); the step's outcome.
        squared: the value of pending_norm(), read by the caller (else read here)."""
        out = self._outcome if self._outcome is not None else StepOutcome(None, None, False)
        self._outcome = None
        if self._pending is not None:
            total = float(self._pending) if squared is None else float(squared)
            self._pending = None
            norm = math.sqrt(total) if total >= 0 else total
            if not math.isfinite(norm) and self._clip is not None:
                raise NonFiniteGradientError(
                    f"the global gradient norm is {norm} at step {step}: a gradient holds inf or NaN, which "
                    "--clip-grad cannot scale; lower --lr, check the data, or train fp16 with loss scaling")
            out = StepOutcome(norm, None, False)
        if self._scaler is not None and out.loss_scale is not None:
            self._scaler.update(out.skipped)
            if out.skipped and self._rank == 0:
                self._log(f"meshplan rank 0: step {step}: the gradients overflowed (inf/NaN) at loss scale "
                          f"{out.loss_scale:g}; the step is skipped on every rank, loss scale now "
                          f"{self._scaler.scale:g}")
        return out


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def make_gradient_step(world_group, device, modules: dict, specs: dict, grads, params: list[torch.Tensor],
                       tensor_rank: int, train, rank: int, recording: bool = False) -> GradientStep:
    """This rank's GradientStep for the build's `train` (TrainSpec): clip_grad, loss_scale and grad_norm.
    `recording`: the run records its steps for --verify, which checks the norm (computed then whatever grad_norm).

    Where the step computes the norm, a collective over `world_group` (every rank): the ranks exchange what
    they hold (runtime/execute/grad_norm.py)."""
    from runtime.execute.grad_norm import pieces_of

    norm = GlobalGradNorm.connect(params, pieces_of(modules, specs, grads, tensor_rank), world_group, device) \
        if train.needs_grad_norm or recording else None   # every rank reads the same build and flags: all, or none
    scaler = LossScaler(train.loss_scale) if train.loss_scale is not None else None
    return GradientStep(norm, params, clip=train.clip_grad, scaler=scaler, rank=rank,
                        log=lambda line: print(line, flush=True))


def scaler_state(guard: GradientStep | None) -> dict | None:
    """The loss scaler's state for a checkpoint (None without loss scaling)."""
    return guard.scaler.state_dict() if guard is not None and guard.scaler is not None else None


def outcome_record(results: list) -> dict:
    """Per step grad norm, loss scale and skip flag of a rank's StepResults, for run/rank_XXXX.json
    (JSON: a skipped step's norm is null)."""
    return {"grad_norms": [r.grad_norm if r.grad_norm is not None and math.isfinite(r.grad_norm) else None
                           for r in results], "loss_scales": [r.loss_scale for r in results],
            "skipped": [bool(r.skipped) for r in results]}

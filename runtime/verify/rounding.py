"""How far rounding alone may move what --verify compares (runtime/verify/__init__.py): the tolerances per
dtype, the margin over rounding-level twins, the rounding-level nudge that makes a twin, Adam's per-element
allowance, and the NaN/infinity test every compared value passes first.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from runtime.vocab import DType

# per dtype: loss (relative), gradient (relative / absolute per rms), statistics (relative), trajectory floor,
# and for Adam-family optimizers the trajectory's parameter difference in Adam's own units ("adam_steps":
# the rms difference per element, as a fraction of lr x sqrt(steps); see adam_allowance)
TOLERANCES = {
    DType.FP32: {"loss": 1e-6, "grad_rtol": 1e-4, "grad_atol": 1e-6, "stats": 1e-5, "floor": 1e-4, "adam_steps": 1e-3},
    DType.BF16: {"loss": 2e-2, "grad_rtol": 5e-2, "grad_atol": 1e-3, "stats": 2e-2, "floor": 2e-2, "adam_steps": 2e-2},
    DType.FP16: {"loss": 5e-3, "grad_rtol": 2e-2, "grad_atol": 5e-4, "stats": 5e-3, "floor": 5e-3, "adam_steps": 1e-2},
}

# optimizers whose update is normalized per element (m / (sqrt(v) + eps)): a gradient element that is
# rounding-level itself (a sum that cancels, a unit barely alive) still moves its parameter by up to lr
NORMALIZED_OPTIMIZERS = ("adamw", "adam")
MARGIN = 10.0   # how much further than rounding-level twins a run may stray from the reference
ROUNDING_SAMPLES = 3   # per-step noise: the reference in the run's dtype and 2 rounding-level twins

ADAM_REACH = 2.0   # a rounding-decided Adam update moves its element by up to about lr either way


def adam_sensitive(exact: torch.Tensor, noise: torch.Tensor, fraction: float, eps: float) -> int:
    """Elements of one step's gradient whose Adam update rounding decides: those where the gradient's
    rounding noise (per element) is more than `fraction` of |g| + eps (Adam's update there moves by
    about lr x noise / (|g| + eps))."""
    return int(((exact.abs() + eps) * fraction < noise).sum())


def adam_allowance(optimizer, steps: int, numel: int, fraction: float, sensitive: float = 0.0) -> float:
    """How far (L2 norm over a tensor of `numel` elements) rounding may move a tensor in `steps` steps
    of an Adam-family optimizer; 0 for others (SGD's update is proportional to the gradient: the
    rounding-level twin measures it).

    Adam's update is lr * m / (sqrt(v) + eps) per element, about lr whatever the gradient's size.
    Where an element's gradient is itself at rounding level (a sum that cancels; an attention key
    bias, whose exact gradient is 0), two correct summation orders give it different signs and the
    parameter moves by up to ~lr: `sensitive` counts such (element, step) pairs (adam_sensitive),
    each allowed ADAM_REACH x lr. Every other element may move by `fraction` of lr per step. Steps
    add up as a random walk."""
    if getattr(optimizer, "name", None) not in NORMALIZED_OPTIMIZERS:
        return 0.0
    return optimizer.lr * math.sqrt(fraction ** 2 * max(steps, 1) * max(numel, 1) + ADAM_REACH ** 2 * sensitive)


def non_finite(t: torch.Tensor | float) -> str | None:
    """"NaN" or "inf" when `t` holds one (NaN first), else None."""
    t = torch.as_tensor(t)
    if not t.is_floating_point():
        return None
    if torch.isnan(t).any():
        return "NaN"
    return "inf" if torch.isinf(t).any() else None


def in_float64(t: torch.Tensor) -> torch.Tensor:
    """A floating tensor in float64 (what the checks compare in); others as they are."""
    return t.double() if t.is_floating_point() else t


def l2_norm(t: torch.Tensor) -> float:
    """The L2 norm of `t`, summed in float64 (0 for an empty tensor)."""
    return float(t.double().norm()) if t.numel() else 0.0


# A rounding-level nudge in each dtype: one float32 ulp, or half a 16-bit ulp (relative), since 16-bit
# autocast rounds a smaller nudge of the float32 weights away.
NUDGE = {DType.BF16: 2.0 ** -9, DType.FP16: 2.0 ** -12}


def nudge(model: nn.Module, seed: int = 12345, dtype: str = DType.FP32) -> None:
    """Move every parameter by a rounding-level step of `dtype`, up or down at random (seeded)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            up = torch.rand(p.shape, generator=g) < 0.5
            if dtype in NUDGE:
                p.mul_(torch.where(up, 1 + NUDGE[dtype], 1 - NUDGE[dtype]))
            else:
                away = torch.where(up, torch.full_like(p, math.inf), torch.full_like(p, -math.inf))
                p.copy_(torch.nextafter(p, away))

"""fp16 dynamic loss scaling with torch.amp.GradScaler's semantics, for a run split over many ranks.

fp16 autocast computes activation gradients in float16, whose range ends at 65504 and whose
smallest normal is 6e-5: small gradients underflow to zero. Each micro-batch's backward
therefore starts from loss x scale (StageRunner folds the scale into its 1/(micro-batches x
data ranks) factor); at the optimizer step the gradients are multiplied by 1/scale again
(unscaled). An overflow (an inf or NaN in any gradient on any rank) skips the step on every
rank and halves the scale; `growth_interval` steps in a row without one double it.

`LossScaler` keeps the scale and the growth tracker as GradScaler does (a float32 and an int32
tensor on the CPU) and changes them with the same kernels (torch._amp_update_scale_, and
torch._amp_foreach_non_finite_check_and_unscale_ to unscale), so a run and a reference that
uses torch.amp.GradScaler step for step agree exactly on every scale (tests/unit/test_loss_scale.py).
Whether a step overflowed is not decided here but by the global gradient norm's all-reduce
(runtime/execute/grad_norm.py): every rank sees the same verdict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from runtime.vocab import DType

DEFAULT_INIT_SCALE = 2.0 ** 16
DEFAULT_GROWTH_INTERVAL = 2000


class LossScaleError(ValueError):
    """A loss-scaling setting that cannot work; the message names it."""


@dataclass(frozen=True)
class LossScaleSpec:
    """Dynamic loss scaling (torch.amp.GradScaler's arguments and defaults).

    init_scale: the scale of the first step (a power of two keeps scaling exact);
    growth_factor / backoff_factor: the scale's change after growth_interval clean steps /
    after an overflow; growth_interval: clean steps (optimizer steps) between growths.
    """

    init_scale: float = DEFAULT_INIT_SCALE
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = DEFAULT_GROWTH_INTERVAL

    def __post_init__(self) -> None:
        if not (isinstance(self.init_scale, (int, float)) and 0 < self.init_scale < float("inf")):
            raise LossScaleError(f"loss scale init_scale must be a positive finite number, got {self.init_scale!r}")
        if not self.growth_factor > 1.0:
            raise LossScaleError(f"loss scale growth_factor must be above 1, got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise LossScaleError(f"loss scale backoff_factor must be between 0 and 1, got {self.backoff_factor!r}")
        if not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise LossScaleError(f"loss scale growth_interval must be a positive whole number of steps, got "
                                 f"{self.growth_interval!r}")
        object.__setattr__(self, "init_scale", float(self.init_scale))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LossScaleSpec":
        try:
            return cls(**d)
        except TypeError as e:   # a field this runtime does not know
            raise LossScaleError(f"build.json loss_scale: {e}; known fields: "
                                 f"{[f.name for f in dataclasses.fields(cls)]}") from None

    def grad_scaler(self) -> torch.amp.GradScaler:
        """PyTorch's own scaler with these settings (the single-process reference uses it)."""
        return torch.amp.GradScaler("cpu", init_scale=self.init_scale, growth_factor=self.growth_factor,
                                    backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)


class LossScaler:
    """The scale of one rank (every rank holds the same, and changes it alike).

    `scale` is what this step's backward multiplies the loss by; after the step,
    `update(found_inf)` changes it exactly as GradScaler.update does.
    """

    def __init__(self, spec: LossScaleSpec):
        self.spec = spec
        self._scale = torch.full((), spec.init_scale, dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)

    @property
    def scale(self) -> float:
        return float(self._scale)

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Multiply `grads` in place by 1/scale (GradScaler.unscale_'s kernel and its inv_scale)."""
        if not grads:
            return
        inv = self._scale.double().reciprocal().float()
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, gs in by_device.items():
            found = torch.zeros((), dtype=torch.float32, device=device)   # local; the verdict is global
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv.to(device))

    def update(self, found_inf: bool) -> None:
        """After a step: back off on an overflow, grow after growth_interval clean steps."""
        s = self.spec
        torch._amp_update_scale_(self._scale, self._growth_tracker,
                                 torch.full((), 1.0 if found_inf else 0.0, dtype=torch.float32),
                                 s.growth_factor, s.backoff_factor, s.growth_interval)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (GradScaler.state_dict's two numbers)."""
        return {"scale": self.scale, "growth_tracker": int(self._growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))


def loss_scale_for(dtype: str, init_scale: float | None = None, growth_interval: int | None = None,
                   enabled: bool = True) -> LossScaleSpec | None:
    """The build's loss scaling from `meshplan codegen`'s flags: on by default for fp16, off otherwise.

    Raises LossScaleError for a flag that cannot apply (a scale setting without fp16, or with
    scaling turned off)."""
    given = [f for f, v in (("--loss-scale-init", init_scale), ("--loss-scale-growth-interval", growth_interval))
             if v is not None]
    if dtype != DType.FP16 and (given or not enabled):
        flags = given + ([] if enabled else ["--no-loss-scale"])
        raise LossScaleError(f"{' and '.join(flags)} apply to --dtype fp16 (loss scaling); this build is {dtype}, "
                             "which scales no loss: drop them")
    if dtype != DType.FP16:
        return None
    if not enabled:
        if given:
            raise LossScaleError(f"{' and '.join(given)} set a loss scale, but --no-loss-scale turns it off; "
                                 "give one or the other")
        return None
    return LossScaleSpec(init_scale=DEFAULT_INIT_SCALE if init_scale is None else init_scale,
                         growth_interval=DEFAULT_GROWTH_INTERVAL if growth_interval is None else growth_interval)

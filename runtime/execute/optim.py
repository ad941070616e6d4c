"""Optimizers a build can name: SGD (with momentum) and AdamW, their implementation and weight-decay groups.

`OptimizerSpec` is a small validated value; `build()` makes the torch
optimizer over any list of parameters (whole parameters, or the flat ZeRO
shards of them: both optimizers are elementwise, so a shard steps exactly
as the slice of the whole would).

Implementation (`impl`): torch's three code paths for the same update:
  for-loop  one parameter at a time (foreach=False)
  foreach   the _foreach_* multi-tensor kernels (foreach=True)
  fused     one fused kernel per dtype/device group (fused=True)
  auto      resolved by device (`resolve_impl`): on CUDA fused for AdamW and foreach for SGD (torch's
            own recommendation); on CPU fused for both, which benchmarks/optimizer_impl.py measured
            fastest for a 110M-parameter GPT on this repository's CPU machine (1 thread: AdamW fused
            0.13x the for-loop's step time, foreach 0.86x; SGD-momentum fused 0.30x, foreach 1.9x).
The rank records the resolved implementation (run/rank_XXXX.json "optimizer_impl") and the
single-process reference of --verify builds its optimizer with it (like with like).

Weight-decay groups (`no_decay`): "1d" (default, the usual convention) gives parameters of fewer
than 2 dimensions (biases, norm weights) no weight decay; "none" decays every parameter. The
optimizer gets torch's own param_groups: the decayed parameters first, then the others (weight
decay 0). The class is decided by the logical parameter's dimensions: tensor-parallel slices keep
their dims; a ZeRO flat shard takes the class its gradient bucket records (Bucket.decay: the code
generator never mixes the classes in one bucket when they differ, codegen/strategies/data.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Iterable, Sequence

import torch

from runtime.documents import refuse_unknown_fields

OPTIMIZERS = ("sgd", "adamw")


class OptimizerImpl(StrEnum):
    """Which of torch's optimizer code paths steps the parameters."""

    AUTO = "auto"
    FOR_LOOP = "for-loop"
    FOREACH = "foreach"
    FUSED = "fused"


class NoDecay(StrEnum):
    """Which parameters get no weight decay: "1d" those with fewer than 2 dims, "none" none."""

    ONE_D = "1d"
    NONE = "none"


def _enum(cls, value, what: str):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; known: {', '.join(m.value for m in cls)}") from None


@dataclass(frozen=True)
class OptimizerSpec:
    """name: "sgd" or "adamw"; lr in parameter units per step (the peak: a schedule scales it);
    weight_decay: decoupled (AdamW) or L2 (SGD) coefficient of the decayed group; impl and no_decay:
    see the module docstring."""

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    impl: OptimizerImpl = OptimizerImpl.AUTO
    no_decay: NoDecay = NoDecay.ONE_D

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; known: {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"optimizer lr must be positive, got {self.lr!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optimizer weight_decay must be zero or positive, got {self.weight_decay!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        object.__setattr__(self, "impl", _enum(OptimizerImpl, self.impl, "optimizer implementation"))
        object.__setattr__(self, "no_decay", _enum(NoDecay, self.no_decay, "no_decay rule"))

    # ---- weight-decay classes ------------------------------------------------
    def decays(self, ndim: int) -> bool:
        """Whether a (logical) parameter of `ndim` dimensions is in the weight-decayed group."""
        return self.no_decay is NoDecay.NONE or ndim >= 2

    @property
    def splits_decay(self) -> bool:
        """The two classes step differently (so gradient buckets must not mix them)."""
        return self.weight_decay > 0 and self.no_decay is NoDecay.ONE_D

    # ---- implementation --------------------------------------------------------
    def resolve_impl(self, device: torch.device | str = "cpu") -> OptimizerImpl:
        """The implementation `auto` stands for on `device` (others: themselves)."""
        if self.impl is not OptimizerImpl.AUTO:
            return self.impl
        if torch.device(device).type == "cuda":
            return OptimizerImpl.FUSED if self.name == "adamw" else OptimizerImpl.FOREACH
        return OptimizerImpl.FUSED   # CPU: fastest for both in benchmarks/optimizer_impl.py

    def with_impl(self, impl: OptimizerImpl | str) -> "OptimizerSpec":
        return dataclasses.replace(self, impl=impl)

    def build(self, params: Iterable[torch.nn.Parameter], decays: Sequence[bool] | None = None,
              device: torch.device | str = "cpu") -> torch.optim.Optimizer:
        """The torch optimizer over `params` with the resolved implementation for `device`.

        decays[i]: whether params[i] is weight-decayed (default: by its dims, `decays()`); the
        decayed group comes first, then the others; an empty group is left out.
        """
        params = list(params)
        flags = [self.decays(p.dim()) for p in params] if decays is None else list(decays)
        if len(flags) != len(params):
            raise ValueError(f"{len(params)} parameters but {len(flags)} weight-decay flags")
        groups = [{"params": [p for p, f in zip(params, flags) if f], "weight_decay": self.weight_decay},
                  {"params": [p for p, f in zip(params, flags) if not f], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        impl = self.resolve_impl(device)
        how = {"foreach": impl is OptimizerImpl.FOREACH, "fused": impl is OptimizerImpl.FUSED}
        if self.name == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, **how)
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps, **how)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(d["betas"])
        d["impl"] = self.impl.value
        d["no_decay"] = self.no_decay.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizerSpec":
        refuse_unknown_fields(d, cls, "optimizer", ValueError)
        return cls(**d)


def optimizer_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in its own order (group by group): the order of the indices of
    its state_dict, which checkpoints and --verify's step records name."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def rank_optimizer(spec: OptimizerSpec, params: list, grads, device: torch.device | str) -> torch.optim.Optimizer:
    """A rank's optimizer over `params` (GradSync.optimizer_params, or its stage parameters when it has
    no gradient buckets): whole parameters are grouped by their dims; ZeRO flat shards (grads.shards)
    by the class of their bucket, which must hold one class where the classes differ."""
    if grads is None or not grads.shards:
        return spec.build(params, device=device)
    flags = []
    for st in grads.states:
        if spec.splits_decay and any(spec.decays(p.dim()) != st.bucket.decay for p in st.params):
            raise ValueError(f"gradient bucket {st.index} mixes parameters with and without weight decay, which "
                             "its ZeRO shard cannot step apart; the build predates weight-decay groups: "
                             "generate the build again")
        flags.append(st.bucket.decay)
    return spec.build(params, flags, device=device)

"""Optimizers a build can name: SGD (with momentum) and AdamW.

`OptimizerSpec` is a small validated value; `build()` makes the torch
optimizer over any list of parameters (whole parameters, or the flat ZeRO
shards of them: both optimizers are elementwise, so a shard steps exactly
as the slice of the whole would). The single-tensor (for-loop)
implementation is used everywhere so that the parallel run and the
single-process reference run the same arithmetic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class OptimizerSpec:
    """name: "sgd" or "adamw"; lr in parameter units per step."""

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; known: {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"optimizer lr must be positive, got {self.lr!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                                   foreach=False)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps,
                                 weight_decay=self.weight_decay, foreach=False)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(d["betas"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizerSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown optimizer field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

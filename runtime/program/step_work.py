"""`StepWork`: what one optimizer step computes, so that a step's seconds become rates (runtime/metrics.py).

Codegen records it in the build (TrainSpec.work, from the plan and the captured graph:
codegen/throughput.py); the ranks only divide by the step's seconds, nothing is counted at run time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step computes, recorded by codegen from the plan (TrainSpec.work), so that a
    step's seconds become rates without counting anything at run time.

    Attributes:
        flops: model FLOPs of one optimizer step over the whole global batch: the captured graph's
            forward + backward FLOPs per sample x global batch size. Recomputed forwards are not
            counted (MFU, not hardware FLOPs utilisation); the loss is not part of the graph.
        peak_flops: FLOP/s: the sum over the build's ranks of the device's peak for the build's dtype,
            from the cluster the plan was priced on; None when that cluster gives no peak for it.
        tokens_per_sample: the positions per sample the loss averages over: the model output's
            elements per sample divided by its last (class or feature) dimension. T for a token
            model's (B, T, vocabulary) logits, 1 for a classifier's (B, classes) or a regression's
            (B, features); an image-shaped output (B, C, H, W) counts C x H.
    """

    flops: float
    peak_flops: float | None
    tokens_per_sample: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepWork":
        peak = d.get("peak_flops")
        return cls(float(d["flops"]), None if peak is None else float(peak), int(d["tokens_per_sample"]))

"""The single-process reference a parallel run must equal, and the comparison.

The reference builds the whole model exactly as the build's `init` says,
reads the same global batches (same data factory, same seeds), walks each
batch in the same micro-batch chunks the data ranks use (so that BatchNorm
sees the same samples together; for models without batch-coupled layers
the chunking changes nothing but rounding), scales each chunk's mean loss
by 1/chunks, and takes one optimizer step per global batch.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from runtime.data import DataSource, call_model
from runtime.losses import compute_loss
from runtime.materialize import build_model, load_factory
from runtime.spec import StageSpec, TrainSpec
from runtime.tensor_parallel import FeatureSplit


@dataclass
class ReferenceRun:
    losses: list[float]              # mean loss over the global batch, per step
    params: dict[str, torch.Tensor]  # final parameters by name


def reference_run(spec: TrainSpec, steps: int, micro_batch_size: int | None = None) -> ReferenceRun:
    """Train the whole model in this process for `steps` steps."""
    model = build_model(spec)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = spec.optimizer.build(params)
    data = DataSource(load_factory(spec.data_ref, spec.root, "data factory"), dict(spec.data_kwargs),
                      spec.global_batch_size, micro_batch_size or spec.global_batch_size, 0, 1, spec.data_seed,
                      name=f"data factory {spec.data_ref}")
    cast = contextlib.nullcontext() if spec.dtype == "fp32" else \
        torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype])
    losses = []
    for step in range(steps):
        for p in params:
            p.grad = None
        chunks = data.micro_batches(step)
        total = 0.0
        for inputs, targets in chunks:
            with cast:
                loss = compute_loss(spec.loss, call_model(model, inputs), targets)
            (loss / len(chunks)).backward()
            total += float(loss.detach()) / len(chunks)
        opt.step()
        losses.append(total)
    return ReferenceRun(losses, {k: v.detach().clone() for k, v in model.named_parameters()})


def local_slice(full: torch.Tensor, split: tuple[int, FeatureSplit] | None, rank: int, num: int) -> torch.Tensor:
    """The part of a whole tensor that tensor rank `rank` of `num` holds: its slice along the
    split dimension, padded as the runtime pads it (StageSpec.split_of gives `split`)."""
    if split is None or num == 1 or full.dim() == 0:
        return full
    dim, fs = split
    return fs.take(full, dim, rank, num)


@dataclass
class Comparison:
    """Largest differences between a parallel run and the reference."""

    max_loss_diff: float
    max_loss_rel: float
    max_param_diff: float
    max_param_rel: float
    worst_param: str
    params_compared: int
    ok: bool

    def summary(self) -> str:
        return (f"loss: max |diff| {self.max_loss_diff:.3g} (relative {self.max_loss_rel:.3g}); "
                f"parameters: {self.params_compared} compared, max |diff| {self.max_param_diff:.3g} "
                f"(relative {self.max_param_rel:.3g}, worst {self.worst_param or '-'}): "
                + ("OK" if self.ok else "MISMATCH"))


def compare(ref: ReferenceRun, rank_losses: dict[int, list[float]],
            rank_params: dict[int, dict[int, dict[str, torch.Tensor]]], stage_specs: dict[int, StageSpec],
            tensor_coord: dict[int, int], tensor_size: int, rtol: float = 1e-4, atol: float = 1e-6) -> Comparison:
    """Compare every rank's losses and every parameter it holds with the reference.

    A value passes when |a - b| <= atol + rtol |b| (fp32 runs differ from the reference by
    summation order only).
    """
    ok = True
    lmax = lrel = 0.0
    for r, losses in rank_losses.items():
        if len(losses) != len(ref.losses):
            ok = False
            continue
        for a, b in zip(losses, ref.losses):
            d = abs(a - b)
            lmax, lrel = max(lmax, d), max(lrel, d / max(abs(b), 1e-12))
            ok &= math.isfinite(a) and d <= atol + rtol * abs(b)
    pmax = prel = 0.0
    worst = ""
    n = 0
    for r, stages in rank_params.items():
        for s, params in stages.items():
            spec = stage_specs[s]
            for local_name, value in params.items():
                name = spec.canonical(local_name)   # a tied weight: the model's first name
                if name not in ref.params:
                    ok = False
                    worst = f"{name} (not in the model)"
                    continue
                want = local_slice(ref.params[name], spec.split_of(local_name, value.dim()), tensor_coord[r],
                                   tensor_size)
                if tuple(want.shape) != tuple(value.shape):
                    ok, worst = False, f"{name} (shape {tuple(value.shape)} vs {tuple(want.shape)})"
                    continue
                diff = (value.double() - want.double()).abs()
                d = float(diff.max()) if diff.numel() else 0.0
                rel = float((diff / want.double().abs().clamp_min(atol)).max()) if diff.numel() else 0.0
                n += 1
                if d > pmax:
                    pmax, worst = d, f"{name} on rank {r}"
                prel = max(prel, rel)
                ok &= bool(torch.all(diff <= atol + rtol * want.double().abs()))
    return Comparison(lmax, lrel, pmax, prel, worst, n, ok)

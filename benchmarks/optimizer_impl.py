"""Optimizer step time by implementation: for-loop vs foreach vs fused (torch's three code paths).

A ~100M-parameter GPT (examples/models/gpt.py: hidden 768, 12 layers, 12 heads, vocabulary
16384, sequence 128: 110.3M parameters; parameters only, no forward) gets random gradients; for
SGD with momentum and for AdamW, one optimizer per implementation steps the same parameters,
in rounds that alternate which implementation goes first, so that the machine's drifting load
hits all alike. Each implementation's own optimizer state is kept (so every timed step after the
warm-up is a steady-state step). Prints each median (seconds per step) and the ratios to the
for-loop one. Runs with the threads a rank has (--threads, default 1 as under `meshplan run`).
Its result picks OptimizerSpec's `auto` implementation on CPU (runtime/execute/optim.py).

    PYTHONPATH=. python benchmarks/optimizer_impl.py [--rounds 7] [--threads 1] [--device cpu]

Figures on this repository's machine (2 CPU cores shared with other jobs, torch 2.13.0+cpu,
1 thread, 7 rounds, 110.3M parameters; 2026-11-24), median seconds per step:
    sgd-momentum  for-loop 0.315 s   foreach 0.610 s (1.94x)   fused 0.094 s (0.30x)
    adamw         for-loop 1.229 s   foreach 1.053 s (0.86x)   fused 0.162 s (0.13x)
so `auto` on CPU is fused for both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runtime.execute.optim import OptimizerImpl, OptimizerSpec  # noqa: E402

GPT_100M = dict(vocab_size=16384, seq_len=128, hidden=768, num_layers=12, num_heads=12)
IMPLS = (OptimizerImpl.FOR_LOOP, OptimizerImpl.FOREACH, OptimizerImpl.FUSED)
SPECS = {"sgd-momentum": OptimizerSpec("sgd", lr=1e-3, momentum=0.9, weight_decay=0.1),
         "adamw": OptimizerSpec("adamw", lr=1e-3, weight_decay=0.1)}


def gpt_params(device: str) -> list[torch.nn.Parameter]:
    """The GPT's parameters (random values and random gradients), built on meta then materialized."""
    from examples.models.gpt import build

    with torch.device("meta"):
        model = build(**GPT_100M)
    out = []
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        q = torch.nn.Parameter(torch.randn(p.shape, generator=g).to(device) * 0.02)
        q.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
        out.append(q)
    return out


def time_step(opt: torch.optim.Optimizer, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(params, spec: OptimizerSpec, rounds: int, device: str) -> dict[OptimizerImpl, list[float]]:
    opts = {}
    for impl in IMPLS:
        try:
            opts[impl] = spec.with_impl(impl).build(params, device=device)
            opts[impl].step()    # warm-up: creates the state
        except RuntimeError as e:  # an implementation this torch lacks on this device
            print(f"  {impl.value}: not available here ({str(e).splitlines()[0]})")
            opts.pop(impl, None)
    times: dict[OptimizerImpl, list[float]] = {impl: [] for impl in opts}
    order = list(opts)
    for r in range(rounds):
        for impl in order[r % len(order):] + order[:r % len(order)]:   # rotate who goes first
            times[impl].append(time_step(opts[impl], device))
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = gpt_params(args.device)
    n = sum(p.numel() for p in params)
    print(f"GPT {GPT_100M}: {n / 1e6:.1f}M parameters on {args.device}, {args.threads} thread(s), "
          f"{args.rounds} rounds, torch {torch.__version__}")
    for label, spec in SPECS.items():
        times = measure(params, spec, args.rounds, args.device)
        med = {impl: statistics.median(ts) for impl, ts in times.items()}
        base = med.get(OptimizerImpl.FOR_LOOP)
        line = "   ".join(f"{impl.value} {m:.3f} s" + (f" ({m / base:.2f}x)" if base and impl is not
                                                         OptimizerImpl.FOR_LOOP else "")
                          for impl, m in med.items())
        print(f"{label:13s} {line}")
        print(f"{'':13s} fastest: {min(med, key=med.get).value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Chunked and compiled cross-entropy against F.cross_entropy over the whole fp32 logits: time and peak
memory of one forward + backward.

The output layer of a GPT: hidden (tokens, C) -> logits (tokens, V) -> mean cross-entropy, with
gradients for hidden and the (fp32) weight. "full" is what a training loop writes:
F.cross_entropy((hidden @ weight.T).float(), targets), the logits materialized (upcast to fp32);
"compiled" the same loss over the same logits through torch.compile (runtime.losses.compiled_loss,
inductor; compiled in the warm-up, outside the timed rounds); "chunked" is runtime.execute.chunked_loss.chunked_cross_entropy(hidden, weight, targets) (chunk_tokens 0:
the default rule). In fp32 and under torch.autocast(bfloat16) (fp32 master weight, cast in the call).

Time: rounds rotate which variant goes first (the machine's load drifts); the median seconds of
each, and chunked / full. Peak memory: each variant runs once in a fresh child process; on CPU the
peak is the process's resident high-water mark (VmHWM, reset after the inputs were built) minus its
resident size then (so the inputs are excluded; the gradients made by backward are included, alike in both);
on CUDA torch.cuda.max_memory_allocated minus the allocated bytes before the call. The compiled
variant compiles again at the measured shape inside that call (static shapes): on CPU its peak includes
the compiler's own memory, tens of MiB (on CUDA that is host memory, not counted).

    PYTHONPATH=. python benchmarks/chunked_loss.py [--tokens 2048] [--vocab 50304] [--hidden 768]
        [--rounds 3] [--threads 1] [--device cpu] [--dtypes fp32,bf16]

Figures: see the report of the branch that added this file (h30loss), and the closing note of issue 30.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runtime.execute.chunked_loss import auto_chunk_tokens, chunked_cross_entropy  # noqa: E402
from runtime.losses import compiled_loss  # noqa: E402

VARIANTS = ("full", "compiled", "chunked")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def inputs(tokens: int, vocab: int, hidden: int, device: str):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return h, w, t


@functools.lru_cache(maxsize=None)
def _compiled():
    return compiled_loss("cross_entropy", "inductor")


def step(variant: str, h, w, t, autocast) -> float:
    """One forward + backward; the loss value."""
    h.grad = w.grad = None
    with torch.autocast(h.device.type, autocast or torch.float32, enabled=autocast is not None):
        if variant == "full":
            loss = F.cross_entropy((h @ w.T).float(), t)
        elif variant == "compiled":
            loss = _compiled()(h @ w.T, t)
        else:
            loss = chunked_cross_entropy(h, w, t)
    loss.backward()
    return loss.item()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(variant, h, w, t, autocast, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    step(variant, h, w, t, autocast)
    _sync(device)
    return time.perf_counter() - t0


def _status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (resident high-water mark) of this process, from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_child(variant: str, dtype: str, tokens: int, vocab: int, hidden: int, device: str) -> dict:
    """In a fresh process: the peak bytes of one forward + backward above the inputs (after a tiny
    warm-up of the same variant, so that the libraries' own first-call allocations are not counted)."""
    step(variant, *inputs(16, 64, 8, device), DTYPES[dtype])
    h, w, t = inputs(tokens, vocab, hidden, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step(variant, h, w, t, DTYPES[dtype])
        return {"peak": torch.cuda.max_memory_allocated() - base, "loss": loss}
    # the high-water mark restarts here (Linux >= 4.0: "5" to clear_refs); ru_maxrss would not do,
    # it keeps the parent's resident size across fork and exec
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS")
    loss = step(variant, h, w, t, DTYPES[dtype])
    return {"peak": _status_bytes("VmHWM") - base, "loss": loss}


def peak(variant: str, dtype: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--dtypes", dtype, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--device", args.device,
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    if args.child:
        print(json.dumps(peak_child(args.child, dtypes[0], args.tokens, args.vocab, args.hidden, args.device)))
        return 0
    n, v, c = args.tokens, args.vocab, args.hidden
    print(f"tokens {n} x vocabulary {v} x C {c} on {args.device}, {args.threads} thread(s), {args.rounds} rounds, "
          f"torch {torch.__version__}; chunk {auto_chunk_tokens(n, v)} tokens; full fp32 logits "
          f"{n * v * 4 / 2**20:.0f} MiB; one GEMM 2NVC = {2 * n * v * c / 1e9:.1f} GFLOP")
    h, w, t = inputs(n, v, c, args.device)
    for dtype in dtypes:
        autocast = DTYPES[dtype]
        losses = {k: step(k, h, w, t, autocast) for k in VARIANTS}   # warm-up
        times: dict[str, list[float]] = {k: [] for k in VARIANTS}
        for r in range(args.rounds):
            for k in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                times[k].append(timed(k, h, w, t, autocast, args.device))
        med = {k: statistics.median(ts) for k, ts in times.items()}
        peaks = {k: peak(k, dtype, args) for k in VARIANTS}
        print(f"{dtype}: loss " + " ".join(f"{k} {losses[k]:.6f}" for k in VARIANTS))
        for k in VARIANTS:
            print(f"  {k:8s} median {med[k]:.3f} s  (rounds: {', '.join(f'{x:.3f}' for x in times[k])})  "
                  f"peak {peaks[k]['peak'] / 2**20:.0f} MiB")
        for k in VARIANTS[1:]:
            print(f"  {k} / full: time {med[k] / med['full']:.2f}x, peak {peaks[k]['peak'] / peaks['full']['peak']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

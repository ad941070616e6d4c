"""Per-op-kind compute calibration: time the op kinds the cost model prices, in this process.

For each kind (linear, conv, elementwise, norm, embedding, attention, view)
a chain of K identical ops is timed forward and backward, with autograd on,
as the runtime's stage modules run them (one thread, like one rank process
under OMP_NUM_THREADS=1). Timing chains of 1 and of 1 + CHAIN ops, interleaved
and taking medians, and differencing them gives the cost of one op without
the per-call cost of the autograd engine (which a real backward pays once,
not per op):

    per_op = (t(1 + CHAIN) - t(1)) / CHAIN        # seconds per op, forward and backward

At the small size the roofline part is negligible, so per_op is the kind's
fixed overhead (Efficiency.kind_overheads). At a medium size the time left
after that overhead gives the achieved fraction of the measured peak:
GEMMs for eff.matmul, convolutions for eff.conv, a streaming add for
eff.memory (cost_models/compute.py's roofline).

All times are seconds; FLOPs and bytes follow planner/graph/ops.py's definitions
(a GEMM is 2 M K N FLOPs; an elementwise op reads and writes its tensors once).
Nothing runs at import time.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.execute.optim import OptimizerSpec
from runtime.vocab import OpKind

CHAIN = 8
KINDS = (OpKind.LINEAR, OpKind.CONV, OpKind.ELEMENTWISE, OpKind.NORM, OpKind.EMBEDDING, OpKind.ATTENTION, OpKind.VIEW)


@dataclass(frozen=True)
class OpTiming:
    """Median seconds per op of one kind at one size, forward and backward (chain-differenced)."""

    kind: OpKind
    size: str          # "small" or "medium"
    forward: float
    backward: float
    flops: float       # forward FLOPs of one op
    nbytes: float      # forward bytes of one op (read + written)


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside the block (one rank process under OMP_NUM_THREADS=1), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _median_times(build: Callable[[int], tuple], reps: int, budget_s: float) -> tuple[float, float, float, float]:
    """(fwd 1, bwd 1, fwd 1+CHAIN, bwd 1+CHAIN) median seconds, the two chains interleaved.

    build(k) returns (run_forward, make_grad): run_forward() -> output of k chained ops.
    """
    fns = {k: build(k) for k in (1, 1 + CHAIN)}
    out: dict[int, tuple[list[float], list[float]]] = {k: ([], []) for k in fns}
    deadline = time.perf_counter() + budget_s
    for rep in range(reps + 2):
        for k, (fwd, grad_of) in fns.items():
            t0 = time.perf_counter()
            y = fwd()
            t1 = time.perf_counter()
            torch.autograd.backward(y, grad_of(y))
            t2 = time.perf_counter()
            if rep >= 2:  # two warm-up rounds: allocator, kernel selection, lazy init
                out[k][0].append(t1 - t0)
                out[k][1].append(t2 - t1)
        if rep >= 4 and time.perf_counter() > deadline:
            break
    med = {k: (statistics.median(f), statistics.median(b)) for k, (f, b) in out.items()}
    return (*med[1], *med[1 + CHAIN])


def _chain(make_op: Callable[[], Callable], make_input: Callable[[], "object"]) -> Callable[[int], tuple]:
    """build(k) for a shape-preserving op: k ops made by make_op applied in sequence."""
    def build(k: int):
        ops = [make_op() for _ in range(k)]
        x = make_input()

        def fwd():
            y = x
            for op in ops:
                y = op(y)
            return y
        return fwd, lambda y: torch.ones_like(y)
    return build


def _cases(size: str) -> dict[str, tuple[Callable[[int], tuple], float, float]]:
    """kind -> (build, forward FLOPs of one op, forward bytes of one op) at `size`."""
    small = size == "small"
    tokens, hidden = (32, 32) if small else (512, 256)
    heads, seq = 4, (16 if small else 128)
    f4 = 4  # bytes per fp32 element
    cases = {}

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    cases[OpKind.LINEAR] = (_chain(lambda: torch.nn.Linear(hidden, hidden), lambda: leaf(tokens, hidden)),
                       2.0 * tokens * hidden * hidden, f4 * (2 * tokens * hidden + hidden * hidden + hidden))
    c, hw, b = (4, 8, 2) if small else (32, 32, 4)
    cases[OpKind.CONV] = (_chain(lambda: torch.nn.Conv2d(c, c, 3, padding=1), lambda: leaf(b, c, hw, hw)),
                     2.0 * b * c * hw * hw * c * 9, f4 * (2 * b * c * hw * hw + c * c * 9 + c))
    if small:  # the fixed cost: a mix of the kind's ops
        n_el = tokens * hidden
        elementwise = itertools.cycle([F.gelu, F.relu, lambda t: t + t])
        cases[OpKind.ELEMENTWISE] = (_chain(lambda: next(elementwise), lambda: leaf(n_el)), float(n_el),
                                     f4 * 2.0 * n_el)
    else:  # the streaming rate: t + c reads two tensors and writes one, far bigger than the caches
        n_el = 1 << 21
        addend = torch.randn(n_el)
        cases[OpKind.ELEMENTWISE] = (_chain(lambda: (lambda t: t + addend), lambda: leaf(n_el)), float(n_el),
                                     f4 * 3.0 * n_el)
    cases[OpKind.NORM] = (_chain(lambda: torch.nn.LayerNorm(hidden), lambda: leaf(tokens, hidden)),
                     5.0 * tokens * hidden, f4 * 2.0 * tokens * hidden)
    dim = hidden // heads
    bsz = max(tokens // seq, 1)
    cases[OpKind.ATTENTION] = (
        _chain(lambda: (lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True)),
               lambda: leaf(bsz, heads, seq, dim)),
        4.0 * bsz * heads * seq * seq * dim, f4 * 4.0 * bsz * heads * seq * dim)
    cases[OpKind.VIEW] = (_chain(lambda: (lambda t: t.transpose(0, 1)), lambda: leaf(tokens, hidden)), 0.0, 0.0)

    def embedding(k: int):
        # Not chainable (integer input): k tables looked up with the same indices, summed.
        tables = [torch.nn.Embedding(128, hidden) for _ in range(k)]
        idx = torch.randint(0, 128, (tokens,))

        def fwd():
            return [t(idx) for t in tables]
        return fwd, lambda ys: [torch.ones_like(y) for y in ys]
    cases[OpKind.EMBEDDING] = (embedding, 0.0, f4 * 2.0 * tokens * hidden)
    return cases


# A transformer-like layer: kinds alternate, as they do in a model. (B, T, C) in, (B, T, C) out.
BLOCK = (OpKind.NORM, OpKind.LINEAR, OpKind.ELEMENTWISE, OpKind.LINEAR, OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.VIEW,
         OpKind.NORM, OpKind.ELEMENTWISE)


def _block_case(size: str = "small") -> tuple[Callable[[int], tuple], tuple[str, ...]]:
    """build(k) for k blocks of BLOCK's kinds in sequence (small size), and the kinds of one block."""
    batch, seq, hidden = 2, 16, 32

    def make_block():
        ln1, fc1, fc2, ln2 = (torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, hidden),
                              torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden))

        def block(x):
            y = fc2(F.gelu(fc1(ln1(x))))
            y = (y + x).transpose(1, 2).transpose(1, 2)
            return F.relu(ln2(y))
        return block
    return _chain(make_block, lambda: torch.randn(batch, seq, hidden, requires_grad=True)), BLOCK


def time_block(*, quick: bool = True) -> tuple[float, float, float, float]:
    """(forward, backward) seconds of one BLOCK in a chain, and (forward, backward) seconds of the
    fixed cost of one call (the chain of one block minus one block: entering the module, starting
    the autograd engine), measured on one thread."""
    with one_thread():
        build, _ = _block_case()
        f1, b1, fk, bk = _median_times(build, 15 if quick else 60, 0.3 if quick else 1.2)
    per_f, per_b = max((fk - f1) / CHAIN, 0.0), max((bk - b1) / CHAIN, 0.0)
    return per_f, per_b, max(f1 - per_f, 0.0), max(b1 - per_b, 0.0)


def time_op_kinds(*, quick: bool = True, progress: Callable[[str], None] | None = None) -> list[OpTiming]:
    """Time every kind of KINDS at the small size (and linear, conv, elementwise at the medium size).

    Runs on one thread (restored afterwards). quick: fewer repeats; otherwise about four
    times as many.
    """
    reps, budget = (15, 0.25) if quick else (60, 1.0)
    out: list[OpTiming] = []
    with one_thread():
        for size, kinds in (("small", KINDS), ("medium", (OpKind.LINEAR, OpKind.CONV, OpKind.ELEMENTWISE))):
            cases = _cases(size)
            for kind in kinds:
                build, flops, nbytes = cases[kind]
                f1, b1, fk, bk = _median_times(build, reps if size == "small" else max(reps // 3, 5), budget)
                fwd = max((fk - f1) / CHAIN, 0.0)
                bwd = max((bk - b1) / CHAIN, 0.0)
                out.append(OpTiming(kind, size, fwd, bwd, flops, nbytes))
                if progress:
                    progress(f"  {kind:11s} {size:6s} forward {fwd * 1e6:8.1f} us  backward {bwd * 1e6:8.1f} us")
    return out


@dataclass(frozen=True)
class ComputeFit:
    """Fitted compute constants (see cost_models.compute.Efficiency).

    mix_forward / mix_backward: how much slower an op is inside a layer whose kinds
    alternate than in a chain of its own kind (instruction caches and branch
    predictors are cold for each op), measured on BLOCK; the kind overheads include it.
    call_forward / call_backward: seconds of fixed cost per stage forward / backward call.
    """

    matmul: float
    conv: float
    memory: float
    kernel_overhead: float                                   # s, kinds without a measurement
    kind_overheads: tuple[tuple[str, float, float], ...]     # (kind, forward s, backward s)
    mix_forward: float = 1.0
    mix_backward: float = 1.0
    call_forward: float = 0.0
    call_backward: float = 0.0


def fit_compute(timings: list[OpTiming], peak_flops: float, memory_bandwidth: float,
                block: tuple[float, float, float, float] | None = None) -> ComputeFit:
    """Efficiencies and overheads from time_op_kinds' timings on a device of `peak_flops` FLOP/s
    (fp32, measured) and `memory_bandwidth` B/s (measured), and time_block's figures (optional).
    Efficiencies are clamped to (0.01, 1]; the mix factors to [1, 4]."""
    small = {t.kind: t for t in timings if t.size == "small"}
    medium = {t.kind: t for t in timings if t.size == "medium"}
    missing = [k for k in KINDS if k not in small]
    if missing:
        raise ValueError(f"fit_compute needs a small-size timing of every kind; missing {missing}")

    def roofline(t: OpTiming, eff_flops: float = 1.0, eff_mem: float = 1.0) -> float:
        return max(t.flops / (peak_flops * eff_flops), t.nbytes / (memory_bandwidth * eff_mem))

    # Overheads: what is left of a small op after its (tiny) roofline time.
    alone = {k: (max(t.forward - roofline(t), 0.0), max(t.backward - 2 * roofline(t), 0.0))
             for k, t in small.items()}
    over = {k: f for k, (f, _) in alone.items()}
    mix_f = mix_b = 1.0
    call_f = call_b = 0.0
    if block is not None:
        per_f, per_b, call_f, call_b = block
        mix_f = min(max(per_f / max(sum(alone[k][0] for k in BLOCK), 1e-12), 1.0), 4.0)
        mix_b = min(max(per_b / max(sum(alone[k][1] for k in BLOCK), 1e-12), 1.0), 4.0)
    overheads = tuple(sorted((k, f * mix_f, b * mix_b) for k, (f, b) in alone.items()))

    def eff(kind: OpKind, flops_side: bool) -> float:
        t = medium.get(kind)
        if t is None:
            return 1.0
        left = max(t.forward - over[kind], 1e-12)
        ideal = t.flops / peak_flops if flops_side else t.nbytes / memory_bandwidth
        return min(max(ideal / left, 0.01), 1.0)

    return ComputeFit(matmul=eff(OpKind.LINEAR, True), conv=eff(OpKind.CONV, True),
                      memory=eff(OpKind.ELEMENTWISE, False), kernel_overhead=over[OpKind.ELEMENTWISE] * mix_f,
                      kind_overheads=overheads, mix_forward=mix_f, mix_backward=mix_b,
                      call_forward=call_f, call_backward=call_b)


OPTIMIZER_KINDS = ("sgd", "sgd_momentum", "adamw")


def time_optimizer_steps(*, tensors: int = 48, few: int = 4, numel: int = 16,
                         steps: int = 20) -> dict[str, tuple[float, float]]:
    """{optimizer kind: (seconds of fixed cost per step, seconds per parameter tensor)}, for the
X

    Timed on `few` and on `tensors` tiny tensors, so that the fixed costs (the step call
    itself; per tensor a Python loop and a dozen small ops) dominate: the mean of `steps`
    steps after three warm-up steps for each count; the line through the two gives both.
    The planner prices a step by the bytes it moves, which on small models misses most of it.
    """
    def mean_step(kind: str, count: int) -> float:
        params = [torch.nn.Parameter(torch.ones(numel)) for _ in range(count)]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        spec = OptimizerSpec(name="adamw" if kind == "adamw" else "sgd", lr=1e-3,
                             **({"momentum": 0.9} if kind == "sgd_momentum" else {}))
        opt = spec.build(params)
        for _ in range(3):
            opt.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        return (time.perf_counter() - t0) / steps

    out = {}
    for kind in OPTIMIZER_KINDS:
        small, large = mean_step(kind, few), mean_step(kind, tensors)
        # a noisy pair can tilt the line below zero; half the mean per tensor is a floor
        per_tensor = max((large - small) / (tensors - few), large / tensors / 2)
        out[kind] = (max(small - few * per_tensor, 0.0), per_tensor)
    return out

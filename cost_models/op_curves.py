"""Calibrated op curves: measured seconds per op of one target family over a ladder of sizes.

One constant per op kind (cost_models/compute.py's roofline with a per-kind
overhead) cannot follow a CPU: a GEMM of 128 x 128 x 384 reaches a third of
the rate of a 512 x 256 x 256 one, GELU costs ~2.5 ns per element (it
evaluates erf) where ReLU and add cost a memory pass, and LayerNorm's
backward is several passes. So calibration times each family of ops the
models use, forward and backward with autograd on, at a ladder of sizes, and
the cost model reads a node's time off its family's curve at the node's
per-rank size (piecewise linear in log(size) and log(time)):

    family         size unit                 built as
    linear         forward FLOPs (2 M K N)   nn.Linear(K, N) then nn.Linear(N, K), in pairs
    linear_thin    weight elements (K N)     the same with M = 2 rows: a few rows read the whole
                                             weight, so there the weight's size sets the time
                                             (a linear costs the larger of the two curves)
    attention      forward FLOPs (4 B H T^2 D)  causal scaled_dot_product_attention
    layer_norm     elements                  nn.LayerNorm(256)
    gelu, relu     elements                  F.gelu, F.relu
    add            elements                  t + c (c a constant of the same shape)
    embedding      output elements           nn.Embedding(512, 128) lookups
    softmax        elements                  softmax over rows of 64
    identity       (any)                     nn.Dropout(p=0): returns its input, costs the call

Each point is chain-differenced like calibration.ops (chains of 1 and 1 + k ops,
interleaved, medians), so it holds one op's time without the per-call cost of
entering autograd. Below the smallest size the smallest point's time applies
(a fixed cost); above the largest, time grows in proportion to size (the rate
has saturated). Sizes beyond a CPU's ladder belong to planning for other
hardware, where the cluster is not calibrated and the roofline applies.

Stored in a Cluster's measurements as raw.curve.<family>.<size>.forward /
.backward (seconds), read by cost_models/calibrated.py. Nothing runs at import time.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable

# Ladders: (family, size parameters) -> built per point. Kept small enough that a quick
# calibration times every point in a few seconds on one core (largest op ~3 ms).
LINEAR_SHAPES = ((8, 32, 32), (32, 64, 64), (64, 128, 128), (128, 128, 384), (128, 256, 512),
                 (256, 256, 512), (512, 512, 512))
THIN_SHAPES = ((64, 64), (128, 256), (256, 256), (256, 768), (512, 1024))   # (K, N) at M = THIN_ROWS
THIN_ROWS = 2
ATTENTION_SEQ = (16, 32, 64, 128, 256)      # (B*H = 8, T, D = 32)
NUMEL_LADDER = (1 << 8, 1 << 11, 1 << 14, 1 << 17, 1 << 20)
# Families whose chained op is a pair of ops (timed per op: half the pair).
PAIRED = ("linear", "linear_thin")
FAMILIES = ("linear", "linear_thin", "attention", "layer_norm", "gelu", "relu", "add", "embedding", "softmax",
            "identity")

_ELEMENTWISE_TARGETS = {
    "gelu": "gelu", "GELU": "gelu",
    "relu": "relu", "ReLU": "relu", "relu_": "relu",
    "add": "add", "iadd": "add", "sub": "add", "mul": "add", "truediv": "add", "div": "add", "radd": "add",
}


def node_family(kind: str, target: str, attrs: dict) -> str | None:
    """The curve family that prices a node of `kind` with this target, or None (priced by the roofline)."""
    base = target.rsplit(".", 1)[-1]
    if kind == "linear":
        return "linear"
    if kind == "attention" and "scaled_dot_product" in base:
        return "attention"
    if kind == "norm" and base in ("LayerNorm", "layer_norm", "native_layer_norm"):
        return "layer_norm"
    if kind == "embedding" and base in ("Embedding", "embedding"):
        return "embedding"
    if kind == "softmax" and base in ("softmax", "Softmax", "_softmax"):
        return "softmax"
    if base in ("Dropout", "dropout") and not (attrs.get("p") or attrs.get("dropout_p")):
        return "identity"  # p = 0: torch returns the input itself
    if kind == "elementwise":
        return _ELEMENTWISE_TARGETS.get(base)
    return None


def uses_flops(family: str) -> bool:
    """Whether the family's size is forward FLOPs (else elements of the output)."""
    return family in ("linear", "attention")


def curve_time(points: tuple[tuple[float, float], ...], size: float) -> float:
    """Seconds at `size` on a curve of (size, seconds) points sorted by size (see the module docstring)."""
    if not points:
        raise ValueError("curve_time needs at least one measured point")
    sizes = [s for s, _ in points]
    if size <= sizes[0] or len(points) == 1:  # a fixed cost (one point: a size-independent family)
        return points[0][1]
    if size >= sizes[-1]:
        return points[-1][1] * size / sizes[-1]
    i = bisect.bisect_right(sizes, size)
    (s0, t0), (s1, t1) = points[i - 1], points[i]
    if t0 <= 0 or t1 <= 0:
        return t0 + (t1 - t0) * (size - s0) / (s1 - s0)
    w = math.log(size / s0) / math.log(s1 / s0)
    return math.exp(math.log(t0) + w * math.log(t1 / t0))


def node_curve_times(node, curves: dict, mix: tuple[float, float], share: float,
                     weights: float = 0.0) -> tuple[float, float] | None:
    """(forward s, backward s) of a captured node (planner.graph.OpInfo: kind, target, attrs,
    fwd_flops, output_meta) read off `curves` (cost_models.calibrated.op_curves) at its per-rank
    size, `share` of the captured node's work (micro-batch over captured batch, over the tensor
    split), times the in-layer factors `mix`; None when no curve prices it. `weights`: the
    parameter elements one rank holds of a linear node (read off linear_thin, when measured)."""
    family = node_family(node.kind, node.target, dict(node.attrs)) if curves else None
    pts = curves.get(family) if family else None
    if pts is None:
        return None
    size = (node.fwd_flops if uses_flops(family) else sum(m.numel for m in node.output_meta)) * share
    f, b = curve_time(pts[0], size), curve_time(pts[1], size)
    thin = curves.get("linear_thin") if family == "linear" and weights > 0 else None
    if thin is not None:  # few rows: reading the weight, not the FLOPs, sets the time
        f, b = max(f, curve_time(thin[0], weights)), max(b, curve_time(thin[1], weights))
    return f * mix[0], b * mix[1]


def _cases() -> list[tuple[str, float, Callable[[int], tuple]]]:
    """(family, size, build) for every ladder point; build(k) as calibration.ops._median_times wants."""
    import torch
    import torch.nn.functional as F

    from cost_models.calibration.ops import _chain

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    def pair(k: int, n: int):
        # one chained "op" is a pair, (K -> N) then (N -> K), so that the chain keeps its shape:
        # time_op_curves halves its time (PAIRED)
        def make():
            a, b = torch.nn.Linear(k, n), torch.nn.Linear(n, k)
            return lambda t: b(a(t))
        return make

    out = []
    for m, k, n in LINEAR_SHAPES:
        out.append(("linear", 2.0 * m * k * n, _chain(pair(k, n), lambda m=m, k=k: leaf(m, k))))
    for k, n in THIN_SHAPES:
        out.append(("linear_thin", float(k * n), _chain(pair(k, n), lambda k=k: leaf(THIN_ROWS, k))))
    for t in ATTENTION_SEQ:
        out.append(("attention", 4.0 * 8 * t * t * 32,
                    _chain(lambda: (lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True)),
                           lambda t=t: leaf(2, 4, t, 32))))
    for numel in NUMEL_LADDER:
        rows = max(numel // 256, 1)
        out.append(("layer_norm", float(rows * 256),
                    _chain(lambda: torch.nn.LayerNorm(256), lambda rows=rows: leaf(rows, 256))))
        out.append(("gelu", float(numel), _chain(lambda: F.gelu, lambda numel=numel: leaf(numel))))
        out.append(("relu", float(numel), _chain(lambda: F.relu, lambda numel=numel: leaf(numel))))
        addend = torch.randn(numel)
        out.append(("add", float(numel), _chain(lambda addend=addend: (lambda t: t + addend),
                                                 lambda numel=numel: leaf(numel))))
        srows = max(numel // 64, 1)
        out.append(("softmax", float(srows * 64), _chain(lambda: (lambda t: torch.softmax(t, -1)),
                                                         lambda srows=srows: leaf(srows, 64))))
        tokens = max(numel // 128, 1)

        def embedding(count, tokens=tokens):
            tables = [torch.nn.Embedding(512, 128) for _ in range(count)]
            idx = torch.randint(0, 512, (tokens,))
            return (lambda: [t(idx) for t in tables]), (lambda ys: [torch.ones_like(y) for y in ys])
        out.append(("embedding", float(tokens * 128), embedding))
    out.append(("identity", 1.0, _chain(lambda: torch.nn.Dropout(0.0), lambda: leaf(1024))))
    return out


def time_op_curves(*, quick: bool = True, progress: Callable[[str], None] | None = None
                   ) -> list[tuple[str, float, float, float]]:
    """[(family, size, forward s, backward s), ...] for every ladder point, on one thread.

    quick: about 3-5 s on an idle core; otherwise about three times as many repeats."""
    from cost_models.calibration.ops import CHAIN, _median_times, one_thread

    rows = []
    with one_thread():
        for family, size, build in _cases():
            # fewer repeats where one op takes long: the median settles sooner there
            big = size >= (1 << 17) if not uses_flops(family) else size >= 3e7
            reps = (6 if big else 12) if quick else (20 if big else 40)
            f1, b1, fk, bk = _median_times(build, reps, 0.15 if quick else 0.6)
            per = CHAIN * (2 if family in PAIRED else 1)
            rows.append((family, size, max((fk - f1) / per, 0.0), max((bk - b1) / per, 0.0)))
        if progress:
            for family in FAMILIES:
                pts = [(s, f, b) for fam, s, f, b in rows if fam == family]
                progress(f"  {family:10s} " + ", ".join(f"{s:.3g}: {f * 1e6:.0f}/{b * 1e6:.0f} us" for s, f, b in pts))
    return rows


# The probe layer for the in-context slow-down: a pre-LayerNorm transformer block of a shape no
# example model uses, (B, T, C) = (2, 48, 96) with 3 heads. Ops in a real layer run slower than
# in a chain of their own kind (each op finds the caches holding the previous op's data, and
# the forward follows a backward); the block measured against the sum of its ops' curve times
# gives the factor (fit.curve_mix.forward / .backward).
PROBE = dict(batch=2, seq=48, hidden=96, heads=3)
PROBE_VIEWS = 9  # split, 3 unflatten, 4 transpose, flatten: priced as view overheads


def probe_ops(batch: int, seq: int, hidden: int, heads: int) -> list[tuple[str, float]]:
    """(family, size) of every curve-priced op of the probe block, in order."""
    tok, c = batch * seq, hidden
    return [("layer_norm", tok * c), ("linear", 2.0 * tok * c * 3 * c),
            ("attention", 4.0 * batch * heads * seq * seq * (c // heads)), ("linear", 2.0 * tok * c * c),
            ("add", tok * c), ("layer_norm", tok * c), ("linear", 2.0 * tok * c * 4 * c), ("gelu", tok * 4.0 * c),
            ("linear", 2.0 * tok * 4 * c * c), ("add", tok * c)]


def time_probe_block(*, quick: bool = True) -> tuple[float, float]:
    """(forward s, backward s) of one probe block in a chain of blocks (chain-differenced), one thread."""
    import torch
    import torch.nn.functional as F

    from cost_models.calibration.ops import CHAIN, _chain, _median_times, one_thread

    b, t, c, h = PROBE["batch"], PROBE["seq"], PROBE["hidden"], PROBE["heads"]

    def make():
        ln1, qkv, proj = torch.nn.LayerNorm(c), torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
        ln2, fc, out = torch.nn.LayerNorm(c), torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

        def block(x):                                                   # (B, T, C)
            q, k, v = qkv(ln1(x)).split(c, dim=2)
            q, k, v = (z.unflatten(2, (h, c // h)).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            x = x + proj(y)
            return x + out(F.gelu(fc(ln2(x))))
        return block
    with one_thread():
        f1, b1, fk, bk = _median_times(_chain(make, lambda: torch.randn(b, t, c, requires_grad=True)),
                                       12 if quick else 40, 0.5 if quick else 2.0)
    return max((fk - f1) / CHAIN, 0.0), max((bk - b1) / CHAIN, 0.0)


def fit_curve_mix(curves: dict[str, tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]],
                  block: tuple[float, float], view: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) factors: the probe block's measured time (less its views, each at the
    calibrated `view` overhead) over the sum of its ops' curve times; clamped to [0.5, 3]."""
    out = []
    for i in (0, 1):
        total = sum(curve_time(curves[fam][i], size) for fam, size in probe_ops(**PROBE))
        measured = block[i] - PROBE_VIEWS * view[i]
        out.append(min(max(measured / total, 0.5), 3.0) if total > 0 else 1.0)
    return out[0], out[1]

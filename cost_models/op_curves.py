"""Calibrated op curves: measured seconds per op of one target family over a ladder of sizes.

One constant per op kind (cost_models/compute.py's roofline with a per-kind
overhead) cannot follow a CPU: a small GEMM reaches a fraction of the rate of
a large one, GELU costs several memory passes per element (it evaluates erf)
where ReLU and add cost one, and LayerNorm's backward is several passes
(benchmarks/calibration_timing.py prints the curves). So calibration times each family of ops the
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

Measured by cost_models/calibration/curves.py; stored in a Cluster's measurements as
raw.curve.<family>.<size>.forward / .backward (seconds), read by cost_models/calibrated.py.
This module is the pricing half: which family prices a node and the time off its curve.
"""

from __future__ import annotations

import bisect
import math

from runtime.vocab import OpKind

# Families whose chained op is a pair of ops (timed per op: half the pair).
PAIRED = ("linear", "linear_thin")
FAMILIES = ("linear", "linear_thin", "attention", "layer_norm", "gelu", "relu", "add", "embedding", "softmax",
            "identity")

_ELEMENTWISE_TARGETS = {
    "gelu": "gelu", "GELU": "gelu",
    "relu": "relu", "ReLU": "relu", "relu_": "relu",
    "add": "add", "iadd": "add", "sub": "add", "mul": "add", "truediv": "add", "div": "add", "radd": "add",
}


def node_family(kind: OpKind, target: str, attrs: dict) -> str | None:
    """The curve family that prices a node of `kind` with this target, or None (priced by the roofline)."""
    base = target.rsplit(".", 1)[-1]
    if kind == OpKind.LINEAR:
        return "linear"
    if kind == OpKind.ATTENTION and "scaled_dot_product" in base:
        return "attention"
    if kind == OpKind.NORM and base in ("LayerNorm", "layer_norm", "native_layer_norm"):
        return "layer_norm"
    if kind == OpKind.EMBEDDING and base in ("Embedding", "embedding"):
        return "embedding"
    if kind == OpKind.SOFTMAX and base in ("softmax", "Softmax", "_softmax"):
        return "softmax"
    if base in ("Dropout", "dropout") and not (attrs.get("p") or attrs.get("dropout_p")):
        return "identity"  # p = 0: torch returns the input itself
    if kind == OpKind.ELEMENTWISE:
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

"""Time the op curves (cost_models/op_curves.py) on this machine: every family's ladder of
sizes and the probe block, chain-differenced like calibration.ops, on one thread.

The ladders stop at sizes whose op still takes only milliseconds on a CPU core, so that a
quick calibration times every point in seconds.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from cost_models.calibration.ops import CHAIN, _chain, _median_times, one_thread
from cost_models.op_curves import FAMILIES, PAIRED, PROBE, uses_flops

# Ladders: (family, size parameters) -> built per point.
LINEAR_SHAPES = ((8, 32, 32), (32, 64, 64), (64, 128, 128), (128, 128, 384), (128, 256, 512),
                 (256, 256, 512), (512, 512, 512))
THIN_SHAPES = ((64, 64), (128, 256), (256, 256), (256, 768), (512, 1024))   # (K, N) at M = THIN_ROWS
THIN_ROWS = 2
ATTENTION_SEQ = (16, 32, 64, 128, 256)      # (B*H = 8, T, D = 32)
NUMEL_LADDER = (1 << 8, 1 << 11, 1 << 14, 1 << 17, 1 << 20)


def _cases() -> list[tuple[str, float, Callable[[int], tuple]]]:
    """(family, size, build) for every ladder point; build(k) as calibration.ops._median_times wants."""
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

    quick: fewer repeats; otherwise about three times as many."""
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


def time_probe_block(*, quick: bool = True) -> tuple[float, float]:
    """(forward s, backward s) of one probe block in a chain of blocks (chain-differenced), one thread."""
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

"""Stage boundaries for a bi-directional (GEMS) pipeline that respect each device's memory.

Device k holds stage k and stage p-1-k, so stages fit in pairs: the weights,
gradients and optimizer state of both, plus the activations of the larger of
the two (one micro-batch is in flight per device: replica A's backward ends
before replica B's forward starts), plus the largest working set and temporary.

`bidirectional_bounds` keeps the time-balanced split when every pair fits.
Otherwise it minimizes the slowest stage under the pair constraint: a binary
search on that time limit L, and for each L a sweep over the pairs from the
outside in. After k pairs the layers left are [a, b); choosing pair k's cuts
(a', b') costs memory only on device k, and the rest of the problem depends
on (a', b') alone, needing fewer layers the larger a' and the smaller b' are.
So only the Pareto frontier of reachable (a', b') is kept, and for each a'
the smallest b' that keeps device k within memory and stage p-1-k within L is
found by bisection (both are monotone in b').
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable

from cost_models.memory import param_bytes
from planner.config import ParallelConfig


class _Sizes:
    """Prefix sums over layers: time, parameter bytes, saved activation bytes."""

    def __init__(self, config: ParallelConfig, costs: list, weights: list[float]):
        pb = param_bytes(config.dtype, 0, config.data).total
        self.w, self.par, self.act = [0.0], [0.0], [0.0]
        for c, wt in zip(costs, weights):
            self.w.append(self.w[-1] + wt)
            self.par.append(self.par[-1] + c.params * pb)
            self.act.append(self.act[-1] + c.saved)
        self.extra = max((c.working for c in costs), default=0.0) + max((c.temporary for c in costs), default=0.0)

    def time(self, lo: int, hi: int) -> float:
        return self.w[hi] - self.w[lo]

    def device(self, first: tuple[int, int], second: tuple[int, int] | None) -> float:
        """Bytes on a device holding these layer ranges (second None: one stage for both replicas)."""
        ranges = [first] if second is None else [first, second]
        return sum(self.par[hi] - self.par[lo] for lo, hi in ranges) + \
            max(self.act[hi] - self.act[lo] for lo, hi in ranges) + self.extra


def pairs_fit(bounds: list[tuple[int, int]], sizes: _Sizes, cap: float) -> bool:
    p = len(bounds)
    return all(sizes.device(bounds[k], bounds[p - 1 - k] if p - 1 - k != k else None) <= cap
               for k in range((p + 1) // 2))


def bidirectional_bounds(config: ParallelConfig, costs: list, weights: list[float], cap: float,
                         balanced: Callable) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges of the p stages: time-balanced (`balanced(weights, p, None)`) when
    every pair fits in `cap` bytes, else the pair-feasible split with the smallest slowest stage
    (the time-balanced one if none fits)."""
    p = config.pipeline
    sizes = _Sizes(config, costs, weights)
    plain = balanced(weights, p, None)
    if pairs_fit(plain, sizes, cap):
        return plain
    lo, hi = max(weights), sizes.w[-1]
    best = _feasible(hi * (1 + 1e-12), p, sizes, cap)
    if best is None:
        return plain
    for _ in range(50):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        got = _feasible(mid, p, sizes, cap)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def _feasible(limit: float, p: int, s: _Sizes, cap: float) -> list[tuple[int, int]] | None:
    """Stage ranges with every stage's time <= limit and every pair within cap, or None."""
    n = len(s.w) - 1
    frontier = [(0, n, ())]            # (a, b, cuts so far: ((lo, hi) left, (lo, hi) right) per pair)
    for k in range(p // 2):
        rest = p - 2 * (k + 1)          # stages still to place inside [a', b')
        final = rest == 0
        nxt: dict[int, tuple[int, tuple]] = {}
        for a, b, chosen in frontier:
            for a2 in range(a + 1, b):
                if s.time(a, a2) > limit:
                    break
                if final:                # the last pair splits [a, b) itself: b' = a'
                    if s.time(a2, b) <= limit and s.device((a, a2), (a2, b)) <= cap:
                        return _ranges(chosen + (((a, a2), (a2, b)),), p)
                    continue
                # smallest b2 (most layers to stage p-1-k) within time and memory, leaving rest layers
                t_min = bisect_left(s.w, s.w[b] - limit, a2 + rest, b)
                b2 = _smallest(lambda x: s.device((a, a2), (x, b)) <= cap, max(t_min, a2 + rest), b - 1)
                if b2 is None or s.time(b2, b) > limit:
                    continue
                if a2 not in nxt or b2 < nxt[a2][0]:
                    nxt[a2] = (b2, chosen + (((a, a2), (b2, b)),))
        # Pareto: keep (a2, b2) unless another state has a2' >= a2 and b2' <= b2
        frontier, low = [], None
        for a2 in sorted(nxt, reverse=True):
            b2, chosen = nxt[a2]
            if low is None or b2 < low:
                frontier.append((a2, b2, chosen))
                low = b2
        if not frontier:
            return None
    if p % 2:                            # the middle stage runs on one device for both replicas
        for a, b, chosen in frontier:
            if s.time(a, b) <= limit and s.device((a, b), None) <= cap:
                return _ranges(chosen, p, middle=(a, b))
    return None


def _smallest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Smallest x in [lo, hi] with ok(x), for ok monotone (False ... False True ... True)."""
    if lo > hi or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _ranges(chosen: tuple, p: int, middle: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    left = [c[0] for c in chosen]
    right = [c[1] for c in reversed(chosen)]
    return left + ([middle] if middle is not None else []) + right

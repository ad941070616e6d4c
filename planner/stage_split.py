"""Cutting a model's layers into pipeline stages: contiguous ranges that balance time under a
memory check (used by the pipeline, bidirectional and spatial strategies, planner/strategies/)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

# fits(stage, lo, hi): whether layers [lo, hi) fit in the memory of stage `stage`
Fits = Callable[[int, int, int], bool]

# A range may exceed the bottleneck by this factor: two equal sums added in another order differ
# in the last bits.
SLACK = 1 + 1e-12


def balanced_partition(weights: list[float], parts: int, fits=None) -> list[tuple[int, int]]:
    """Split `weights` into `parts` contiguous non-empty ranges minimizing the largest sum.

    `fits(stage, lo, hi)`, when given, says whether layers [lo, hi) fit in the
    memory of stage `stage`; ranges that do not fit are never chosen, and if
    no split fits at all the time-balanced split is returned.

    A search on the bottleneck with a greedy feasibility check (each stage takes as many
    layers as time and memory allow). Both constraints are monotone in a range's extent, so
    the greedy check is exact and the search finds the same optimum as a dynamic program over
    (layer, stage), in a few greedy passes instead of O(p n^2).
    """
    n = len(weights)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    split = _BottleneckSplit.of(weights, parts)
    cuts = (split.search(fits) if fits is not None else None) or split.search(None)
    assert cuts is not None
    bounds = [0, *cuts, n]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


@dataclass(frozen=True)
class _BottleneckSplit:
    """The layers' weights as prefix sums (prefix[i] = the sum of weights[:i], so a range [lo, hi)
    weighs prefix[hi] - prefix[lo]) and the number of stages to cut them into."""

    prefix: tuple[float, ...]
    parts: int
    heaviest: float   # the largest single weight

    @classmethod
    def of(cls, weights: list[float], parts: int) -> "_BottleneckSplit":
        prefix = [0.0]
        for w in weights:
            prefix.append(prefix[-1] + w)
        return cls(tuple(prefix), parts, max(weights))

    @property
    def n(self) -> int:
        """The number of layers."""
        return len(self.prefix) - 1

    def weight(self, lo: int, hi: int) -> float:
        """The sum of the weights of layers [lo, hi)."""
        return self.prefix[hi] - self.prefix[lo]

    def search(self, check: Fits | None) -> list[int] | None:
        """The greedy split at the least feasible bottleneck. The bottleneck is always some range's
        sum, so the search moves between such sums: a feasible probe lowers the upper end to the
        largest stage sum it achieved, a failed one raises the lower end to the next sum at which
        the greedy changes, and after each failed midpoint that next sum is probed itself. It ends
        when the ends meet: the exact optimum, in a few passes rather than a float bisection's 30."""
        bracket = self._bracket(check)
        if bracket is None:
            return None
        best, lo, hi = bracket
        from_mid = False
        for _ in range(200):
            if hi - lo <= 1e-12 * hi:   # the ends met (up to the rounding of two equal sums)
                break
            probe = lo if from_mid else (lo + hi) / 2
            cuts, value = self.greedy(probe, check)
            if cuts is not None:
                best, hi = cuts, value
                from_mid = False
            else:
                lo = max(lo, value if value > probe else probe)
                from_mid = not from_mid
        return best

    def _bracket(self, check: Fits | None) -> tuple[list[int], float, float] | None:
        """A first feasible split and the bottleneck's bounds (its cuts, lower bound, its largest stage
        sum), or None when no split passes `check` at all."""
        # no split beats the heaviest layer or an even share, and without a memory check the greedy
        # split at that bound plus the heaviest layer always works (each stage but the last then
        # holds more than an even share): try that first, the whole sum only if it fails
        total, heaviest = self.prefix[self.n], self.heaviest
        lo = max(heaviest, total / self.parts)
        best, hi = self.greedy(lo + heaviest, check)
        if best is None:
            lo = max(lo, hi if hi > lo + heaviest else lo + heaviest)
            best, hi = self.greedy(total, check)
            if best is None:
                return None
        return best, lo, hi

    def greedy(self, limit: float, check: Fits | None) -> tuple[list[int] | None, float]:
        """Each stage takes as many layers as `limit` and memory allow. Returns (cuts, the largest
        stage sum) when that covers every layer; else (None, the least limit above `limit` at which
        some stage could take one more layer: every limit below it fails the same way; inf if none)."""
        n, parts = self.n, self.parts
        cuts, start, grow = [], 0, float("inf")
        for k in range(parts):
            last = k == parts - 1
            hi = n if last else n - (parts - 1 - k)  # leave a layer for every later stage
            end = n if last else self.furthest(start, hi, limit * SLACK,
                                               lambda e: check is None or check(k, start, e))
            over = self.weight(start, end) > limit * SLACK
            if over or (check is not None and not check(k, start, end)):
                return None, min(grow, self.weight(start, end)) if over else grow
            if not last:
                if end < hi:
                    grow = min(grow, self.weight(start, end + 1))
                cuts.append(end)
            start = end
        bounds = [0, *cuts, n]
        return cuts, max(self.weight(bounds[k], bounds[k + 1]) for k in range(parts))

    def furthest(self, start: int, hi: int, budget: float, fits_to: Callable[[int], bool]) -> int:
        """The furthest end in [start + 1, hi] whose range from `start` stays within `budget` and fits
        (both monotone in the end: bisection, not a walk), or start + 1 when none does."""
        prefix = self.prefix
        end = max(bisect.bisect_right(prefix, prefix[start] + budget, start + 1, hi + 1) - 1, start + 1)
        while end > start + 1 and self.weight(start, end) > budget:   # float rounding of the sum
            end -= 1
        while end < hi and self.weight(start, end + 1) <= budget:
            end += 1
        if end > start + 1 and not fits_to(end):
            end = _last_true(fits_to, start + 1, end - 1)
        return end


def _last_true(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest i in [lo, hi] with pred(i), for a pred that is true up to some point and false after
    (lo when it is false everywhere)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo

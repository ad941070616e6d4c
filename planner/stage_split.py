"""Cutting a model's layers into pipeline stages: contiguous ranges that balance time under a
memory check (used by the pipeline, bidirectional and spatial strategies, planner/strategies/)."""

from __future__ import annotations

import bisect


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
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    slack = 1 + 1e-12

    def greedy(limit: float, check) -> tuple[list[int] | None, float]:
        """Each stage takes as many layers as `limit` and memory allow. Returns (cuts, the largest
        stage sum) when that covers every layer; else (None, the least limit above `limit` at which
        some stage could take one more layer: every limit below it fails the same way; inf if none)."""
        cuts, start, grow = [], 0, float("inf")
        for k in range(parts):
            last = k == parts - 1
            hi = n if last else n - (parts - 1 - k)  # leave a layer for every later stage
            end = n if last else _furthest(start, hi, limit * slack, lambda e: check is None or check(k, start, e))
            over = prefix[end] - prefix[start] > limit * slack
            if over or (check is not None and not check(k, start, end)):
                return None, min(grow, prefix[end] - prefix[start]) if over else grow
            if not last:
                if end < hi:
                    grow = min(grow, prefix[end + 1] - prefix[start])
                cuts.append(end)
            start = end
        bounds = [0, *cuts, n]
        return cuts, max(prefix[bounds[k + 1]] - prefix[bounds[k]] for k in range(parts))

    def _furthest(start: int, hi: int, budget: float, fits_to) -> int:
        """The furthest end in [start + 1, hi] whose range from `start` stays within `budget` and fits
        (both monotone in the end: bisection, not a walk), or start + 1 when none does."""
        end = max(bisect.bisect_right(prefix, prefix[start] + budget, start + 1, hi + 1) - 1, start + 1)
        while end > start + 1 and prefix[end] - prefix[start] > budget:   # float rounding of the sum
            end -= 1
        while end < hi and prefix[end + 1] - prefix[start] <= budget:
            end += 1
        if end > start + 1 and not fits_to(end):
            lo, up = start + 1, end - 1          # the largest fitting end below `end`
            while lo < up:
                mid = (lo + up + 1) // 2
                if fits_to(mid):
                    lo = mid
                else:
                    up = mid - 1
            end = lo
        return end

    def search(check) -> list[int] | None:
        """The greedy split at the least feasible bottleneck. The bottleneck is always some range's
        sum, so the search moves between such sums: a feasible probe lowers the upper end to the
        largest stage sum it achieved, a failed one raises the lower end to the next sum at which
        the greedy changes, and after each failed midpoint that next sum is probed itself. It ends
        when the ends meet: the exact optimum, in a few passes rather than a float bisection's 30."""
        # no split beats the heaviest layer or an even share, and without a memory check the greedy
        # split at that bound plus the heaviest layer always works (each stage but the last then
        # holds more than an even share): try that first, the whole sum only if it fails
        lo, heaviest = max(max(weights), prefix[n] / parts), max(weights)
        best, hi = greedy(lo + heaviest, check)
        if best is None:
            lo = max(lo, hi if hi > lo + heaviest else lo + heaviest)
            best, hi = greedy(prefix[n], check)
            if best is None:
                return None
        from_mid = False
        for _ in range(200):
            if hi - lo <= 1e-12 * hi:   # the ends met (up to the rounding of two equal sums)
                break
            probe = lo if from_mid else (lo + hi) / 2
            cuts, value = greedy(probe, check)
            if cuts is not None:
                best, hi = cuts, value
                from_mid = False
            else:
                lo = max(lo, value if value > probe else probe)
                from_mid = not from_mid
        return best

    cuts = (search(fits) if fits is not None else None) or search(None)
    assert cuts is not None
    bounds = [0, *cuts, n]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]

"""Cutting a model's layers into pipeline stages: contiguous ranges that balance time under a
memory check (used by the pipeline, bidirectional and spatial strategies, planner/strategies/)."""

from __future__ import annotations

import bisect


def balanced_partition(weights: list[float], parts: int, fits=None) -> list[tuple[int, int]]:
    """Split `weights` into `parts` contiguous non-empty ranges minimizing the largest sum.

    `fits(stage, lo, hi)`, when given, says whether layers [lo, hi) fit in the
    memory of stage `stage`; ranges that do not fit are never chosen, and if
    no split fits at all the time-balanced split is returned.

    Binary search on the bottleneck with a greedy feasibility check (each
    stage takes as many layers as time and memory allow). Both constraints are
    monotone in a range's extent, so the greedy check is exact and the search
    finds the same optimum as a dynamic program over (layer, stage), in
    O(n log) instead of O(p n^2).
    """
    n = len(weights)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    slack = 1 + 1e-12

    def cuts_for(limit: float, check) -> list[int] | None:
        cuts, start = [], 0
        for k in range(parts):
            last = k == parts - 1
            hi = n if last else n - (parts - 1 - k)  # leave a layer for every later stage
            end = n if last else _furthest(start, hi, limit * slack, lambda e: check is None or check(k, start, e))
            if prefix[end] - prefix[start] > limit * slack or (check is not None and not check(k, start, end)):
                return None
            if not last:
                cuts.append(end)
            start = end
        return cuts

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
        if cuts_for(prefix[n], check) is None:
            return None
        # no split beats the heaviest layer or an even share; stop once the bottleneck is known to
        # 1e-9 of itself (a search over 128 layers then takes about 30 greedy passes, not 60)
        lo, hi = max(max(weights), prefix[n] / parts), prefix[n]
        for _ in range(60):
            if hi - lo <= 1e-9 * max(hi, 1e-30):
                break
            mid = (lo + hi) / 2
            if cuts_for(mid, check) is None:
                lo = mid
            else:
                hi = mid
        return cuts_for(hi, check)

    cuts = (search(fits) if fits is not None else None) or search(None)
    assert cuts is not None
    bounds = [0, *cuts, n]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]

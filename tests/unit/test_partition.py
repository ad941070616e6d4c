"""Stage partition: the search over range sums with a greedy check equals a brute-force search, with and
without memory."""

import itertools
import random

import pytest

from planner.stage_split import balanced_partition


def _brute(weights, parts, fits=None):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = [0, *cuts, n]
        ranges = [(b[k], b[k + 1]) for k in range(parts)]
        if fits is not None and not all(fits(k, lo, hi) for k, (lo, hi) in enumerate(ranges)):
            continue
        worst = max(sum(weights[lo:hi]) for lo, hi in ranges)
        if best is None or worst < best - 1e-12:
            best = worst
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    parts = rng.randint(1, n)
    weights = [rng.uniform(0.1, 5.0) for _ in range(n)]
    mem = [rng.uniform(0.1, 3.0) for _ in range(n)]
    cap = rng.uniform(2.0, 8.0)
    live = [parts - k for k in range(parts)]  # like 1F1B: early stages hold more activations

    def fits(k, lo, hi):
        return live[k] * sum(mem[lo:hi]) <= cap

    for f in (None, fits):
        want = _brute(weights, parts, f)
        got = balanced_partition(weights, parts, f)
        assert [hi - lo for lo, hi in got] and all(hi > lo for lo, hi in got)
        assert got[0][0] == 0 and got[-1][1] == n
        if want is None:  # nothing fits: the time-balanced split is returned
            assert max(sum(weights[lo:hi]) for lo, hi in got) == pytest.approx(_brute(weights, parts))
        else:
            assert max(sum(weights[lo:hi]) for lo, hi in got) == pytest.approx(want)
            if f is not None:
                assert all(f(k, lo, hi) for k, (lo, hi) in enumerate(got))


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_with_many_equal_sums(seed):
    """Repeated blocks between a lighter and a heavier end (a transformer's layers): many ranges share a
    sum, so the search must land exactly on the best one, not near it."""
    rng = random.Random(1000 + seed)
    n = rng.randint(3, 10)
    parts = rng.randint(2, n)
    weights = [rng.choice((0.5, 1.0, 2.0))] + [1.0] * (n - 2) + [rng.choice((1.0, 1.5, 3.0))]
    cap = rng.randint(1, n)

    def fits(k, lo, hi):
        return hi - lo <= cap

    for f in (None, fits):
        want = _brute(weights, parts, f) or _brute(weights, parts)
        got = balanced_partition(weights, parts, f)
        assert max(sum(weights[lo:hi]) for lo, hi in got) == pytest.approx(want, rel=1e-12)


def test_memory_moves_layers_off_the_first_stage():
    weights = [1.0] * 8
    balanced = balanced_partition(weights, 2)
    assert balanced == [(0, 4), (4, 8)]
    # stage 0 holds twice the activations (1F1B), so it may only take 3 layers
    got = balanced_partition(weights, 2, lambda k, lo, hi: (2 - k) * (hi - lo) <= 6)
    assert got == [(0, 3), (3, 8)]

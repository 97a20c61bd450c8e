"""Poisson arrival schedules: seeded, in range, and with Poisson statistics (fixed seeds)."""

from __future__ import annotations

import math
import statistics

import pytest
from ppd_router.bench.arrivals import poisson_arrivals


def test_same_seed_gives_same_schedule_and_other_seeds_differ():
    assert poisson_arrivals(4, 10, seed=7) == poisson_arrivals(4, 10, seed=7)
    assert poisson_arrivals(4, 10, seed=7) != poisson_arrivals(4, 10, seed=8)


def test_arrivals_are_sorted_and_inside_the_window():
    ts = poisson_arrivals(20, 5, seed=1)
    assert ts == sorted(ts)
    assert all(0 < t < 5 for t in ts)


def test_counts_have_poisson_mean_and_dispersion():
    # 300 fixed seeds of a 10 s run at 4 QPS: count ~ Poisson(40), so the mean is
    # 40 +- 0.37 (1 s.e.) and variance/mean is 1 +- 0.08; tolerances are > 4 s.e.
    counts = [len(poisson_arrivals(4, 10, seed=s)) for s in range(300)]
    m = statistics.fmean(counts)
    assert abs(m - 40) < 1.6
    assert 0.65 < statistics.variance(counts) / m < 1.35


def test_gaps_are_exponential_with_mean_one_over_qps():
    ts = poisson_arrivals(10, 2000, seed=3)  # ~20,000 gaps
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
    assert abs(statistics.fmean(gaps) - 0.1) < 0.004  # s.e. ~0.0007
    # Exponential: P(gap < ln2 / qps) = 1/2, and the gaps' CV is 1.
    below = sum(g < math.log(2) / 10 for g in gaps) / len(gaps)
    assert abs(below - 0.5) < 0.02
    assert abs(statistics.stdev(gaps) / statistics.fmean(gaps) - 1) < 0.05


@pytest.mark.parametrize(("qps", "duration"), [(0, 10), (-1, 10), (1, 0), (1, -5)])
def test_non_positive_rate_or_duration_is_rejected(qps, duration):
    with pytest.raises(ValueError):
        poisson_arrivals(qps, duration)

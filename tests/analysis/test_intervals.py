"""The decision layer's intervals hold their stated confidence (simulated), and say when they cannot."""

import numpy as np
import pytest
from scipy import stats

from pytest_kvoffload.analysis.intervals import (fewest_for_median_interval, median_bound, median_interval,
                                                  quantile_interval, t_bound_halfwidth, t_quantile)


def test_the_median_bound_is_the_order_statistic_the_binomial_tail_allows():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert median_bound(values, upper=False) == 1.0 and median_bound(values, upper=True) == 5.0  # 1/32 <= 5%
    assert median_bound(values[:4], upper=False) is None  # 1/16 > 5%: four values bound nothing
    assert fewest_for_median_interval() == 6 and median_interval([1.0, 2.0, 3.0])[0] is None


@pytest.mark.parametrize("n, q", [(7, 0.5), (15, 0.5), (40, 0.9)])
def test_distribution_free_intervals_cover_at_least_their_confidence(n, q):
    rng = np.random.default_rng(n)
    truth = stats.lognorm(0.3).ppf(q)
    covered = tried = 0
    for _ in range(2000):
        low, high = quantile_interval(list(rng.lognormal(0, 0.3, n)), q)
        if low is None or high is None:
            continue
        tried += 1
        covered += low <= truth <= high
    assert tried == 2000 and covered / tried >= 0.94  # at least 95% (order statistics are conservative)


def test_t_intervals_widen_with_few_degrees_of_freedom_where_two_standard_errors_did_not():
    assert t_quantile(1) == pytest.approx(12.706, abs=1e-3) and t_quantile(1000) == pytest.approx(1.962, abs=1e-3)
    assert t_quantile(0) == float("inf") and t_bound_halfwidth(0.0, 0) == 0.0
    # A mean of 3 normal draws: its 95% t interval covers 95%; two standard errors cover about 88%.
    rng = np.random.default_rng(0)
    draws = rng.normal(0, 1, (4000, 3))
    means, se = draws.mean(1), draws.std(1, ddof=1) / np.sqrt(3)
    t_cover = np.mean(np.abs(means) <= t_quantile(2) * se)
    two_se_cover = np.mean(np.abs(means) <= 2 * se)
    assert 0.935 <= t_cover <= 0.965 and two_se_cover < 0.9

"""Wrong rounds by noise: each side's rate, their sum's tail, and the power as a Beta quantile."""

import math

import numpy as np
import pytest
from scipy import stats

from pytest_kvoffload.analysis.wrong_rounds import (allowed_wrong, detectable_from, detectable_slowdown, robust_sigma,
                                                    side_rate, wrong_by_noise)


def test_a_side_rate_counts_one_side_only_with_a_laplace_estimate():
    deviations = [0.2, -0.2, 0.0, 0.01, -0.3]
    assert side_rate(deviations, 0.1, upper=True) == pytest.approx(2 / 7)
    assert side_rate(deviations, -0.1, upper=False) == pytest.approx(3 / 7)
    assert side_rate([0.0] * 30, 0.1, upper=True) == pytest.approx(1 / 32)  # never 0


def test_two_sides_add_as_a_convolution_of_binomials():
    pmf = wrong_by_noise(3, 2, 0.1, 0.3)
    assert pmf.sum() == pytest.approx(1.0)
    assert pmf[0] == pytest.approx(0.9 ** 3 * 0.7 ** 2)
    # One side alone is the binomial itself.
    assert wrong_by_noise(5, 0, 0.2, 0.9) == pytest.approx(stats.binom.pmf(range(6), 5, 0.2))


def test_the_allowance_is_the_tail_at_the_confidence():
    assert allowed_wrong(5, 0, 1 / 32, 0.5, 0.95) == 1   # P(X >= 2) = 0.0089 < 5%
    assert allowed_wrong(0, 5, 0.5, 1 / 32, 0.95) == 1   # the other side, the same
    assert allowed_wrong(5, 0, 0.3, 0.0, 0.95) == 3      # P(X >= 3) = 0.163, P(X >= 4) = 0.031
    assert allowed_wrong(10, 0, 1 / 32, 0.0, 0.95) == 1


def test_the_detectable_slowdown_falls_with_rounds_and_rises_with_spread():
    d5 = detectable_slowdown(5, 1, 0.05, 0.1, 0.9)
    q = stats.beta.ppf(0.9, 2, 4)
    assert stats.binom.sf(1, 5, q) == pytest.approx(0.9)
    assert d5 == pytest.approx(1.1 * math.exp(0.05 * stats.norm.ppf(q)) - 1)
    assert detectable_slowdown(20, 2, 0.05, 0.1, 0.9) < d5 < detectable_slowdown(5, 1, 0.1, 0.1, 0.9)
    assert detectable_slowdown(5, 5, 0.05, 0.1, 0.9) == math.inf


def test_the_power_read_from_deviations_is_their_quantile_on_the_side_judged():
    rng = np.random.default_rng(3)
    normal = list(rng.normal(0, 0.05, 4000))
    # Normal deviations: the empirical power is the normal model's.
    assert detectable_from(5, 1, normal, 0.1, 0.9, upper=True) == pytest.approx(
        detectable_slowdown(5, 1, 0.05, 0.1, 0.9), abs=0.005)
    # A tail on one side only: admitted rounds need the low strays (a wrong round must stay past the cap),
    # declined ones the high strays; each side reads its own.
    high_tail = [0.0] * 60 + [0.3] * 40
    assert detectable_from(20, 10, high_tail, 0.1, 0.9, upper=True) == pytest.approx(0.1)
    assert detectable_from(20, 10, high_tail, 0.1, 0.9, upper=False) == pytest.approx(1.1 * math.exp(0.3) - 1)
    assert detectable_from(5, 5, normal, 0.1, 0.9, upper=True) == math.inf
    assert detectable_from(5, 1, [0.1], 0.1, 0.9, upper=True) == math.inf


def test_the_spread_is_robust_to_one_outlier():
    calm = [0.01, -0.01, 0.02, -0.02, 0.0, 0.01] * 5
    assert robust_sigma(calm + [2.0], 6) == pytest.approx(robust_sigma(calm, 6), rel=0.2)
    assert robust_sigma([0.1], 1) == math.inf

"""Intervals: distribution-free ones for a median or a quantile (order statistics, binomial tails), and
t-quantile ones for means and fitted lines, all from scipy.stats."""

from __future__ import annotations

import math

from scipy import stats

from pytest_kvoffload.core.tolerances import CONFIDENCE


def _lower_rank(n: int, q: float, alpha: float) -> int:
    """The largest k with P(Binomial(n, q) < k) <= alpha: the k-th smallest value is below the q-quantile
    with at least 1 - alpha; 0 when no order statistic is (too few values)."""
    k = 0
    while k < n and stats.binom.cdf(k, n, q) <= alpha:
        k += 1
    return k


def quantile_bound(values: list[float], q: float, upper: bool, confidence: float = CONFIDENCE) -> float | None:
    """A one-sided distribution-free bound on the q-quantile at `confidence`; None for too few values."""
    n, alpha = len(values), 1.0 - confidence
    ordered = sorted(values)
    if upper:
        # The mirror image: the k-th largest is above the q-quantile where P(Binomial(n, 1 - q) < k) <= alpha.
        k = _lower_rank(n, 1.0 - q, alpha)
        return ordered[n - k] if k else None
    k = _lower_rank(n, q, alpha)
    return ordered[k - 1] if k else None


def median_bound(values: list[float], upper: bool, confidence: float = CONFIDENCE) -> float | None:
    """A one-sided distribution-free bound on the median (with 5 values at 95%: the smallest or largest)."""
    return quantile_bound(values, 0.5, upper, confidence)


def quantile_interval(values: list[float], q: float, confidence: float = CONFIDENCE) -> tuple[float | None, float | None]:
    """The q-quantile's two-sided interval at `confidence` (each side (1 + confidence) / 2); None on a side
    that too few values cannot bound (3 values cannot bound a median at 95%: 6 are needed)."""
    side = 1.0 - (1.0 - confidence) / 2
    return quantile_bound(values, q, False, side), quantile_bound(values, q, True, side)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float | None, float | None]:
    return quantile_interval(values, 0.5, confidence)


def fewest_for_median_interval(confidence: float = CONFIDENCE) -> int:
    """The fewest values whose median has a two-sided distribution-free interval at `confidence` (6 at 95%)."""
    n = 1
    while quantile_interval([float(i) for i in range(n)], 0.5, confidence)[0] is None:
        n += 1
    return n


def t_quantile(df: float, confidence: float = CONFIDENCE) -> float:
    """The two-sided t multiplier (1.96 for many degrees of freedom, 12.7 for one); inf for none."""
    if df < 1:
        return math.inf
    return float(stats.t.ppf(1.0 - (1.0 - confidence) / 2, df))


def t_bound_halfwidth(se: float, df: float, confidence: float = CONFIDENCE) -> float:
    """How far a one-sided bound at `confidence` lies from an estimate with standard error `se` on `df`
    degrees of freedom (a verdict that is "at most a limit" tests each side on its own: see analysis/outcome.py)."""
    if se == 0:
        return 0.0
    if df < 1:
        return math.inf
    return float(stats.t.ppf(confidence, df)) * se

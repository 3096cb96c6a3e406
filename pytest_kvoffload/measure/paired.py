"""Paired comparisons: per round, two requests taken side by side, judged by their ratios.

Pairing cancels what drifts between rounds (the engine warming, a neighbour on the machine). The verdict
on ratios r = new / base:

- slower: the median ratio is above CAP (1.10: 10% slower fails whatever the noise), or its median is
  above 1 + FLOOR with at least CONFIDENCE (95%) by a distribution-free bound (order statistics of the
  rounds: with 5 rounds, all 5 must be above);
- paid (faster): the mirror image;
- same: neither shown at that confidence.
"""

from __future__ import annotations

from math import comb

import numpy as np

CAP = 1.10
FLOOR = 0.03
CONFIDENCE = 0.95
# A two-sided 95% interval of the median: each side at 97.5%.
SIDE_CONFIDENCE = 0.975


def median_bound(values: list[float], upper: bool, confidence: float = CONFIDENCE) -> float | None:
    """A distribution-free one-sided bound on the median: the k-th smallest (or largest) value, with k the
    largest for which P(Binomial(n, 1/2) < k) <= 1 - confidence. None when n is too small for it."""
    n, alpha = len(values), 1 - confidence
    k, cdf = 0, 0.0
    while k < n and cdf + comb(n, k) / 2 ** n <= alpha:
        cdf += comb(n, k) / 2 ** n
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[n - k] if upper else ordered[k - 1]


def verdict(ratios: list[float]) -> str:
    """'slower', 'paid' or 'same' (no difference shown at the stated confidence)."""
    median = float(np.median(ratios))
    low, high = median_bound(ratios, upper=False), median_bound(ratios, upper=True)
    if median > CAP or (low is not None and low > 1 + FLOOR):
        return "slower"
    if median < 1 / CAP or (high is not None and high < 1 - FLOOR):
        return "paid"
    return "same"


def within_cap(ratios: list[float]) -> bool:
    """The median ratio within [1 / CAP, CAP]: no difference of 10% or more."""
    median = float(np.median(ratios))
    return 1 / CAP <= median <= CAP


def interval(ratios: list[float]) -> tuple[float | None, float | None]:
    """The median ratio's two-sided 95% interval (distribution-free); None on a side for too few ratios."""
    return (median_bound(ratios, upper=False, confidence=SIDE_CONFIDENCE),
            median_bound(ratios, upper=True, confidence=SIDE_CONFIDENCE))

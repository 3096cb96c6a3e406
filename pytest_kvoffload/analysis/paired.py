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

import numpy as np

from pytest_kvoffload.core.tolerances import CONFIDENCE, PAIRED_CAP as CAP, PAIRED_FLOOR as FLOOR
from pytest_kvoffload.analysis.intervals import median_bound, median_interval
from pytest_kvoffload.analysis.outcome import Verdict, at_most

__all__ = ["CAP", "CONFIDENCE", "FLOOR", "interval", "median_bound", "paired_verdict", "verdict", "within_cap"]


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
    return median_interval(ratios, CONFIDENCE)


def paired_verdict(what: str, ratios: list[float], limit: float = CAP) -> Verdict:
    """Met, missed or undecided for a paired median ratio that must be at most `limit` (analysis/outcome.py)."""
    low, high = interval(ratios)
    return at_most(what, float(np.median(ratios)), low, high, limit, rounds=len(ratios),
                   how="paired median, distribution-free")

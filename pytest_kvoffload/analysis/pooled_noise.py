"""The gate's noise model between two recorded runs, pooled over the grid's cells.

A run records 2 to 3 rounds a cell, too few for a distribution-free bound on one cell (3 against 3 gives
only max/min). Rounds of one noise group (analysis/run_gate.noise_group) vary alike across lengths and
fractions, so their spread is estimated once per group from every cell of both runs. It is not one relative
spread: a round's jitter is partly absolute (a stall of a few ms is a fifth of a 50 ms prefill and nothing
to a 1 s one), so the variance of a round's log TTFT at a cell whose TTFT is t is modelled as

    sigma^2(t) = A / t^2 + B        (A: absolute jitter, s^2; B: relative jitter)

fitted by non-negative least squares to each cell's sample variance, weighted by its degrees of freedom
(those of the fit: their sum less 2). Rounds stall now and then (a server's first rounds at 3x the rest,
seen in make bench): a cell whose variance the model explains with p < STALL_P (an F test) is left out of the
fit, and judged on its own variance instead. A cell's centre is the median of its rounds' logs (Var(median)
per unit variance simulated once, seeded: median_variance); its change is the ratio of its centres, new over
base, with t bounds each one-sided at 95% (met and missed are one-sided tests: analysis/outcome.py); a
group's change is the inverse-variance weighted mean of its cells' log ratios.
Stated assumptions: rounds are independent, log-normal around their cell's centre apart from stalls, with
one (A, B) per group in both runs. tests/analysis/test_pooled_noise.py holds it to simulated runs, stalls
included, and a run compared with itself passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import stats
from scipy.optimize import nnls

from pytest_kvoffload.analysis.intervals import t_bound_halfwidth
from pytest_kvoffload.core.tolerances import CONFIDENCE

# Degrees of freedom the fit of (A, B) spends; the level at which a cell's variance is a stall's.
FIT_PARAMETERS = 2
STALL_P = 0.001


def _cell_stats(rounds: list[float]) -> tuple[float, float, int] | None:
    """(centre seconds, sample variance of the logs, degrees of freedom); None for fewer than 2 rounds."""
    values = np.asarray([r for r in rounds if r > 0], dtype=float)
    if len(values) < 2:
        return None
    logs = np.log(values)
    return float(np.exp(np.median(logs))), float(np.var(logs, ddof=1)), len(values) - 1


@dataclass(frozen=True)
class Noise:
    absolute_s2: float  # A
    relative: float     # B
    df: int
    stalled: int = 0    # cells left out of the fit as stalls

    def variance(self, seconds: float) -> float:
        """The variance of one round's log TTFT at a cell whose TTFT is `seconds`."""
        return self.absolute_s2 / seconds ** 2 + self.relative if self.df > 0 else math.inf

    def stall(self, seconds: float, variance: float, df: int) -> bool:
        """Whether a cell's own variance is past what this model explains at STALL_P."""
        model = self.variance(seconds)
        if not 0 < model < math.inf or df < 1:
            return False
        return float(stats.f.sf(variance / model, df, self.df)) < STALL_P

    @staticmethod
    def pooled(cells: list[list[float]]) -> "Noise":
        """From each cell's rounds (seconds); a cell of one round adds nothing."""
        found = [c for c in (_cell_stats(r) for r in cells) if c is not None]
        noise = _fit(found)
        kept = [c for c in found if not noise.stall(*c)]
        return _fit(kept, stalled=len(found) - len(kept)) if len(kept) < len(found) else noise


def _fit(cells: list[tuple[float, float, int]], stalled: int = 0) -> Noise:
    df = sum(d for _, _, d in cells) - FIT_PARAMETERS
    if df < 1:
        return Noise(0.0, 0.0, 0, stalled)
    w = np.sqrt(np.asarray([d for _, _, d in cells], dtype=float))
    rows = np.asarray([[1.0 / t ** 2, 1.0] for t, _, _ in cells])
    (a, b), _ = nnls(rows * w[:, None], np.asarray([v for _, v, _ in cells]) * w)
    return Noise(float(a), float(b), df, stalled)


@lru_cache(maxsize=None)
def median_variance(n: int, draws: int = 40_000) -> float:
    """Var(median of n normal rounds of variance 1), by a seeded simulation (1 / n for n <= 2)."""
    if n <= 2:
        return 1.0 / n
    sample = np.random.default_rng(n).standard_normal((draws, n))
    return float(np.var(np.median(sample, axis=1)))


@dataclass(frozen=True)
class Change:
    """new / base with its interval: `estimate` and the bounds are ratios."""

    estimate: float
    low: float
    high: float
    rounds: tuple[int, int]


def _log_centre(rounds: list[float]) -> float:
    return float(np.median(np.log(np.asarray(rounds, dtype=float))))


def _cell(base: list[float], new: list[float], noise: Noise) -> tuple[float, float]:
    """A cell's log ratio and its variance: the model's, or the cell's own where it is a stall's."""
    centre = math.exp((_log_centre(base) + _log_centre(new)) / 2)
    per_round = noise.variance(centre)
    own = [c for c in (_cell_stats(base), _cell_stats(new)) if c is not None]
    if own:
        df = sum(d for _, _, d in own)
        variance = sum(v * d for _, v, d in own) / df
        if noise.stall(centre, variance, df):
            per_round = variance
    return _log_centre(new) - _log_centre(base), per_round * (median_variance(len(base)) + median_variance(len(new)))


def _change(d: float, variance: float, noise: Noise, rounds: tuple[int, int],
            low_confidence: float = CONFIDENCE) -> Change:
    def half(confidence: float) -> float:
        return t_bound_halfwidth(math.sqrt(variance), noise.df, confidence) if math.isfinite(variance) else math.inf
    low, high = half(low_confidence), half(CONFIDENCE)
    return Change(math.exp(d), math.exp(d - low) if math.isfinite(low) else 0.0,
                  math.exp(d + high) if math.isfinite(high) else math.inf, rounds)


def cell_change(base: list[float], new: list[float], noise: Noise, low_confidence: float = CONFIDENCE) -> Change:
    """A cell's change; its lower bound at `low_confidence` (the gate asks more of it where many cells are
    compared at once: run_gate.compare)."""
    d, variance = _cell(base, new, noise)
    return _change(d, variance, noise, (len(base), len(new)), low_confidence)


def group_change(pairs: list[tuple[list[float], list[float]]], noise: Noise) -> Change:
    """The inverse-variance weighted mean log ratio over a group's cells, with its interval."""
    cells = [_cell(b, n, noise) for b, n in pairs]
    rounds = (sum(len(b) for b, _ in pairs), sum(len(n) for _, n in pairs))
    if any(v == 0 for _, v in cells):  # no noise at all (a run compared with itself, rounds all equal)
        d = sum(x for x, _ in cells) / len(cells)
        return _change(d, 0.0, noise, rounds)
    if not all(math.isfinite(v) for _, v in cells):
        return _change(sum(x for x, _ in cells) / len(cells), math.inf, noise, rounds)
    weights = [1 / v for _, v in cells]
    d = sum(w * x for w, (x, _) in zip(weights, cells)) / sum(weights)
    return _change(d, 1 / sum(weights), noise, rounds)

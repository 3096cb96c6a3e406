"""The gate's noise model between two recorded runs: per backend and state, pooled over the grid's cells.

A run records 2 to 3 rounds a cell, too few for a distribution-free bound on one cell (3 against 3 gives
only max/min). Rounds of one backend in one state vary alike across lengths and fractions on one machine,
so their spread is estimated once per (backend, state) from every cell of both runs. It is not one relative
spread: a round's jitter is partly absolute (a stall of a few ms is a fifth of a 50 ms prefill and nothing
to a 1 s one), so the variance of a round's log TTFT at a cell whose TTFT is t is modelled as

    sigma^2(t) = A / t^2 + B        (A: absolute jitter, s^2; B: relative jitter)

fitted by non-negative least squares to each cell's sample variance (weighted by its degrees of freedom;
those of the fit are rounds minus cells minus 2). A cell's change is the ratio of its geometric means, new over
base, with a t interval on sigma(t); a backend and state's change is the inverse-variance weighted mean of
its cells' log ratios. Stated assumptions: rounds are independent, log-normal around their cell's centre,
with one (A, B) per backend and state in both runs. tests/verdicts/test_pooled_noise.py holds it to
simulated runs, and a run compared with itself passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from pytest_kvoffload.verdicts.intervals import t_halfwidth

# Degrees of freedom the fit of (A, B) spends.
FIT_PARAMETERS = 2


@dataclass(frozen=True)
class Noise:
    absolute_s2: float  # A
    relative: float     # B
    df: int

    def variance(self, seconds: float) -> float:
        """The variance of one round's log TTFT at a cell whose TTFT is `seconds`."""
        return self.absolute_s2 / seconds ** 2 + self.relative if self.df > 0 else math.inf

    @staticmethod
    def pooled(cells: list[list[float]]) -> "Noise":
        """From each cell's rounds (seconds); a cell of one round adds nothing."""
        rows, targets, weights = [], [], []
        for rounds in cells:
            values = np.asarray([r for r in rounds if r > 0], dtype=float)
            if len(values) < 2:
                continue
            logs = np.log(values)
            centre = float(np.exp(logs.mean()))
            rows.append([1.0 / centre ** 2, 1.0])
            targets.append(float(np.var(logs, ddof=1)))
            weights.append(len(values) - 1)
        df = int(sum(weights)) - FIT_PARAMETERS
        if df < 1:
            return Noise(0.0, 0.0, 0)
        w = np.sqrt(np.asarray(weights, dtype=float))
        (a, b), _ = nnls(np.asarray(rows) * w[:, None], np.asarray(targets) * w)
        return Noise(float(a), float(b), df)


@dataclass(frozen=True)
class Change:
    """new / base with its interval: `estimate` and the bounds are ratios."""

    estimate: float
    low: float
    high: float
    rounds: tuple[int, int]


def _log_mean(rounds: list[float]) -> float:
    return float(np.mean(np.log(np.asarray(rounds, dtype=float))))


def _cell(base: list[float], new: list[float], noise: Noise) -> tuple[float, float]:
    """A cell's log ratio and its variance."""
    centre = math.exp((_log_mean(base) + _log_mean(new)) / 2)
    return _log_mean(new) - _log_mean(base), noise.variance(centre) * (1 / len(base) + 1 / len(new))


def _change(d: float, variance: float, noise: Noise, rounds: tuple[int, int]) -> Change:
    half = t_halfwidth(math.sqrt(variance), noise.df) if math.isfinite(variance) else math.inf
    return Change(math.exp(d), math.exp(d - half) if math.isfinite(half) else 0.0,
                  math.exp(d + half) if math.isfinite(half) else math.inf, rounds)


def cell_change(base: list[float], new: list[float], noise: Noise) -> Change:
    d, variance = _cell(base, new, noise)
    return _change(d, variance, noise, (len(base), len(new)))


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

"""Rounds judged one by one: how many wrong rounds noise explains, and the slowdown those rounds can show.

A rule's decision in a round is wrong when that round's ratio lies past a threshold on one side (an
admitted load slower than recompute by more than the cap; a declined one whose load would have paid by more
than margin plus cap). A right decision looks wrong by noise only when the round's ratio strays past its
cell's centre by that much on that side, so each side has its own rate (`side_rate`), measured over all the
cells' rounds. A cell's wrong rounds are then a sum of two binomials (its admitted rounds at the upper rate,
its declined ones at the lower), and `allowed_wrong` is the most that sum reaches with probability
1 - confidence. `detectable_from` states the power: the true miss at which more than that many of a cell's
rounds land past the threshold with the given probability, each round strayed as the measured deviations
stray on that side (their empirical quantile, the same deviations the rates count: a heavy tail widens the
allowance and the power alike); `detectable_slowdown` is the same with each round's log ratio normal with
spread sigma, for noise given as a model. Tails are scipy.stats', quantiles numpy's.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def side_rate(deviations: list[float], threshold: float, upper: bool) -> float:
    """The share of log deviations past `threshold` (> it where `upper`, < it otherwise): a Laplace
    estimate, (k + 1) / (n + 2), never 0 from a handful of quiet rounds."""
    beyond = sum((x > threshold) if upper else (x < threshold) for x in deviations)
    return (beyond + 1) / (len(deviations) + 2)


def wrong_by_noise(admitted: int, declined: int, p_up: float, p_down: float) -> np.ndarray:
    """P(k wrong rounds) for k = 0 .. admitted + declined, each round wrong by noise alone at its side's rate."""
    up = stats.binom.pmf(np.arange(admitted + 1), admitted, p_up)
    down = stats.binom.pmf(np.arange(declined + 1), declined, p_down)
    return np.convolve(up, down)


def allowed_wrong(admitted: int, declined: int, p_up: float, p_down: float, confidence: float) -> int:
    """The most wrong rounds noise explains: more has probability below 1 - confidence."""
    pmf = wrong_by_noise(admitted, declined, p_up, p_down)
    at_least = np.cumsum(pmf[::-1])[::-1]  # at_least[k] = P(X >= k)
    k = 0
    while k + 1 < len(at_least) and at_least[k + 1] >= 1 - confidence:
        k += 1
    return k


def detectable_slowdown(n: int, allowed: int, sigma: float, cap: float, power: float) -> float:
    """The true slowdown d (ratio 1 + d) at which more than `allowed` of n rounds land above 1 + cap with
    probability `power`; inf where no slowdown can (every round allowed, or no spread measured)."""
    if n == 0 or allowed >= n or not math.isfinite(sigma):
        return math.inf
    # P(Binomial(n, q) > allowed) = power solved for q: the Beta(allowed + 1, n - allowed) quantile.
    q = float(stats.beta.ppf(power, allowed + 1, n - allowed))
    return math.exp(math.log(1 + cap) + float(stats.norm.ppf(q)) * max(sigma, 1e-6)) - 1


def detectable_from(n: int, allowed: int, deviations: list[float], cap: float, power: float, upper: bool) -> float:
    """The true miss d (ratio 1 + d past recompute, the cap's threshold included) at which more than `allowed`
    of n rounds land past the threshold with probability `power`, each round's log deviation drawn from
    `deviations`: above 1 + cap where `upper` (admitted rounds), below a decline's threshold otherwise (the
    same log distance past it); inf where no miss can (every round allowed, or fewer than 2 deviations)."""
    if n == 0 or allowed >= n or len(deviations) < 2:
        return math.inf
    q = float(stats.beta.ppf(power, allowed + 1, n - allowed))  # each round's share past the threshold needed
    values = np.asarray(deviations, dtype=float)
    shift = -float(np.quantile(values, 1 - q)) if upper else float(np.quantile(values, q))
    return math.exp(math.log(1 + cap) + shift) - 1


def robust_sigma(deviations: list[float], fitted: int) -> float:
    """The spread of log deviations from fitted centres, robust to the odd outlier: 1.4826 x their median
    absolute value (the normal's sd), scaled by n / (n - fitted) for the deviations the centres zero."""
    n = len(deviations)
    if n <= fitted:
        return math.inf
    return 1.4826 * float(np.median(np.abs(deviations))) * math.sqrt(n / (n - fitted))

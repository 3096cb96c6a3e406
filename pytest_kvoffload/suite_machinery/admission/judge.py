"""Every admission decision judged, and what noise explains.

A round of a frontier cell pairs, in time, the guarded server (the rule under test) with the control (every
load taken), each a tier-only hit and a cold request of the same prompt length:

- an admitted round is wrong when its hit was slower than the cold request beside it by more than the cap
  (guarded hit / guarded cold > 1 + cap);
- a declined round is wrong when the control's load of the same cell, in the same round, paid by more than
  the rule's margin plus the cap (control hit / control cold < 1 - margin - cap): only then did declining
  cost something the rule was meant to take.

A right rule can still look wrong in a round by noise. How often is measured, not assumed: a round's paired
ratio (the control's hit / cold) lies more than the cap from its cell's median in a share p0 of all rounds
(pooled over the cells; a Laplace estimate, (k + 1) / (n + 2)). Cold requests of the two servers are not
compared: two servers of one build may differ in speed, which moves neither server's own hit/cold ratio. A cell fails when its wrong rounds are more
than Binomial(rounds, p0) reaches with probability 1 - CONFIDENCE: at 95%, with p0 near 3% and five rounds,
two wrong rounds fail a cell and one does not. Not by majority vote: a rule wrong in 2 rounds of 5 fails.

The smallest slowdown a cell can show (`detectable_slowdown`): the true hit/cold ratio above which that
many wrong rounds come with 90% probability, given the rounds' log-normal spread (sigma, from the same
deviations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pytest_kvoffload.core.tolerances import ADMISSION_CAP

CAP = ADMISSION_CAP  # a hit up to 10% slower than recompute is within the suite's tolerance (core/tolerances.py)
CONFIDENCE = 0.95  # the share of a right rule's cells that pass despite noise
POWER = 0.90       # the detectable slowdown is the one caught this often


@dataclass(frozen=True)
class Decision:
    """One round of one cell, the rule's decision in it and the paired figures that judge it."""
    admitted: bool
    guarded_ratio: float  # guarded tier hit / guarded cold, this round
    control_ratio: float  # control tier hit / control cold, this round
    cold_ratio: float     # guarded cold / control cold: the noise between equal engines

    def wrong(self, margin: float, cap: float = CAP, declines: bool = True) -> bool:
        if self.admitted:
            return self.guarded_ratio > 1 + cap
        return declines and self.control_ratio < 1 - margin - cap


@dataclass
class CellVerdict:
    prefix: int
    multiple: float  # of the break-even prefix the cells were placed around
    decisions: list[Decision] = field(default_factory=list)
    wrong: int = 0
    allowed: int = 0  # wrong rounds noise explains at CONFIDENCE
    detectable: float = math.inf  # the smallest slowdown this cell shows (0.25: 25% slower)

    @property
    def failed(self) -> bool:
        return self.wrong > self.allowed

    @property
    def admitted(self) -> int:
        return sum(d.admitted for d in self.decisions)

    def describe(self) -> str:
        n = len(self.decisions)
        med = lambda xs: float(np.median(xs)) if xs else math.nan  # noqa: E731
        return (f"{self.prefix:,} tokens ({self.multiple:.2f} p*): {self.admitted}/{n} admitted, {self.wrong}/{n} wrong "
                f"(noise explains {self.allowed}); control hit/cold {med([d.control_ratio for d in self.decisions]):.2f}, "
                f"guarded {med([d.guarded_ratio for d in self.decisions]):.2f}; detects a slowdown from "
                f"{self.detectable:.0%}")


def binomial_tail(n: int, p: float, k: int) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def allowed_wrong(n: int, p0: float, confidence: float = CONFIDENCE) -> int:
    """The most wrong rounds of n that noise at rate p0 explains: more has probability below 1 - confidence."""
    k = 0
    while k < n and binomial_tail(n, p0, k + 1) >= 1 - confidence:
        k += 1
    return k


def noise(cells: dict[int, list[Decision]], cap: float = CAP) -> tuple[float, float]:
    """(p0, sigma): how often a round's control ratio lies more than the cap from its cell's median, and the
    spread of those log deviations, robust to the odd outlier (1.4826 x their median absolute value, the
    normal's sd; one slow load in 30 rounds must not make every cell blind)."""
    logs, dof = [], 0
    for ds in cells.values():
        ratios = [d.control_ratio for d in ds if d.control_ratio > 0]
        if len(ratios) < 2:
            continue
        centre = float(np.median(ratios))
        logs += [math.log(r / centre) for r in ratios]
        dof += len(ratios) - 1
    beyond = sum(abs(x) > math.log(1 + cap) for x in logs)
    p0 = (beyond + 1) / (len(logs) + 2)
    # Each cell's median is fitted: n / (n - 1) for the deviations it zeroes.
    sigma = 1.4826 * float(np.median(np.abs(logs))) * math.sqrt(len(logs) / dof) if dof else math.inf
    return p0, sigma


def detectable_slowdown(n: int, allowed: int, sigma: float, cap: float = CAP, power: float = POWER) -> float:
    """The true slowdown d (hit/cold = 1 + d) at which more than `allowed` of n rounds land above 1 + cap
    with probability `power`, each round's log ratio normal around log(1 + d) with spread sigma."""
    if not math.isfinite(sigma) or allowed >= n:
        return math.inf
    for step in range(1, 1001):
        d = step / 200  # 0.5% steps up to 5x slower
        z = (math.log(1 + d) - math.log(1 + cap)) / max(sigma, 1e-6)
        q = 0.5 * (1 + math.erf(z / math.sqrt(2)))
        if binomial_tail(n, q, allowed + 1) >= power:
            return d
    return math.inf


def judge(cells: dict[int, list[Decision]], multiples: dict[int, float], margin: float, cap: float = CAP,
          confidence: float = CONFIDENCE, p0: float | None = None, declines: bool = True) -> list[CellVerdict]:
    """Each cell's decisions judged against noise measured over all of them (or the given p0). Without
    `declines` only admitted rounds can be wrong: behind a queue, a rule that does not count the queue
    (static, online) is not meant to take the loads the queue hides."""
    measured_p0, sigma = noise(cells, cap)
    p0 = measured_p0 if p0 is None else p0
    verdicts = []
    for prefix in sorted(cells):
        ds = cells[prefix]
        v = CellVerdict(prefix, multiples.get(prefix, math.nan), list(ds), sum(d.wrong(margin, cap, declines) for d in ds),
                        allowed_wrong(len(ds), p0, confidence))
        v.detectable = detectable_slowdown(len(ds), v.allowed, sigma, cap)
        verdicts.append(v)
    return verdicts


def failures(verdicts: list[CellVerdict]) -> list[str]:
    return [v.describe() for v in verdicts if v.failed]

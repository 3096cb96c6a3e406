"""Every admission decision judged, and what noise explains.

A round of a frontier cell pairs, in time, the guarded server (the rule under test) with the control (every
load taken), each a tier-only hit and a cold request of the same prompt length:

- an admitted round is wrong when its hit was slower than the cold request beside it by more than the cap
  (guarded hit / guarded cold > 1 + cap);
- a declined round is wrong when the control's load of the same cell, in the same round, paid by more than
  the rule's margin plus the cap (control hit / control cold < 1 - margin - cap): only then did declining
  cost something the rule was meant to take.

A right rule can still look wrong in a round by noise. How often is measured, not assumed, and on the side
that matters (analysis/wrong_rounds.py): an admitted round looks wrong when its ratio strays above its cell's
median by more than the cap, a declined one when it strays below by more than the cap leaves of 1 - margin;
each rate is the share of all frontier rounds' control ratios (hit / cold) that stray so far that way
(a Laplace estimate). That is the rate for a cell at the break-even; a cell whose control rounds put it
clearly on the right side of its decision's threshold (a one-sided bound on their median) needs a larger
stray to look wrong, and its rate is read at that distance (Noise.cell_rates). Cold requests of the two servers are not compared: two servers of one build may
differ in speed, which moves neither server's own hit/cold ratio. A cell fails when its wrong rounds are
more than noise reaches with probability 1 - CONFIDENCE: at 95%, with rates near 3% and five rounds, two
wrong rounds fail a cell and one does not. Not by majority vote: a rule wrong in 2 rounds of 5 fails.

The allowance is bounded by the power it leaves: a cell whose detectable miss (the true slowdown, or
forgone gain, whose rounds exceed the allowance with 90% probability, read from the same deviations as the
rates, on the sides its decisions took) exceeds twice the cap is undecided, not passed; a heavy tail widens
the allowance and the power alike (docs/notes/2026-12-07-admission-power.md). Rounds until decided (until_decided): every frontier cell is judged at its first
look; an undecided one is measured again, MORE_ROUNDS times its rounds, and judged once more on all of them.
The 5% a right rule may be failed by noise is split over the two looks (LOOKS: 4% then 1%, a Bonferroni
split), so a second look cannot add to it; a failed cell is never measured again, so a miss cannot turn into
a pass; what is still undecided after the second look fails the suite, naming the cell.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pytest_kvoffload.analysis import wrong_rounds
from pytest_kvoffload.analysis.intervals import median_bound
from pytest_kvoffload.analysis.outcome import MET, MISSED, UNDECIDED
from pytest_kvoffload.core.tolerances import ADMISSION_CAP

CAP = ADMISSION_CAP  # a hit up to 10% slower than recompute is within the suite's tolerance (core/tolerances.py)
CONFIDENCE = 0.95  # the share of a right rule's cells that pass despite noise
POWER = 0.90       # the detectable slowdown is the one caught this often
# Each look's confidence: CONFIDENCE's 5% split 4% + 1% (most where every cell is judged).
LOOKS = (0.96, 0.99)
MORE_ROUNDS = 3    # an undecided cell's second look adds three times its rounds (5 -> 20)


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
    cap: float = CAP
    looks: int = 1  # 2: measured again because the first look left it undecided

    @property
    def failed(self) -> bool:
        return self.wrong > self.allowed

    @property
    def undecided(self) -> bool:
        """Not failed, yet too noisy to pass: blind to a miss of twice the cap."""
        return not self.failed and self.detectable > 2 * self.cap

    @property
    def outcome(self) -> str:
        return MISSED if self.failed else UNDECIDED if self.undecided else MET

    @property
    def admitted(self) -> int:
        return sum(d.admitted for d in self.decisions)

    def describe(self) -> str:
        n = len(self.decisions)
        med = lambda xs: float(np.median(xs)) if xs else math.nan  # noqa: E731
        return (f"{self.outcome}: {self.prefix:,} tokens ({self.multiple:.2f} p*): {self.admitted}/{n} admitted, {self.wrong}/{n} wrong "
                f"(noise explains {self.allowed}); control hit/cold {med([d.control_ratio for d in self.decisions]):.2f}, "
                f"guarded {med([d.guarded_ratio for d in self.decisions]):.2f}; detects a slowdown from "
                f"{self.detectable:.0%}" + (" (second look)" if self.looks > 1 else ""))


@dataclass(frozen=True)
class Noise:
    """How often a right decision looks wrong by noise, on each side, and the rounds' spread."""
    up: float     # the share of rounds above their cell's median by more than the cap (admitted looks wrong)
    down: float   # ... below it by more than a decline's threshold (declined looks wrong)
    sigma: float  # the log ratios' spread around their cells' medians
    rounds: int
    deviations: tuple[float, ...] = ()  # every control round's log deviation from its cell's median

    def allowed(self, admitted: int, declined: int, confidence: float = CONFIDENCE) -> int:
        return wrong_rounds.allowed_wrong(admitted, declined, self.up, self.down, confidence)

    def detectable(self, n: int, allowed: int, admitted: bool, declined: bool, cap: float = CAP,
                   power: float = POWER) -> float:
        """The smallest miss a cell of n rounds with `allowed` shows, on the worse of the sides its decisions
        took (admitted: a slowdown; declined: a forgone gain); read from the deviations, or from a normal
        model of sigma where the noise is given as rates and a spread alone."""
        if len(self.deviations) < 2:
            return wrong_rounds.detectable_slowdown(n, allowed, self.sigma, cap, power)
        sides = [upper for upper, took in ((True, admitted), (False, declined)) if took] or [True]
        return max(wrong_rounds.detectable_from(n, allowed, list(self.deviations), cap, power, upper)
                   for upper in sides)

    def cell_rates(self, control_ratios: list[float], margin: float, cap: float = CAP) -> tuple[float, float]:
        """How often noise makes one of this cell's right decisions look wrong, each side: the cell's centre
        taken as near that side's threshold as its rounds allow (a one-sided bound on the control's median)
        and never nearer than the break-even, where `up` and `down` are read. A cell clearly on the right
        side allows fewer wrong rounds; one at or past the break-even (a wrong rule's) allows as many as
        before."""
        if not self.deviations or len(control_ratios) < 2:
            return self.up, self.down
        high = median_bound(control_ratios, upper=True) or math.inf
        low = median_bound(control_ratios, upper=False) or 0.0
        up = math.log(1 + cap) - math.log(min(1.0, high))
        down = math.log(max(1e-6, 1 - margin - cap)) - math.log(max(1 - margin, low))
        return (wrong_rounds.side_rate(list(self.deviations), up, upper=True),
                wrong_rounds.side_rate(list(self.deviations), down, upper=False))


def noise(cells: dict[int, list[Decision]], margin: float = 0.0, cap: float = CAP) -> Noise:
    """The control's hit/cold ratios' deviations from their cells' medians, read on each side (the module's
    doc); one slow load in 30 rounds must not make every cell blind, so sigma is robust."""
    logs, fitted = [], 0
    for ds in cells.values():
        ratios = [d.control_ratio for d in ds if d.control_ratio > 0]
        if len(ratios) < 2:
            continue
        centre = float(np.median(ratios))
        logs += [math.log(r / centre) for r in ratios]
        fitted += 1
    down = math.log(max(1e-6, 1 - cap / max(1e-6, 1 - margin)))
    return Noise(wrong_rounds.side_rate(logs, math.log(1 + cap), upper=True),
                 wrong_rounds.side_rate(logs, down, upper=False), wrong_rounds.robust_sigma(logs, fitted), len(logs),
                 tuple(logs))


def detectable_slowdown(n: int, allowed: int, sigma: float, cap: float = CAP, power: float = POWER) -> float:
    return wrong_rounds.detectable_slowdown(n, allowed, sigma, cap, power)


def judge(cells: dict[int, list[Decision]], multiples: dict[int, float], margin: float, cap: float = CAP,
          confidence: float = CONFIDENCE, measured: Noise | None = None, declines: bool = True) -> list[CellVerdict]:
    """Each cell's decisions judged against noise measured over all of them, or `measured` (the queue cells
    are judged with the frontier's). Without `declines` only admitted rounds can be wrong: behind a queue, a
    rule that does not count the queue (static, online) is not meant to take the loads the queue hides."""
    measured = noise(cells, margin, cap) if measured is None else measured
    verdicts = []
    for prefix in sorted(cells):
        ds = cells[prefix]
        admitted = sum(d.admitted for d in ds)
        up, down = measured.cell_rates([d.control_ratio for d in ds if d.control_ratio > 0], margin, cap)
        allowed = wrong_rounds.allowed_wrong(admitted, len(ds) - admitted if declines else 0, up, down, confidence)
        v = CellVerdict(prefix, multiples.get(prefix, math.nan), list(ds), sum(d.wrong(margin, cap, declines) for d in ds),
                        allowed, cap=cap)
        v.detectable = measured.detectable(len(ds), v.allowed, admitted > 0, declines and admitted < len(ds), cap)
        verdicts.append(v)
    return verdicts


def decisions(control: dict, guarded: dict, ratio_of) -> dict[int, list[Decision]]:
    """Each guarded round paired with the control's round of the same prefix and index; `ratio_of(round)` gives
    (admitted, hit/cold, cold seconds)."""
    out = {}
    for prefix, rounds in guarded.items():
        paired = zip(rounds, control.get(prefix, []))
        out[prefix] = [Decision(bool(g_admitted), g_ratio, c_ratio, g_cold / c_cold)
                       for (g_admitted, g_ratio, g_cold), (_, c_ratio, c_cold)
                       in ((ratio_of(g), ratio_of(c)) for g, c in paired)]
    return out


def failures(verdicts: list[CellVerdict]) -> list[str]:
    """The cells wrong beyond noise."""
    return [v.describe() for v in verdicts if v.failed]


def undecided(verdicts: list[CellVerdict]) -> list[str]:
    """The cells too noisy to pass, after their second look: not a pass (the suite fails naming them)."""
    return [v.describe() for v in verdicts if v.undecided]


def until_decided(cells: dict[int, list[Decision]], multiples: dict[int, float], margin: float,
                  measure_more: Callable[[list[int], int], dict[int, list[Decision]]], measured: Noise | None = None,
                  declines: bool = True) -> tuple[list[CellVerdict], Noise]:
    """The cells judged at their first look (LOOKS[0]); those left undecided measured again
    (measure_more(prefixes, rounds) returns every cell's decisions after them) and judged on all their
    rounds at LOOKS[1]. Noise is the cells' own, or `measured` at both looks (the queue cells are judged with
    the frontier's). Returns the verdicts and the first look's noise."""
    first_noise = noise(cells, margin) if measured is None else measured
    first = judge(cells, multiples, margin, confidence=LOOKS[0], measured=first_noise, declines=declines)
    again = [v.prefix for v in first if v.undecided]
    if not again:
        return first, first_noise
    more = measure_more(again, MORE_ROUNDS * max(len(cells[p]) for p in again))
    second = judge({p: more[p] for p in again}, multiples, margin, confidence=LOOKS[1],
                   measured=noise(more, margin) if measured is None else measured, declines=declines)
    by_prefix = {v.prefix: dataclasses.replace(v, looks=2) for v in second}
    return [by_prefix.get(v.prefix, v) for v in first], first_noise

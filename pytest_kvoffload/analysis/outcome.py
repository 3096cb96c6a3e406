"""The three outcomes of a verdict and the one rule that gives them.

A verdict is on a ratio that must be at most a limit (a TTFT over its bound, a new run over the old one, a
hit over its recompute), with an interval [low, high] at core/tolerances.CONFIDENCE:

- met: the whole interval is at most the limit;
- missed: the estimate is past the limit and the interval is past `null` (1: no difference), so the
  excess is both larger than allowed and shown at that confidence;
- undecided: neither; more rounds narrow the interval until one holds (or the cap on rounds is reached,
  and undecided is what is reported: it is not a pass).

`detects_from` is the verdict's power, stated: the smallest ratio this interval's width would call missed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MET, MISSED, UNDECIDED = "met", "missed", "undecided"
OUTCOMES = (MET, MISSED, UNDECIDED)


@dataclass(frozen=True)
class Verdict:
    what: str
    outcome: str
    estimate: float
    low: float | None
    high: float | None
    limit: float
    detects_from: float | None
    rounds: int | None = None
    how: str = ""  # which interval: "paired median, distribution-free", "pooled noise, t", ...

    @property
    def decided(self) -> bool:
        return self.outcome != UNDECIDED

    def interval_text(self) -> str:
        def side(value):
            return "?" if value is None or not math.isfinite(value) else f"{value:.3f}"
        return f"[{side(self.low)}, {side(self.high)}]"

    def text(self) -> str:
        """One line: outcome, estimate, interval, limit, power."""
        power = (f"detects from {self.detects_from:.3f}" if self.detects_from is not None
                 and math.isfinite(self.detects_from) else "cannot detect a miss at this width")
        rounds = f", {self.rounds} rounds" if self.rounds else ""
        return (f"{self.outcome.upper() if self.outcome != MET else MET}: {self.what} {self.estimate:.3f} "
                f"{self.interval_text()} against at most {self.limit:.3f} ({power}{rounds})")

    def to_dict(self) -> dict:
        return asdict(self)


def at_most(what: str, estimate: float, low: float | None, high: float | None, limit: float, null: float = 1.0,
            rounds: int | None = None, how: str = "") -> Verdict:
    """The verdict on a ratio that must be at most `limit` (see the module's rule)."""
    if high is not None and high <= limit:
        outcome = MET
    elif low is not None and low > null and estimate > limit:
        outcome = MISSED
    else:
        outcome = UNDECIDED
    return Verdict(what, outcome, estimate, low, high, limit, detects_from(estimate, low, limit, null), rounds, how)


def detects_from(estimate: float, low: float | None, limit: float, null: float = 1.0) -> float | None:
    """The smallest ratio called missed at this interval's relative width below its estimate: past the limit,
    and far enough past `null` that the lower side clears it."""
    if low is None or not low > 0 or not math.isfinite(low) or estimate <= 0:
        return None
    return max(limit, null * estimate / low)


def worst(verdicts: list[Verdict]) -> str:
    """The run's outcome over several verdicts: missed if any is, else undecided if any is, else met."""
    outcomes = {v.outcome for v in verdicts}
    return MISSED if MISSED in outcomes else UNDECIDED if UNDECIDED in outcomes else MET

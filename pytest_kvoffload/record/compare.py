"""Two runs side by side, cell by cell: the "before an upgrade" check and the nightly gate.

A cell is called slower or faster only when its change exceeds the noise both runs measured:
noise = max(floor, 2 x sqrt(spread_base^2 + spread_new^2)), spreads being each cell's relative half
inter-quartile range. The gate has a hard limit that noise cannot widen: a cell slower than
--fail-above fails, however noisy; noise can only make a verdict "undecided" (a change within the noise
that the noise cannot rule out being beyond the limit), which is reported, not passed silently.
Comparing each night with a pinned baseline as well as with the previous night stops slow drift
(5% a night passes every night-to-night gate at 10%, and fails against the pin on the second night).

Only user-facing backends are compared (Backend.user_facing, recorded per backend in run.json): the
admission suite's emulated drives, planted rules, fault servers and A/B twins are re-derived every run,
and some exist only on some nights. p50 and p90 are compared, each against its own limit. Exit codes of
`kvoffload compare`: 0 pass, 1 a regression or a missing backend, 2 bad input, 3 undecided cells only (the
nightly workflow reruns with more rounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KEY = ("backend", "length", "fraction", "state")
NOISE_FLOOR = 0.02


class CompareError(ValueError):
    pass


STATS = ("p50", "p90")
UNDECIDED_EXIT = 3


@dataclass(frozen=True)
class CellChange:
    key: tuple
    base_s: float
    new_s: float
    tolerance: float
    stat: str = "p50"

    @property
    def ratio(self) -> float:
        return self.new_s / self.base_s if self.base_s > 0 else math.inf

    def verdict(self, fail_above: float) -> str:
        if self.ratio > 1 + fail_above:
            return "slower beyond the limit"
        if self.ratio > 1 + self.tolerance:
            return "slower"
        if self.ratio < 1 - self.tolerance:
            return "faster"
        if self.ratio + self.tolerance > 1 + fail_above:
            return "undecided"  # within the noise, and the noise reaches past the limit
        return "within noise"


def check_comparable(base: dict, new: dict, force: bool = False) -> None:
    if force:
        return
    bm = (base.get("options") or {}).get("model", {}).get("name")
    nm = (new.get("options") or {}).get("model", {}).get("name")
    if bm != nm:
        raise CompareError(f"the runs measured different models ({bm} vs {nm}); pass --force to compare anyway")
    if base.get("schema_version") != new.get("schema_version"):
        raise CompareError(
            f"the runs have schema versions {base.get('schema_version')} and {new.get('schema_version')}; "
            "pass --force to compare anyway")


def gated_backends(base: dict, new: dict) -> set[str]:
    """Backends either run measured that both runs call user-facing (a record without the flag, from
    before it existed, counts as user-facing)."""
    def flags(run):
        return {name: entry.get("user_facing", True) for name, entry in (run.get("backends") or {}).items()}

    fb, fn = flags(base), flags(new)
    names = {c["backend"] for run in (base, new) for c in run.get("cells") or []}
    return {name for name in names if fb.get(name, True) and fn.get(name, True)}


def compare(base: dict, new: dict, floor: float = NOISE_FLOOR) -> tuple[list[CellChange], list[tuple], list[tuple]]:
    """Changes (p50, then p90) for gated cells in both runs, plus the keys only in the base and only in the new run."""
    gated = gated_backends(base, new)
    b = {tuple(c[k] for k in KEY): c for c in base.get("cells") or [] if c["backend"] in gated}
    n = {tuple(c[k] for k in KEY): c for c in new.get("cells") or [] if c["backend"] in gated}
    changes = []
    for key in sorted(set(b) & set(n), key=str):
        bt, nt = b[key]["ttft"], n[key]["ttft"]
        tolerance = max(floor, 2 * math.hypot(bt.get("spread", 0.0), nt.get("spread", 0.0)))
        for stat in STATS:
            if bt.get(stat) is not None and nt.get(stat) is not None:
                changes.append(CellChange(key, bt[stat], nt[stat], tolerance, stat))
    return changes, sorted(set(b) - set(n), key=str), sorted(set(n) - set(b), key=str)


def limit(stat: str, limits: dict[str, float] | float) -> float:
    return limits if isinstance(limits, (int, float)) else limits[stat]


def regressions(changes: list[CellChange], limits: dict[str, float] | float) -> list[CellChange]:
    """Cells slower than their statistic's limit, whatever the noise."""
    return [c for c in changes if c.ratio > 1 + limit(c.stat, limits)]


def undecided(changes: list[CellChange], limits: dict[str, float] | float) -> list[CellChange]:
    return [c for c in changes if c.verdict(limit(c.stat, limits)) == "undecided"]


def missing_backends(base: dict, new: dict) -> list[str]:
    """Gated backends the base measured (cells) that the new run did not."""
    gated = gated_backends(base, new)
    have = {c["backend"] for c in new.get("cells") or []}
    return sorted({c["backend"] for c in base.get("cells") or [] if c["backend"] in gated} - have)


def parse_percent(text: str, flag: str = "--fail-above") -> float:
    """'10%' or '0.1' -> 0.1"""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise CompareError(f"{flag} {text!r}: expected a percentage such as 10% or a fraction such as 0.1") from None
    if value < 0:
        raise CompareError(f"{flag} {text!r}: must not be negative")
    return value

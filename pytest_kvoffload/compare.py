"""Two runs side by side, cell by cell: the "before an upgrade" check and the nightly gate.

A cell is called slower or faster only when its change exceeds the noise both runs measured:
noise = max(floor, 2 x sqrt(spread_base^2 + spread_new^2)), spreads being each cell's relative half
inter-quartile range. The gate has a hard limit that noise cannot widen: a cell slower than
--fail-above fails, however noisy; noise can only make a verdict "undecided" (a change within the noise
that the noise cannot rule out being beyond the limit), which is reported, not passed silently.
Comparing each night with a pinned baseline as well as with the previous night stops slow drift
(5% a night passes every night-to-night gate at 10%, and fails against the pin on the second night).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KEY = ("backend", "length", "fraction", "state")
NOISE_FLOOR = 0.02


class CompareError(ValueError):
    pass


@dataclass(frozen=True)
class CellChange:
    key: tuple
    base_s: float
    new_s: float
    tolerance: float

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


def compare(base: dict, new: dict, floor: float = NOISE_FLOOR) -> tuple[list[CellChange], list[tuple], list[tuple]]:
    """Changes for cells in both runs, plus the keys only in the base and only in the new run."""
    b = {tuple(c[k] for k in KEY): c for c in base.get("cells") or []}
    n = {tuple(c[k] for k in KEY): c for c in new.get("cells") or []}
    changes = []
    for key in sorted(set(b) & set(n), key=str):
        bt, nt = b[key]["ttft"], n[key]["ttft"]
        tolerance = max(floor, 2 * math.hypot(bt.get("spread", 0.0), nt.get("spread", 0.0)))
        changes.append(CellChange(key, bt["p50"], nt["p50"], tolerance))
    return changes, sorted(set(b) - set(n), key=str), sorted(set(n) - set(b), key=str)


def regressions(changes: list[CellChange], fail_above: float) -> list[CellChange]:
    """Cells slower than the limit, whatever the noise."""
    return [c for c in changes if c.ratio > 1 + fail_above]


def undecided(changes: list[CellChange], fail_above: float) -> list[CellChange]:
    return [c for c in changes if c.verdict(fail_above) == "undecided"]


def missing_backends(base: dict, new: dict) -> list[str]:
    """Backends the base measured (cells) that the new run did not."""
    have = {c["backend"] for c in new.get("cells") or []}
    return sorted({c["backend"] for c in base.get("cells") or []} - have)


def parse_percent(text: str) -> float:
    """'10%' or '0.1' -> 0.1"""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise CompareError(f"--fail-above {text!r}: expected a percentage such as 10% or a fraction such as 0.1") from None
    if value < 0:
        raise CompareError(f"--fail-above {text!r}: must not be negative")
    return value

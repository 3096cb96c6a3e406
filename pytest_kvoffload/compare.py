"""Two runs side by side, cell by cell: the "before an upgrade" check.

A cell is called slower or faster only when its change exceeds the noise both runs measured:
tolerance = max(floor, 2 x sqrt(spread_base^2 + spread_new^2)), spreads being each cell's relative
half inter-quartile range. The gate fails on cells that are slower beyond noise AND beyond --fail-above.
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

    @property
    def verdict(self) -> str:
        if self.ratio > 1 + self.tolerance:
            return "slower"
        if self.ratio < 1 - self.tolerance:
            return "faster"
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
    return [c for c in changes if c.verdict == "slower" and c.ratio - 1 > fail_above]


def parse_percent(text: str) -> float:
    """'10%' or '0.1' -> 0.1"""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise CompareError(f"--fail-above {text!r}: expected a percentage such as 10% or a fraction such as 0.1") from None
    if value < 0:
        raise CompareError(f"--fail-above {text!r}: must not be negative")
    return value

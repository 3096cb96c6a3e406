"""Two runs side by side: the "before an upgrade" check and the nightly gate, decided through the decision layer (analysis/outcome.py).

The gate decides per backend and state (a backend's TTFT in one state across the grid) and per cell, each a
ratio new / base of median TTFT with bounds on the noise both runs measured, pooled over cells
(analysis/pooled_noise.py says why and what it assumes; noise_group says which cells share it). Each comes
out met (the upper bound within --fail-above), missed (past the limit, and the lower bound past half of it:
shown) or undecided; each bound is one-sided at 95% (the printed interval is a 90% one), since met and missed
are each a one-sided test (two-sided bounds left a run of 3 rounds undecided against itself). A cell's lower
bound is at 95% over all the cells compared (cell_low_confidence), so a cell fails the gate only where its
slowdown is shown across them; a cell not resolved is left to its group, which pools the grid's cells and is
narrower, so it neither fails nor holds the gate open on its own. A p90 is
compared only where both runs have core/tolerances.GATE_P90_ROUNDS rounds of the cell (else it says so),
with distribution-free intervals on each run's p90. Comparing each night with a pinned baseline as well as
with the previous night stops slow drift (5% a night passes each night-to-night gate, not the pin).

Only user-facing backends are compared (Backend.user_facing, recorded per backend in run.json): the
admission suite's emulated drives, planted rules, fault servers and A/B twins are re-derived every run.
Exit codes of `kvoffload compare`: 0 pass, 1 a miss or a missing backend, 2 bad input, 3 undecided (not a
pass: the nightly workflow reruns with more rounds).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from pytest_kvoffload.core.tolerances import CONFIDENCE, GATE_P90_ROUNDS
from pytest_kvoffload.analysis.intervals import quantile_interval
from pytest_kvoffload.analysis.outcome import MISSED, UNDECIDED, Verdict, at_most
from pytest_kvoffload.analysis.pooled_noise import Noise, cell_change, group_change

KEY = ("backend", "length", "fraction", "state")
UNDECIDED_EXIT = 3
# A run recorded with cells only (no rounds): a cell's relative half inter-quartile range is 0.6745 sigma.
IQR_SIGMA = 0.6745


class CompareError(ValueError):
    pass


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


def cell_rounds(run: dict, gated: set[str]) -> dict[tuple, list[float]]:
    """Each gated cell's measured, verified TTFTs (seconds); a run recorded without its rounds gets, per cell,
    stand-in rounds with the cell's median and spread (the median, and +-1 sigma pairs)."""
    rounds: dict[tuple, list[float]] = defaultdict(list)
    for m in run.get("measurements") or []:
        if m["backend"] in gated and m.get("purpose", "measure") == "measure" and m.get("verified") is not False:
            rounds[tuple(m[k] for k in KEY)].append(float(m["client_ttft_s"]))
    for cell in run.get("cells") or []:
        key = tuple(cell[k] for k in KEY)
        if cell["backend"] in gated and key not in rounds:
            t = cell["ttft"]
            sigma = math.log1p(t.get("spread", 0.0) / IQR_SIGMA)
            n = max(1, int(t.get("n", 1)))
            # n values whose log mean is log p50 and whose standard deviation is sigma (n - 1 degrees of freedom).
            offsets = [0.0] * n if n < 2 else list(np.linspace(-1, 1, n) * sigma / np.std(np.linspace(-1, 1, n), ddof=1))
            rounds[key] = [t["p50"] * math.exp(o) for o in offsets]
    return dict(rounds)


@dataclass(frozen=True)
class Comparison:
    groups: list[Verdict]          # per backend and state
    cells: list[tuple[tuple, Verdict, float, float]]  # key, verdict, base and new medians (s)
    p90: list[tuple[tuple, Verdict]]
    p90_skipped: int               # cells whose rounds were too few for a p90
    only_base: list[tuple]
    only_new: list[tuple]
    noise: dict[tuple, Noise]

    def failures(self) -> list[Verdict]:
        return [v for v in self.groups + [c[1] for c in self.cells] + [p[1] for p in self.p90] if v.outcome == MISSED]

    def open(self) -> list[Verdict]:
        """What keeps the gate undecided: a group undecided, or a p90 undecided with its estimate past the
        limit. A cell not resolved is its group's to decide: with 69 cells of 3 rounds at 5% noise a round,
        some cell's estimate lies past 10% in most runs of one commit (simulated: tests/analysis)."""
        return ([g for g in self.groups if g.outcome == UNDECIDED]
                + [v for _, v in self.p90 if v.outcome == UNDECIDED and v.estimate > v.limit])


def _median(values: list[float]) -> float:
    return float(np.median(values))


def compare(base: dict, new: dict, limit: float, p90_limit: float | None = None) -> Comparison:
    """The verdicts of new against base, each "at most 1 + limit" (p90: 1 + p90_limit)."""
    gated = gated_backends(base, new)
    b, n = cell_rounds(base, gated), cell_rounds(new, gated)
    both = sorted(set(b) & set(n), key=lambda k: (k[0], k[3], k[1], k[2]))
    by_group: dict[tuple, list[tuple]] = defaultdict(list)
    for key in both:
        by_group[(key[0], key[3])].append(key)
    by_noise: dict[tuple, list[tuple]] = defaultdict(list)
    for key in both:
        by_noise[noise_group(key)].append(key)
    noise = {g: Noise.pooled([b[k] for k in keys] + [n[k] for k in keys]) for g, keys in by_noise.items()}
    if same_rounds(base, new):
        # One run's rounds on both sides: each ratio is exactly 1, with no noise between them to bound.
        noise = {g: Noise(0.0, 0.0, model.df or 1, model.stalled) for g, model in noise.items()}
    groups, cells = [], []
    for (backend, state), keys in sorted(by_group.items()):
        model = noise[noise_group(keys[0])]
        change = group_change([(b[k], n[k]) for k in keys], model)
        groups.append(at_most(f"{backend} {state} over {len(keys)} cell(s)", change.estimate, change.low,
                              change.high, 1 + limit, null=shown(limit), rounds=sum(change.rounds),
                              how="pooled noise, t"))
        for k in keys:
            c = cell_change(b[k], n[k], model, cell_low_confidence(len(both)))
            cells.append((k, at_most("/".join(map(str, k)), c.estimate, c.low, c.high, 1 + limit, null=shown(limit),
                                     rounds=sum(c.rounds), how="pooled noise, t"), _median(b[k]), _median(n[k])))
    p90, skipped = [], 0
    for key in both:
        if min(len(b[key]), len(n[key])) < GATE_P90_ROUNDS:
            skipped += 1
            continue
        p90.append((key, p90_verdict(key, b[key], n[key], limit if p90_limit is None else p90_limit)))
    return Comparison(groups, cells, p90, skipped, sorted(set(b) - set(n), key=str), sorted(set(n) - set(b), key=str),
                      noise)


def cell_low_confidence(cells: int) -> float:
    """The confidence of a cell's lower bound where `cells` are compared at once: CONFIDENCE's error split over
    them (Bonferroni), so that a run of one commit fails through some cell at most 5% of the time."""
    return 1 - (1 - CONFIDENCE) / max(1, cells)


def same_rounds(base: dict, new: dict) -> bool:
    """Whether both records are one run: its id and every measured round the same."""
    return base.get("run_id") == new.get("run_id") and base.get("measurements") == new.get("measurements")


def shown(limit: float) -> float:
    """What a miss must be shown to exceed at 95% besides its estimate being past the limit: half the limit.
    With "slower at all" instead, a real slowdown of 8% in noise of 8% was called a 10% miss in half of the
    seeds (tests/analysis/test_run_gate.py); a miss is then a slowdown past the limit and shown to be a real
    part of it."""
    return 1 + limit / 2


def noise_group(key: tuple) -> tuple:
    """Which cells share a noise model: cold and engine-hit requests are the engine alone, the same on every
    backend (suites/test_equal_engines.py checks it), so they pool over backends; a tier hit's noise is its
    tier's, so tier hits pool per backend."""
    backend, _, _, state = key
    return (backend, state) if state == "tier-hit" else ("every backend", state)


def p90_verdict(key: tuple, base: list[float], new: list[float], limit: float) -> Verdict:
    """new p90 / base p90; each side of its interval from one-sided distribution-free bounds on the two p90s
    at 97.5% (together at least 95%: met and missed are each one-sided)."""
    side = 1 - (1 - CONFIDENCE) / 2
    bl, bh = quantile_interval(base, 0.9, side)
    nl, nh = quantile_interval(new, 0.9, side)
    estimate = float(np.percentile(new, 90) / np.percentile(base, 90))
    low = nl / bh if nl is not None and bh else None
    high = nh / bl if nh is not None and bl else None
    return at_most("/".join(map(str, key)) + " p90", estimate, low, high, 1 + limit, null=shown(limit),
                   rounds=len(base) + len(new), how="p90s, distribution-free")


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

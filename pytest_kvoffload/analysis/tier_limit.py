"""Each tier against its physical limit, cell by cell, paired round by round.

A tier hit can be no faster than its server's engine hit of the same cell (the same suffix computed, the
prefix already in the engine's cache) plus the time its medium takes to deliver the cached tokens' bytes:
the drive's read rate for a disk tier, the host's copy rate for a DRAM one (both measured by the run:
harness/environment.py). Each tier-hit round is followed by that engine hit on the same server
(measure/runner.CellRunner, paired_engine), so the ratio

    tier hit / (engine hit + bytes / rate)

is paired within the round: the engine drifting between the grid's passes cancels. A ratio of 1 is a tier
at its medium's rate with nothing else in the way; under 1, the tier read faster than the figure the run
has for its medium (a page cache, a drive figure that is low).

Verdict per cell with enough rounds for it (6 or more; the TTFT suite measures our whole-prefix cells to
20): the median ratio with one-sided distribution-free 95% bounds (order statistics), which a stalled round
cannot move (rounds stall: docs/notes/2026-12-07-tier-limits.md). A cell with the grid's 2 or 3 rounds: the
mean of its rounds' log ratios with a one-sided t bound each side at 95%, the spread pooled over one
backend's cells of one cached fraction (stated: rounds of one server at one fraction vary alike across
lengths, as the gate's pooled noise assumes; a hit with a suffix to compute varies as that prefill does,
more than a whole-prefix hit). The lower bound is split over the backend's cells (Bonferroni, as run_gate
does); met at most core/tolerances.TIER_LIMIT_RATIO, through analysis/outcome.at_most.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from pytest_kvoffload.analysis.intervals import fewest_for_median_interval, median_bound, t_bound_halfwidth
from pytest_kvoffload.analysis.outcome import Verdict, at_most
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.core.tolerances import CONFIDENCE, TIER_LIMIT_RATIO

# vLLM's source label of a DRAM (host) tier; every other tier is read at the drive's rate.
HOST = "host"
DRIVE = "drive"
# The purpose of the TTFT suite's extra paired rounds (suite_machinery/ttft_limits.py): kept out of the grid's
# cells, judged here with its rounds.
LIMIT_PURPOSE = "tier-limit"


@dataclass(frozen=True)
class LimitRound:
    tier_s: float
    engine_s: float
    tier_tokens: float

    def limit_s(self, kv_bytes_per_token: float, gbps: float) -> float:
        return self.engine_s + self.tier_tokens * kv_bytes_per_token / (gbps * 1e9)


def medium(tier: str | None) -> str:
    """Which rate a tier's limit reads its bytes at: the host's copy rate or the drive's."""
    return HOST if tier == HOST else DRIVE


def paired_rounds(measurements: list[dict]) -> dict[tuple[str, int, float], list[LimitRound]]:
    """(backend, length, fraction) -> its verified tier-hit rounds that carry a verified engine hit beside."""
    cells: dict[tuple[str, int, float], list[LimitRound]] = defaultdict(list)
    for m in measurements:
        if (m.get("purpose", "measure") not in ("measure", LIMIT_PURPOSE) or m.get("state") != State.TIER_HIT.value
                or m.get("verified") is False or m.get("engine_beside_s") is None or m.get("engine_beside_problem")):
            continue
        tokens = sum(v for s, v in (m.get("cached_by_source") or {}).items() if s != "device")
        cells[(m["backend"], m["length"], m["fraction"])].append(
            LimitRound(m["client_ttft_s"], m["engine_beside_s"], tokens))
    return dict(cells)


def _pooled_sd(groups: list[np.ndarray]) -> tuple[float, int]:
    """The pooled standard deviation of the groups' values around their own means, and its degrees of freedom."""
    df = sum(len(g) - 1 for g in groups)
    if df < 1:
        return math.inf, 0
    return math.sqrt(sum(float(((g - g.mean()) ** 2).sum()) for g in groups) / df), df


def backend_verdicts(backend: str, cells: dict[tuple[int, float], list[LimitRound]], kv_bytes_per_token: float,
                     gbps: float, limit: float = TIER_LIMIT_RATIO) -> list[dict]:
    """One backend's cells against their limit: each cell's ratios, its Verdict's fields and its rounds."""
    logs = {key: np.log([r.tier_s / r.limit_s(kv_bytes_per_token, gbps) for r in rounds])
            for key, rounds in sorted(cells.items()) if rounds}
    pooled = {f: _pooled_sd([x for (_, fraction), x in logs.items() if fraction == f])
              for f in {fraction for _, fraction in logs}}
    low_confidence = 1.0 - (1.0 - CONFIDENCE) / max(1, len(logs))
    rows = []
    for (length, fraction), x in logs.items():
        rounds = cells[(length, fraction)]
        fields = {"backend": backend, "length": length, "fraction": fraction, "ratios": np.exp(x).tolist(),
                  "tier_s": [r.tier_s for r in rounds], "engine_s": [r.engine_s for r in rounds],
                  "limit_s": [r.limit_s(kv_bytes_per_token, gbps) for r in rounds]}
        if len(x) >= fewest_for_median_interval():
            ratios = fields["ratios"]
            verdict = at_most(f"{backend} {length} x {fraction:g} tier hit / its limit", float(np.median(ratios)),
                              median_bound(ratios, upper=False, confidence=low_confidence),
                              median_bound(ratios, upper=True), limit, rounds=len(x),
                              how="paired with its engine hit, median, distribution-free")
            rows.append({**fields, **_fields(verdict)})
            continue
        sd, df = pooled[fraction]
        se = sd / math.sqrt(len(x)) if math.isfinite(sd) else math.inf
        low_half = t_bound_halfwidth(se, df, low_confidence) if math.isfinite(se) else math.inf
        high_half = t_bound_halfwidth(se, df, CONFIDENCE) if math.isfinite(se) else math.inf
        mean = float(x.mean())
        verdict = at_most(f"{backend} {length} x {fraction:g} tier hit / its limit", math.exp(mean),
                          math.exp(mean - low_half), math.exp(mean + high_half) if math.isfinite(high_half) else None,
                          limit, rounds=len(x), how=f"paired with its engine hit, noise pooled over the "
                                                     f"backend's cells at this fraction (t, {df} df)")
        rows.append({**fields, **_fields(verdict)})
    return rows


def _fields(verdict: Verdict) -> dict:
    d = verdict.to_dict()
    d.pop("what")
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def tier_limits(measurements: list[dict], tiers: dict[str, str], kv_bytes_per_token: float | None,
                rates: dict[str, float | None]) -> dict[str, dict]:
    """Every tier backend's cells against their limit: backend -> {"medium", "gbps", "cells"}; a backend
    whose medium has no rate in this run is left out (named with "reason")."""
    by_backend: dict[str, dict[tuple[int, float], list[LimitRound]]] = defaultdict(dict)
    for (backend, length, fraction), rounds in paired_rounds(measurements).items():
        by_backend[backend][(length, fraction)] = rounds
    found = {}
    for backend, cells in sorted(by_backend.items()):
        kind = medium(tiers.get(backend))
        gbps = rates.get(kind)
        if not gbps or not kv_bytes_per_token:
            found[backend] = {"medium": kind, "gbps": None, "cells": [],
                              "reason": f"this run has no {'host copy' if kind == HOST else 'drive'} rate"}
            continue
        found[backend] = {"medium": kind, "gbps": gbps,
                          "cells": backend_verdicts(backend, cells, kv_bytes_per_token, gbps)}
    return found


__all__ = ["DRIVE", "HOST", "LIMIT_PURPOSE", "LimitRound", "backend_verdicts", "medium", "paired_rounds", "tier_limits"]

"""The tiers-against-their-limits table of a run (analysis/tier_limit.py computed it into run.json's analysis):
one row per cell, one column per tier backend, each its paired ratio to its limit with its interval and
outcome; and the verdict block's line per backend."""

from __future__ import annotations

from tabulate import tabulate

from pytest_kvoffload.analysis.outcome import MET, MISSED, UNDECIDED
from pytest_kvoffload.core.tolerances import TIER_LIMIT_RATIO

SECTION = "tiers against their limits"


def limits_of(run: dict) -> dict[str, dict]:
    """backend -> its tier_limit entry, the backends users deploy only (no planted or emulated variants)."""
    backends = run.get("backends") or {}
    return {b: e["tier_limit"] for b, e in sorted((run.get("analysis") or {}).items())
            if isinstance(e, dict) and e.get("tier_limit") and (backends.get(b) or {}).get("user_facing", True)
            and "[" not in b and "~" not in b}


def _side(value) -> str:
    return "?" if value is None else f"{value:.2f}"


def _cell_text(cell: dict) -> str:
    outcome = cell["outcome"]
    mark = MET if outcome == MET else outcome.upper()
    return f"{cell['estimate']:.2f} [{_side(cell['low'])}, {_side(cell['high'])}] {mark}"


def rows_of(run: dict) -> tuple[list[str], list[dict]]:
    """(the backends, one row per cell: length, cached, each backend's cell or None, the one nearest its limit)."""
    limits = limits_of(run)
    names = list(limits)
    keys = sorted({(c["length"], c["fraction"]) for e in limits.values() for c in e["cells"]})
    by = {(b, c["length"], c["fraction"]): c for b, e in limits.items() for c in e["cells"]}
    rows = []
    for length, fraction in keys:
        found = [by.get((b, length, fraction)) for b in names]
        present = [(b, c) for b, c in zip(names, found) if c is not None]
        lowest = min(present, key=lambda bc: bc[1]["estimate"])[0] if present else "-"
        rows.append({"length": length, "cached": f"{fraction:g}", "cells": found, "lowest": lowest,
                     "texts": [_cell_text(c) if c else "-" for c in found]})
    return names, rows


def table_lines(run: dict) -> list[str]:
    limits = limits_of(run)
    if not limits:
        return []
    names, found = rows_of(run)
    rows = [[r["length"], r["cached"], *r["texts"], r["lowest"]] for r in found]
    media = "; ".join(f"{b}: {e['medium']} at {e['gbps']:.2f} GB/s" if e.get("gbps") else f"{b}: {e.get('reason')}"
                      for b, e in limits.items())
    return [f"{SECTION} (per round: the tier hit over its server's engine hit of the same cell, measured right "
            f"after it, plus the cached tokens' bytes at its medium's rate; with 6 rounds or more the median and its "
            f"one-sided distribution-free 95% bounds, with fewer the mean and t bounds, noise pooled over a "
            f"backend's cells of one fraction; met at most {TIER_LIMIT_RATIO:g}, missed past it "
            f"and past 1; under 1: read faster than the run's figure for its medium. Rates: {media})",
            tabulate(rows, headers=["length", "cached", *names, "nearest its limit"], disable_numparse=True), ""]


def verdict_lines(run: dict) -> list[tuple[str, str, str]]:
    """(outcome, what, figure) per backend: the worst of its cells."""
    lines = []
    for backend, entry in limits_of(run).items():
        cells = entry["cells"]
        if not cells:
            continue
        missed = [c for c in cells if c["outcome"] == MISSED]
        open_ = [c for c in cells if c["outcome"] == UNDECIDED]
        outcome = MISSED if missed else UNDECIDED if open_ else MET
        estimates = [c["estimate"] for c in cells]
        figure = (f"tier hit / limit {min(estimates):.2f} to {max(estimates):.2f} over {len(cells)} cells; "
                  f"{len(cells) - len(missed) - len(open_)} met, {len(missed)} missed, {len(open_)} undecided"
                  + "".join(f"; {'missed' if c['outcome'] == MISSED else 'undecided'} {c['length']} x "
                            f"{c['fraction']:g} ({c['estimate']:.2f})" for c in (missed + open_)[:3]))
        lines.append((outcome, f"{backend} against its limit (report-only)", figure))
    return lines


__all__ = ["SECTION", "limits_of", "rows_of", "table_lines", "verdict_lines"]

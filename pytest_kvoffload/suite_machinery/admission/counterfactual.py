"""A near miss judged on this run's own rounds: what another rule (a planted one, rigged/planted_admission.py)
would have decided in each frontier cell, on the calibration the guarded server read, judged as the suite
judges the rule under test. Where that rule would have loaded, the control's load of the same cell and
round (the control takes every load, on the same emulated drive) stands in for the guarded server's hit.

This puts a near-miss control through make test end to end for the cost of none: the rounds are the live
ones, the decisions the connector's own rule objects. Its own control: the rule under test, decided this
way, must decide every round as the guarded server did."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from pytest_kvoffload.analysis.intervals import median_bound
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.rigged.planted_admission import rule as rule_of
from pytest_kvoffload.suite_machinery.admission import judge


def decides(run, mode: str, kv_bytes_per_token: int) -> dict[int, bool]:
    """Frontier prefix -> whether `mode`'s rule admits its load (prompts of prefix + 1 tokens, all of them
    shared, nothing in the engine's cache)."""
    rule = rule_of(run.tier, kv_bytes_per_token, Counters(), mode)
    return {prefix: bool(rule(prefix, prefix + 1, 0)) for prefix in run.multiples}


def differs(run, mode: str, kv_bytes_per_token: int) -> list[int]:
    """The frontier prefixes where `mode` decides unlike the rule under test: none, and no verdict on this
    frontier can tell the two apart (its cells fall either side of where they differ)."""
    theirs, ours = decides(run, mode, kv_bytes_per_token), decides(run, run.mode, kv_bytes_per_token)
    return sorted(p for p in theirs if theirs[p] != ours[p])


def _control_ratios(run, prefix: int) -> list[float]:
    """The control's hit/cold ratios of one frontier cell, a round each (rounds that measured nothing left out)."""
    return [r.ratio for r in run.control.cells.get(prefix, []) if r.ratio > 0]


# A cell tells a near miss apart when this sure that its decision there is past the cap (module's doc).
TELLS = 0.8


def tells_apart(run, mode: str, kv_bytes_per_token: int) -> list[int]:
    """The frontier prefixes where `mode` decides unlike the rule under test and the control's rounds put
    `mode`'s decision past the cap (a one-sided TELLS bound on their median: of 5 rounds, 4), so that its
    rounds there come out wrong (4 of 5 wrong fail a cell or leave it undecided). A cell where the two rules
    part but the hit is within the cap either way (between 0.9 and 1.1 p*) judges neither wrong: it cannot
    tell them apart."""
    theirs, margin, found = decides(run, mode, kv_bytes_per_token), run.tier.get("margin", 0.0), []
    for p in differs(run, mode, kv_bytes_per_token):
        ratios = _control_ratios(run, p)
        bound = median_bound(ratios, upper=not theirs[p], confidence=TELLS) if len(ratios) >= 2 else None
        if bound is not None and (bound > 1 + judge.CAP if theirs[p] else bound < 1 - margin - judge.CAP):
            found.append(p)
    return found


def parting(run, mode: str, kv_bytes_per_token: int) -> str:
    """Where `mode` and the rule under test part on this frontier, and the control's hit/cold there."""
    cells = [f"{p:,} tokens ({run.multiples[p]:.2f} p*, control hit/cold "
             f"{float(np.median(_control_ratios(run, p) or [np.nan])):.2f})"
             for p in differs(run, mode, kv_bytes_per_token)]
    return f"{mode} parts from it at " + ", ".join(cells) if cells else f"{mode} parts from it in no cell"


def judged_as(run, mode: str, kv_bytes_per_token: int) -> list[judge.CellVerdict]:
    """The frontier's verdicts had `mode` been the rule, on the control's rounds."""
    admits = decides(run, mode, kv_bytes_per_token)
    cells = {p: [judge.Decision(admits[p], r.ratio, r.ratio, 1.0) for r in run.control.cells.get(p, [])]
             for p in run.multiples}
    return judge.judge({p: ds for p, ds in cells.items() if ds}, run.multiples, run.tier.get("margin", 0.0))


def unlike_live(run, kv_bytes_per_token: int) -> list[str]:
    """The stand-in's own control: each frontier cell where the rule under test, decided here, decides unlike
    the guarded server in any of its rounds (empty: faithful)."""
    admits = decides(run, run.mode, kv_bytes_per_token)
    return [f"{p} tokens: decided {'admit' if admits[p] else 'decline'} here, the guarded server "
            f"{sum(r.admitted for r in rounds)} of {len(rounds)} admitted"
            for p, rounds in sorted(run.guarded.cells.items()) if p in admits
            and any(r.admitted != admits[p] for r in rounds)]


# The near misses make test judges on every admission run: a rule 1.3x too cautious and one 0.75x too eager; the
# frontier places a cell for each where it parts from the right rule (derived_drive.telling_multiples).
NEAR_MISS_SCALES = (1.3, 0.75)
NEAR_MISSES = tuple(f"static:scale={scale}" for scale in NEAR_MISS_SCALES)


def _judged_against(run, mode: str) -> SimpleNamespace:
    """This run's frontier and control rounds, with `mode` in place of the rule under test."""
    return SimpleNamespace(tier=run.tier, multiples=run.multiples, control=run.control, mode=mode)


def _interpolated(run) -> callable:
    """The control's median hit/cold at any prefix, log-linear between this run's frontier cells."""
    cells = sorted((p, float(np.median(r))) for p in run.multiples if (r := _control_ratios(run, p)))
    xs, ys = [p for p, _ in cells], [math.log(r) for _, r in cells]
    return lambda p: math.exp(float(np.interp(p, xs, ys)))


def telling_cells(run, kv_bytes_per_token: int, unit: int, modes=NEAR_MISSES) -> list[int]:
    """A prefix (in whole `unit`s) for each of `modes`, and for a planted rule under test, that no frontier cell
    of this run tells apart from the right rule yet, where one would: the two decide differently there and the
    control's hit/cold so far (interpolated) is past the cap on the planted rule's wrong side; the middle of
    that span. The model placed the nearest cells (derived_drive.telling_multiples), but a run's ratios drift
    from its calibration by more than that band is wide (0.68 measured where 0.82 was predicted:
    notes/2026-12-07-admission-blocks.md). None for a rule no prefix inside the frontier would tell."""
    if len(run.multiples) < 2:
        return []
    right = "static" if ":" in run.mode else run.mode
    now = _judged_against(run, right)
    span = range(min(run.multiples) // unit * unit + unit, max(run.multiples), unit)
    between = SimpleNamespace(tier=run.tier, multiples=dict.fromkeys(span, 1.0), mode=right)
    ours, at, found = decides(between, right, kv_bytes_per_token), _interpolated(run), []
    margin = run.tier.get("margin", 0.0)
    for mode in dict.fromkeys(m for m in (*modes, run.mode) if ":" in m):
        if tells_apart(now, mode, kv_bytes_per_token):
            continue
        theirs = decides(between, mode, kv_bytes_per_token)
        telling = [p for p in span if theirs[p] != ours[p]
                   and (at(p) > 1 + judge.CAP if theirs[p] else at(p) < 1 - margin - judge.CAP)]
        if telling and telling[len(telling) // 2] not in run.multiples:
            found.append(telling[len(telling) // 2])
    return sorted(set(found))


def near_misses(run, kv_bytes_per_token: int, modes=NEAR_MISSES) -> tuple[list[str], list[str]]:
    """(what is wrong: the stand-in unlike the guarded server, or a near miss that would pass; the near misses
    no frontier cell can tell apart from the rule under test (tells_apart), each with where they part)."""
    wrong = unlike_live(run, kv_bytes_per_token)
    if run.mode.startswith("static:"):  # a planted near miss under test: untold is undecided, not a pass
        right = _judged_against(run, "static")
        if not tells_apart(right, run.mode, kv_bytes_per_token):
            wrong.append(f"undecided: no frontier cell tells rule {run.mode} from the right one "
                         f"({parting(right, run.mode, kv_bytes_per_token).removeprefix(run.mode + ' ')})")
    alike = [m for m in modes if not tells_apart(run, m, kv_bytes_per_token)]
    for mode in (m for m in modes if m not in alike):
        verdicts = judged_as(run, mode, kv_bytes_per_token)
        if not (judge.failures(verdicts) or judge.undecided(verdicts)):
            wrong.append(f"{mode} would pass: " + "; ".join(v.describe() for v in verdicts))
    return wrong, [parting(run, m, kv_bytes_per_token) for m in alike]


__all__ = ["NEAR_MISSES", "NEAR_MISS_SCALES", "TELLS", "decides", "differs", "judged_as", "near_misses", "telling_cells", "parting", "tells_apart", "unlike_live"]

"""The side-by-side table's close calls, settled with interleaved rounds.

The grid measures one backend's cells, then the next backend's, minutes apart, and the same cell against the
same tier moves from run to run by more than the target's 5% (docs/notes/2026-12-02-close-calls.md). So where the grid's rounds
cannot tell whether ours meets its target, the two are measured again side by side in time: each round runs
the cell on both servers, the order alternating, and the target is judged per round, against a bound drawn
from that round's other tier (analysis/tier_target.py). A cell is a close call where the range of ours' rounds
overlaps the range of the bounds drawn from theirs, or where ours' p50 sits nearer its bound than the two
servers' engine hits at that cell differ: those involve no tier, so their difference is what measuring the two
minutes apart moved. Cells clear of both keep the grid's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pytest_kvoffload.analysis.outcome import MET, MISSED, UNDECIDED
from pytest_kvoffload.analysis.paired import paired_verdict
from pytest_kvoffload.analysis.tier_target import allowance_s, bound_s, of_bound_text
from pytest_kvoffload.suite_machinery import ab
from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.measure.context import Recorder, Servers

# Interleaved rounds per close call: each costs one tier hit on both servers (about 4 s at 4,096 tokens on
# 2 cores, most of it waiting out the other server's busy-poll); 7 is the A/B's own fewest for an interval.
ROUNDS = 7
# Close calls settled per run, nearest the bound first: 7 of 7 rounds cost what 10 of 5 did within make
# bench's budget (docs/notes/2026-12-04-last-read.md). Those still left are named in the table (report.py).
MOST = 7


@dataclass(frozen=True)
class CloseCall:
    other: str
    length: int
    fraction: float
    allowance_s: float  # added to the other tier's TTFT before the ratio (analysis/tier_target.py)
    margin: float  # how far the grid's p50 sits from its bound, as a share of the bound

    @property
    def cell(self) -> Cell:
        return Cell(self.length, self.fraction, State.TIER_HIT)


def _range(ttft: dict) -> tuple[float, float]:
    return (ttft["min"] if ttft.get("min") is not None else ttft["p50"],
            ttft["max"] if ttft.get("max") is not None else ttft["p50"])


def engine_drift(ours_engine_s: float | None, theirs_engine_s: float | None) -> float:
    """How far apart the two servers' engine-hit p50s at one cell are, as a share of the other's (0 where
    either is missing): the grid's drift between the two, with no tier in it."""
    if ours_engine_s is None or not theirs_engine_s:
        return 0.0
    return abs(ours_engine_s / theirs_engine_s - 1)


def close_calls(cells: list[dict], ours: str, others: list[str], kv_bytes_per_token: float | None,
                drive_gbps: float | None, most: int | None = MOST) -> list[CloseCall]:
    """The tier-hit cells of `ours` against each of `others` whose target the grid's rounds cannot decide,
    nearest the bound first, `most` at most (None: all)."""
    hits = {(c["backend"], c["length"], c["fraction"]): c for c in cells if c["state"] == State.TIER_HIT.value}
    engines = {(c["backend"], c["length"], c["fraction"]): c["ttft"]["p50"] for c in cells
               if c["state"] == State.ENGINE_HIT.value}
    calls = []
    for (backend, length, fraction), mine in hits.items():
        if backend != ours:
            continue
        for other in others:
            theirs = hits.get((other, length, fraction))
            if theirs is None:
                continue
            allowance = allowance_s(mine, theirs, kv_bytes_per_token, drive_gbps)
            if allowance is None:
                continue
            low, high = _range(mine["ttft"])
            their_low, their_high = _range(theirs["ttft"])
            margin = abs(mine["ttft"]["p50"] / bound_s(theirs["ttft"]["p50"], allowance) - 1)
            overlap = low <= bound_s(their_high, allowance) and high >= bound_s(their_low, allowance)
            if overlap or margin <= engine_drift(engines.get((ours, length, fraction)),
                                               engines.get((other, length, fraction))):
                calls.append(CloseCall(other, length, fraction, allowance, margin))
    return sorted(calls, key=lambda c: c.margin)[:most]


def settle(recorder: Recorder, servers: Servers, ours, other, call: CloseCall, rounds: int = ROUNDS) -> dict:
    """Interleaved rounds of one close call on both servers; the target judged on the median over rounds of
    ours' TTFT over that round's bound (met at 1 or less)."""
    # Prompts of their own per other tier: ours meets one cell in a close call against each, and the second
    # must not find the first's prompts stored.
    comparison = ab.compare_cell(recorder, servers, other, ours, call.cell, rounds, purpose=f"close-call-{call.other}")
    of_bound = [mine / bound_s(theirs, call.allowance_s) for theirs, mine in zip(comparison.a_s, comparison.b_s)]
    median = float(np.median(of_bound)) if of_bound else float("nan")
    judged = paired_verdict(f"{call.other} {call.length} x {call.fraction:g}", of_bound, limit=1.0) if of_bound else None
    # A round whose output or sources failed is no evidence for the target either way: missed.
    outcome = MISSED if comparison.failures else judged.outcome if judged else UNDECIDED
    return {"other": call.other, "length": call.length, "fraction": call.fraction, "allowance_s": call.allowance_s,
            "ours_s": comparison.b_s, "theirs_s": comparison.a_s, "ratios": of_bound, "median_of_bound": median,
            "interval": [judged.low, judged.high] if judged else [None, None], "outcome": outcome,
            "met": outcome == MET, "failures": comparison.failures}


def grouped(calls: list[CloseCall], running=lambda name: False) -> list[CloseCall]:
    """The calls one other tier at a time: a tier whose server is `running` first, then the others in the order
    of their nearest call. Our server and one other are up at once on a CPU (ServerPool), and calls that
    alternated between two tiers restarted a server at each switch."""
    first = {}
    for n, call in enumerate(calls):
        first.setdefault(call.other, n)
    return sorted(calls, key=lambda call: (not running(call.other), first[call.other]))


def share(most: int, used: int, others_left: int) -> int:
    """The close calls one other backend may settle: an equal part of what the run has left (`most` less the
    `used`) among the `others_left` backends still to settle, this one included; a backend with fewer
    leaves the rest to those after it."""
    return max(0, most - used) // max(1, others_left)


def settle_all(recorder: Recorder, servers: Servers, backends: dict, ours: str,
               most: int = MOST) -> tuple[list[dict], list[dict]]:
    """Every close call of the run's grid so far between `ours` and the other user-facing tier backends
    (`backends`: name -> Backend, those to settle against besides ours), `most` at most, settled one after
    another; (those settled, those left to the grid's verdict: other, length and fraction each)."""
    cells = recorder.cells()
    others = sorted({c["backend"] for c in cells if c["state"] == State.TIER_HIT.value and c["backend"] != ours
                     and c["backend"] in backends and backends[c["backend"]].user_facing})
    drive = (recorder.environment().get("drive") or {}).get("read_gbps")
    every = close_calls(cells, ours, others, recorder.settings.kv_bytes_per_token, drive, most=None)
    calls = grouped(every[:most], servers.running)
    settled = []
    for n, call in enumerate(calls, 1):
        recorder.progress(f"side by side: close call {n} of {len(calls)}, {ours} and {call.other} at "
                          f"{call.length} x {call.fraction:g}, {ROUNDS} interleaved rounds")
        settled.append(settle(recorder, servers, backends[ours], backends[call.other], call))
    left = [{"other": c.other, "length": c.length, "fraction": c.fraction, "margin": c.margin} for c in every[most:]]
    return settled, left


def outcome_text(settled: dict) -> str:
    """MET, MISSED or UNDECIDED of a settled close call (a record from before outcomes: met or MISSED)."""
    outcome = settled.get("outcome") or (MET if settled["met"] else MISSED)
    return MET if outcome == MET else outcome.upper()


def interval_text(settled: dict) -> str:
    low, high = (settled.get("interval") or [None, None])[:2]
    return "" if low is None and high is None else (
        f"[{'?' if low is None else f'{low:.3f}'}, {'?' if high is None else f'{high:.3f}'}] ")


def render(settled: list[dict], ours: str, left: list[dict] = ()) -> str:
    lines = [f"{ours} against the other tiers, the grid's close calls in interleaved rounds (per round: ours / "
             "the bound drawn from that round's other tier; met where the median's 95% distribution-free interval "
             "is at most 1, missed where it is past 1, else undecided; report-only until the tiers' limits are "
             "asserted)"]
    for s in settled:
        ratios = ", ".join(f"{r:.2f}" for r in s["ratios"])
        lines.append(f"  {s['other']} {s['length']} x {s['fraction']:g}: median {of_bound_text(s['median_of_bound'])} "
                     f"{interval_text(s)}({ratios}): {outcome_text(s)}"
                     + (f"; {'; '.join(s['failures'][:2])}" if s["failures"] else ""))
    for c in left:
        lines.append(f"  {c['other']} {c['length']} x {c['fraction']:g}: not settled (the grid's p50 "
                     f"{c['margin']:.0%} from its bound; past its tier's share of the run's {MOST}): the grid's "
                     "verdict stands")
    return "\n".join(lines)


__all__ = ["MOST", "ROUNDS", "CloseCall", "close_calls", "engine_drift", "grouped", "interval_text", "outcome_text",
           "render", "settle",
           "settle_all", "share"]

"""A/B: two backends (or variants, or one backend against itself) compared in one run, cell by cell.

Both servers are up at once; each round measures the cell on A and on B with fresh prompts, the order
alternating between rounds (A first, then B first), and waits out the other server's busy-poll before
each request (vLLM's worker spins for about a second after a message, on the core the other server's
worker uses: suites/test_equal_engines.py). A cell's verdict comes from the per-round ratios B / A: a
distribution-free 95% confidence interval for their median (order statistics), and

- slower: the interval lies above 1 + FLOOR (3%: a difference this small is not credited),
- faster: below 1 - FLOOR,
- no difference: otherwise, at that confidence; "sees from" says how large a difference the interval
  could have shown (a "no difference" says nothing below it), and the summary counts those past CAP.

Outputs are checked twice: in each cell's first round every side against its own recompute (wrong KV
fails the cell), and A against B on one fresh prompt recomputed on both. Across two vLLM releases
(--kv-backend-python: the upgrade check, docs/comparing.md) greedy outputs on the same weights may differ
from a release's numerics; that is reported as a version change, not as wrong KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tabulate import tabulate

from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.measure.prompts import make_prompt
from pytest_kvoffload.measure.output_check import compare_outputs
from pytest_kvoffload.measure.runner import CellRunner, recompute
from pytest_kvoffload.analysis.paired import CAP, FLOOR, interval
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.measure.context import Recorder, Servers
from pytest_kvoffload.serve.backend import Backend
from pytest_kvoffload.serve.command_line import server_release
from pytest_kvoffload.serve.server import settle

# Fewer rounds than this cannot give a two-sided 95% interval (paired.interval).
MIN_ROUNDS = 7


@dataclass
class CellComparison:
    cell: Cell
    a_s: list[float] = field(default_factory=list)
    b_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # B's greedy output against A's on one fresh prompt, both recomputed: None (equal, up to a near-tie)
    # or where they differ.
    outputs_differ: str | None = None

    @property
    def ratios(self) -> list[float]:
        return [b / a for a, b in zip(self.a_s, self.b_s) if a > 0]

    def interval(self) -> tuple[float | None, float | None]:
        return interval(self.ratios)

    def verdict(self) -> str:
        low, high = self.interval()
        if low is None or high is None:
            return f"undecided (fewer than {MIN_ROUNDS} rounds)"
        if low > 1 + FLOOR:
            return "B slower"
        if high < 1 - FLOOR:
            return "B faster"
        return "no difference"

    def sees(self) -> float | None:
        """The smallest difference this cell could have shown: how far the interval reaches from 1 on its
        wider side (a "no difference" says nothing of effects below it)."""
        low, high = self.interval()
        return None if low is None or high is None else max(high - 1.0, 1.0 - low)

    def to_dict(self) -> dict:
        low, high = self.interval()
        return {"length": self.cell.length, "fraction": self.cell.fraction, "state": self.cell.state.value,
                "a_s": self.a_s, "b_s": self.b_s, "ratios": self.ratios,
                "median_ratio": float(np.median(self.ratios)) if self.ratios else None,
                "interval": [low, high], "verdict": self.verdict(), "sees_from": self.sees(), "failures": self.failures,
                "outputs_a_vs_b": self.outputs_differ or "equal"}


def compare_cell(recorder: Recorder, servers: Servers, a, b, cell: Cell, rounds: int,
                 purpose: str = "ab") -> CellComparison:
    """`rounds` rounds of one cell on both servers, interleaved, fresh prompts each round. Prompts are keyed
    by `purpose` (with the backend, cell and round): two comparisons of one cell on one server need two."""
    comparison = CellComparison(cell)
    endpoints = {a.name: servers.endpoint(a), b.name: servers.endpoint(b)}
    tracker = Tracker(recorder.progress, f"A/B {cell.id}", rounds, "rounds")
    for r in range(rounds):
        order = (a, b) if r % 2 == 0 else (b, a)
        measured = {}
        for backend in order:
            settle(endpoints.values())
            outcome = CellRunner(recorder, backend, endpoints[backend.name], cell, first_round=r, purpose=purpose,
                                 check_output=r == 0).run(1)
            comparison.failures += [f"{backend.name} {f}" for f in outcome.failures]
            measured[backend.name] = outcome.ttfts[-1]
        comparison.a_s.append(measured[a.name])
        comparison.b_s.append(measured[b.name])
        tracker.step()
    comparison.outputs_differ = outputs_across(recorder, endpoints[a.name], endpoints[b.name], cell, purpose)
    return comparison


def outputs_across(recorder: Recorder, a, b, cell: Cell, purpose: str) -> str | None:
    """One fresh prompt of the cell's length recomputed on A and on B (no cache may answer): None when B's
    greedy tokens and logprobs are A's at every position (measure/output_check.py; past a near-tie B is
    continued from A's tokens), else where B's differ."""
    s = recorder.settings
    salt = f"{recorder.salt}|{purpose}|a-vs-b|{cell.id}"
    tokens = make_prompt(cell.length, 0.0, seed=s.random_seed, salt=salt, vocab_size=s.model.vocab_size).tokens
    settle([a, b])
    want = recompute(a, tokens, salt)
    settle([a, b])
    got = recompute(b, tokens, salt)
    difference = compare_outputs(got, want, lambda extra: recompute(
        b, [*tokens, *extra], f"{salt}|{len(extra)}", len(want.output_token_ids) - len(extra))).difference
    return None if difference is None else difference.replace("a recompute", "A")


def versions(a: Backend, b: Backend) -> tuple[str | None, str | None]:
    """The vLLM versions A's and B's servers run (another interpreter's where --kv-backend-python names one)."""
    return server_release(a)[1], server_release(b)[1]


def render(a: str, b: str, comparisons: list[CellComparison], vllm: tuple[str | None, str | None] = (None, None)) -> str:
    rows = []
    for c in comparisons:
        low, high = c.interval()
        interval = "-" if low is None else f"{low:.3f} to {high:.3f}"
        rows.append([c.cell.length, "-" if c.cell.state is State.COLD else f"{c.cell.fraction:g}", c.cell.state.value,
                     f"{np.median(c.a_s) * 1e3:,.1f}", f"{np.median(c.b_s) * 1e3:,.1f}",
                     f"{np.median(c.ratios):.3f}", interval, c.verdict(),
                     "-" if c.sees() is None else f"{c.sees():.0%}", output_column(c)])
    table = tabulate(rows, headers=["length", "cached", "state", "A p50 ms", "B p50 ms", "B/A median",
                                    "95% interval", "verdict", "sees from", "outputs"], disable_numparse=True)
    named = [f"{n} (vLLM {v})" if v else n for n, v in zip((a, b), vllm)]
    return (f"A = {named[0]}, B = {named[1]}; rounds interleaved, paired ratios B/A\n{table}\n"
            f"{overall(comparisons)}\n{output_note(comparisons, vllm)}")


def output_column(c: CellComparison) -> str:
    """Each side against its own recompute, then A against B."""
    own = "wrong" if any("output token" in f for f in c.failures) else "ok"
    return f"{own}, A=B" if c.outputs_differ is None else f"{own}, A!=B"


def output_note(comparisons: list[CellComparison], vllm: tuple[str | None, str | None]) -> str:
    differ = [c for c in comparisons if c.outputs_differ]
    head = ("outputs: \"ok\": each side matched its own recompute; A=B: one fresh prompt recomputed on both "
            "gave the same greedy tokens")
    if not differ:
        return head + f" (all {len(comparisons)} cell(s))"
    why = (f"vLLM {vllm[0]} against {vllm[1]}: a version change, not wrong KV (each side checked against itself)"
           if vllm[0] != vllm[1] else "the same vLLM on both: the two servers compute differently")
    first = differ[0]
    return head + f"; A!=B in {len(differ)} of {len(comparisons)} cell(s), {why}; {first.cell.id}: {first.outputs_differ}"


def overall(comparisons: list[CellComparison]) -> str:
    verdicts = [c.verdict() for c in comparisons]
    slower, faster = verdicts.count("B slower"), verdicts.count("B faster")
    same = verdicts.count("no difference")
    if not slower and not faster:
        head = "no difference shown in any cell"
    elif slower and not faster:
        head = f"B slower in {slower} cell(s), never faster"
    elif faster and not slower:
        head = f"B faster in {faster} cell(s), never slower"
    else:
        head = f"mixed: B slower in {slower} cell(s), faster in {faster}"
    rest = len(verdicts) - slower - faster - same
    # A "no difference" whose interval reaches past the cap could not have seen a difference of the cap.
    blind = sum(1 for c in comparisons if c.verdict() == "no difference" and (c.sees() or 0) > CAP - 1.0)
    return (f"overall: {head}; {same} without a difference at 95% confidence"
            + (f" ({blind} of them could not have seen {CAP - 1.0:.0%}: more rounds, --kv-rounds)" if blind else "")
            + (f"; {rest} undecided" if rest else ""))

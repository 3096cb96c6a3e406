"""The TTFT suite's extra paired rounds at our connector's whole-prefix tier hits, for its cells against their
limit (analysis/tier_limit.py): the grid's 2 or 3 rounds leave a ratio of about 1.1 undecided (bounds of
+-15 to 20% on the 2-core VM, docs/notes/2026-12-07-tier-limits.md), so each such cell is judged on
LIMIT_PAIRS rounds. A fixed number, whatever the grid's rounds showed: a cell measured again only when
undecided would be a second look, and its error rate would have to be split (suite_machinery/admission/judge.py).

Whole-prefix cells only: one primed round each leaves its prompt in the tier, and every later round reuses it,
the tier hit and the engine hit beside it with no prime (measure/runner.CellRunner, reuse), about 0.3 s; a
cell with a suffix to compute would need a fresh suffix and two prefills a round (2 s at 2,048 tokens). Not
the grid's prompts: a store that served other tests may have evicted them since (make test's did).
"""

from __future__ import annotations

from pytest_kvoffload.analysis.tier_limit import LIMIT_PURPOSE
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.measure.context import Recorder
from pytest_kvoffload.measure.runner import CellRunner
from pytest_kvoffload.serve.backend import Backend

# Paired rounds a whole-prefix cell of ours is judged on, the grid's included: the admission suite's second
# look measures 20 too.
LIMIT_PAIRS = 20


def whole_prefix_cells(cells: list[dict], backend: str) -> list[Cell]:
    """The backend's measured tier-hit cells whose prompt is all prefix."""
    return [Cell(c["length"], 1.0, State.TIER_HIT) for c in cells
            if c["backend"] == backend and c["state"] == State.TIER_HIT.value and c["fraction"] == 1.0]


def more_rounds(recorder: Recorder, backend: Backend, endpoint, cells: list[Cell], grid_rounds: int,
                pairs: int = LIMIT_PAIRS) -> list[str]:
    """Each cell's rounds up to `pairs`, interleaved over the cells (round k of every cell, then k + 1): the first
    primed, the others reusing its prompt; the problems found (a wrong source, a failed load)."""
    failures: list[str] = []
    more = max(0, pairs - grid_rounds)
    if cells and more:
        recorder.progress(f"{backend.name}: {more} more paired rounds of {len(cells)} whole-prefix cells against "
                          "their limit")
    primed = grid_rounds + 1
    for k in range(more):
        for cell in cells:
            runner = CellRunner(recorder, backend, endpoint, cell, first_round=grid_rounds + k, purpose=LIMIT_PURPOSE,
                                check_output=False, paired_engine=True, reuse=(LIMIT_PURPOSE, primed) if k else None)
            failures += [f"{cell.id}: {f}" for f in runner.run(1).failures]
    return failures


__all__ = ["LIMIT_PAIRS", "more_rounds", "whole_prefix_cells"]

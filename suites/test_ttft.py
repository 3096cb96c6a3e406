"""TTFT per backend across prompt lengths and cached fractions: cold, engine hit, tier hit.

Each cell is one test; its rounds go through pytest-benchmark, and every request is checked against
vLLM's per-source cache counters, so a "hit" that came from the wrong place fails its cell. Right after
each other tier backend's cells (marker kv_after_cells), the side-by-side table's close calls against it
(kvoffload-disk against that tier where the grid's rounds cannot tell whether it meets its target) are
measured again in interleaved rounds (suite_machinery/ttft.py), on the two servers that measured the grid:
kvoffload-disk's, measured first, stays up (serve/server.ServerPool.keep). Every tier-hit round is followed
by its server's engine hit of the same cell, so each tier is judged against its limit round by round; after
its cells, kvoffload-disk's whole-prefix cells get paired rounds up to 20 (suite_machinery/ttft_limits.py).
"""

import pytest

from pytest_kvoffload.analysis.tier_target import TARGET_TIERS
from pytest_kvoffload.suite_machinery import ttft as close_calls, ttft_limits
from pytest_kvoffload.record.report import CLOSE_CALLS


def test_ttft(kv_cell, kv_measure):
    outcome = kv_measure(kv_cell)
    assert len(outcome.results) >= 1


@pytest.mark.kv_after_cells
def test_whole_prefix_hits_against_their_limit(kv_session, kv_backend, kv_server):
    # Report-only: the cells' ratios to their limit are tabled ("tiers against their limits"), not asserted.
    if kv_backend.name != kv_session.registry.ours():
        pytest.skip(f"more rounds against the limit for {kv_session.registry.ours()} only")
    cells = ttft_limits.whole_prefix_cells(kv_session.cells(kv_backend.name), kv_backend.name)
    if not cells:
        pytest.skip(f"no whole-prefix tier hit of {kv_backend.name} measured")
    failures = ttft_limits.more_rounds(kv_session.recorder, kv_backend, kv_server, cells, kv_session.settings.rounds)
    assert not failures, "; ".join(failures[:3])


def targeted(kv_session, ours: str) -> list[str]:
    """The run's user-facing tier backends other than ours that a target applies to, in the run's order."""
    backends = [kv_session.registry.get(n) for n in kv_session.settings.backends if n != ours]
    return [b.name for b in backends if not b.unavailable_reason() and b.user_facing and b.tier in TARGET_TIERS]


@pytest.mark.kv_after_cells
def test_side_by_side_close_calls(kv_session, kv_backend):
    OURS = kv_session.registry.ours()
    others = targeted(kv_session, OURS)
    if kv_backend.name not in others:
        pytest.skip(f"close calls compare {OURS} with another disk or DRAM tier backend")
    if OURS not in kv_session.settings.backends or not kv_session.cells(OURS):
        pytest.skip(f"needs {OURS}'s cells measured in this run before {kv_backend.name}'s")
    so_far = kv_session.benchmark(CLOSE_CALLS)
    done, done_left = so_far.get("cells", []), so_far.get("left", [])
    most = close_calls.share(close_calls.MOST, len(done), len(others) - others.index(kv_backend.name))
    backends = {n: kv_session.registry.get(n) for n in (OURS, kv_backend.name)}
    settled, left = close_calls.settle_all(kv_session.recorder, kv_session.servers, backends, OURS, most=most)
    if settled or left:
        # Those left keep the grid's verdict, named as such in the table (record/report.py).
        everything, every_left = done + settled, done_left + left
        kv_session.add_benchmark(CLOSE_CALLS, close_calls.render(everything, OURS, every_left),
                                 {"cells": everything, "left": every_left})
    if not settled:
        pytest.skip(f"no close calls against {kv_backend.name}: " + (
            "the grid's rounds decided every target" if not left else
            f"the run's {close_calls.MOST} were settled before its cells; its rows keep the grid's verdict"))
    failures = [f for s in settled for f in s["failures"]]
    assert not failures, "; ".join(failures[:3])

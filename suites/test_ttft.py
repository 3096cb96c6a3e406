"""TTFT per backend across prompt lengths and cached fractions: cold, engine hit, tier hit.

Each cell is one test; its rounds go through pytest-benchmark, and every request is checked against
vLLM's per-source cache counters, so a "hit" that came from the wrong place fails its cell. After the grid,
the side-by-side table's close calls (kvoffload-disk against another tier where the grid's rounds cannot
tell whether it meets its target) are measured again in interleaved rounds (measure/close_calls.py).
"""

import pytest

from pytest_kvoffload.measure import close_calls
from pytest_kvoffload.record.report import CLOSE_CALLS, OURS


def test_ttft(kv_cell, kv_measure):
    outcome = kv_measure(kv_cell)
    assert len(outcome.results) >= 1


def test_side_by_side_close_calls(kv_session):
    names = [n for n in kv_session.settings.backends if not kv_session.registry.get(n).unavailable_reason()]
    if OURS not in names or len(names) < 2:
        pytest.skip(f"needs {OURS} and another tier backend in the run")
    backends = {n: kv_session.registry.get(n) for n in names}
    settled = close_calls.settle_all(kv_session.recorder, kv_session.servers, backends, OURS)
    if not settled:
        pytest.skip("no close calls: the grid's rounds decided every target")
    kv_session.add_benchmark(CLOSE_CALLS, close_calls.render(settled, OURS), {"cells": settled})
    failures = [f for s in settled for f in s["failures"]]
    assert not failures, "; ".join(failures[:3])

"""A/B: two backends or variants in one run, both servers up, rounds interleaved, a paired verdict per cell.

    pytest suites/test_ab.py --kv-ab kvoffload-disk,kvoffload-disk[read_gbps=0.05] --kv-lengths=1024,4096 --kv-fractions=1.0

The recommended way to compare connectors before an upgrade (pytest_kvoffload/measure/ab.py has the method).
"""

import pytest

from pytest_kvoffload.suite_machinery import ab
from pytest_kvoffload.core.cell_state import State

NAME = "A/B"


@pytest.fixture(scope="session")
def comparisons():
    """The cells compared so far in this session, for the cumulative table."""
    return []


@pytest.mark.kv_servers("{ab}")
def test_ab(kv_session, kv_cell, comparisons):
    pair = kv_session.settings.ab
    if pair is None:
        pytest.skip("no --kv-ab given")
    a, b = (kv_session.registry.get(name) for name in pair)
    for backend in (a, b):
        reason = backend.unavailable_reason()
        if reason:
            pytest.skip(reason)
    if kv_cell.state is State.TIER_HIT and not (a.tier and b.tier):
        pytest.skip("a tier-hit cell needs both backends to have a tier")
    comparison = ab.compare_cell(kv_session.recorder, kv_session.servers, a, b, kv_cell, max(ab.MIN_ROUNDS, kv_session.settings.rounds))
    comparisons.append(comparison)
    vllm = ab.versions(a, b)
    kv_session.add_benchmark(NAME, ab.render(a.name, b.name, comparisons, vllm),
                             {"a": a.name, "b": b.name, "vllm": list(vllm), "cells": [c.to_dict() for c in comparisons],
                              "overall": ab.overall(comparisons)})
    assert not comparison.failures, "; ".join(comparison.failures[:3])

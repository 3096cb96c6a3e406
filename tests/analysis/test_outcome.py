"""The one rule that makes a verdict met, missed or undecided, held to near misses on both sides."""

import pytest

from pytest_kvoffload.analysis.outcome import MET, MISSED, UNDECIDED, at_most, detects_from, worst


@pytest.mark.parametrize("estimate, low, high, outcome", [
    (1.00, 0.97, 1.03, MET),          # identical data: met, not undecided
    (1.05, 1.03, 1.07, MET),          # slower, shown, but within the limit
    (1.099, 1.09, 1.101, UNDECIDED),  # the interval reaches 0.1% past the limit
    (1.12, 1.09, 1.15, MISSED),       # past the limit, and slower at 95%
    (1.12, 0.99, 1.27, UNDECIDED),    # past the limit, but noise that cannot show it is slower at all
    (1.30, None, None, UNDECIDED),    # no interval: nothing decided, whatever the estimate
])
def test_near_misses_on_either_side(estimate, low, high, outcome):
    assert at_most("x", estimate, low, high, 1.10).outcome == outcome


def test_a_verdict_states_its_power_and_prints_in_one_line():
    verdict = at_most("gpu-only cold", 1.0, 0.95, 1.05, 1.10, rounds=6)
    assert verdict.detects_from == pytest.approx(1.10)  # a narrow interval: the limit itself
    assert detects_from(1.0, 0.8, 1.10) == pytest.approx(1.25)  # a wide one only sees 25% or more
    line = verdict.text()
    assert line == "met: gpu-only cold 1.000 [0.950, 1.050] against at most 1.100 (detects from 1.100, 6 rounds)"
    assert at_most("c", 1.2, 1.1, 1.3, 1.1).text().startswith("MISSED: c 1.200")
    assert worst([verdict, at_most("u", 1.0, 0.8, 1.2, 1.1)]) == UNDECIDED
    assert worst([verdict]) == MET

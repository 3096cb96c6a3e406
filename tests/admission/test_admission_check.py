"""The admission suite's checks on recorded rounds: planted rules fail with the cells named, the real one passes."""

import pytest

from pytest_kvoffload.admission.check import Grid, Round, missed_gains, paid_cells, slower_hits
from pytest_kvoffload.measure.paired import median_bound, verdict, within_cap

# A control grid as the slowed drive makes it: short prefixes cost more to load than to recompute,
# long ones pay (median ratios 1.25 and 0.70), one cell near the tie.
CONTROL_RATIOS = {(1024, 0.5): 1.25, (1024, 1.0): 1.02, (2048, 1.0): 0.70}


def rounds(ratio, admitted, n=5, jitter=0.02):
    return [Round(hit_s=ratio * (1 + jitter * (i - n // 2) / n), cold_s=1.0, tier_tokens=512 if admitted else 0,
                  admitted=admitted, declined=not admitted) for i in range(n)]


def grid(decide) -> Grid:
    """The grid a rule produces: an admitted cell measures the control's ratio, a declined one recomputes (~1)."""
    g = Grid("kvoffload-disk[admission]")
    for key, ratio in CONTROL_RATIOS.items():
        admitted = decide(ratio)
        g.cells[key] = rounds(ratio if admitted else 1.0, admitted)
    return g


CONTROL = grid(lambda ratio: True)
REAL = grid(lambda ratio: ratio < 0.9)          # loads only what pays by a margin
ALWAYS = grid(lambda ratio: True)
NEVER = grid(lambda ratio: False)
INVERTED = grid(lambda ratio: ratio >= 0.9)     # takes exactly the loads that do not pay


def test_the_real_rule_passes():
    assert not slower_hits(REAL) and not missed_gains(CONTROL, REAL)


def test_always_is_caught_with_the_slower_cell_named():
    found = slower_hits(ALWAYS)
    assert len(found) == 1 and found[0].startswith("1024 tokens, 0.5 cached") and "median ratio 1.25" in found[0]


def test_never_is_caught_with_the_paying_cell_named():
    found = missed_gains(CONTROL, NEVER)
    assert len(found) == 1 and found[0].startswith("2048 tokens, 1 cached") and "declined 5 of 5" in found[0]
    assert not slower_hits(NEVER)  # why the no-slower check alone could not see it


def test_inverted_is_caught_both_ways():
    assert slower_hits(INVERTED) and missed_gains(CONTROL, INVERTED)


def test_the_controls_show_both_kinds_of_cell():
    assert slower_hits(CONTROL) and paid_cells(CONTROL) == [(2048, 1.0)]


def test_a_13_percent_slowdown_is_caught_whatever_the_noise():
    # Wide noise (ratios 0.8 to 1.5) cannot hide a median 13% above recompute: the 10% cap holds.
    ratios = [0.8, 1.13, 1.13, 1.2, 1.5]
    assert verdict(ratios) == "slower"
    # And a consistent 5% slowdown is caught by the bound, although under the cap.
    assert verdict([1.04, 1.05, 1.05, 1.06, 1.07]) == "slower"
    assert verdict([0.95, 1.02, 1.05, 1.0, 0.98]) == "same"


def test_median_bound_is_the_order_statistic_with_95_percent_coverage():
    assert median_bound([3, 1, 2, 5, 4], upper=False) == 1   # P(all 5 above the median) = 1/32
    assert median_bound([3, 1, 2, 5, 4], upper=True) == 5
    assert median_bound(list(range(9)), upper=False) == 1    # second smallest: P(<= 1 of 9) = 10/512
    assert median_bound([1, 2, 3, 4], upper=False) is None   # 1/16 > 5%: too few rounds to bound


@pytest.mark.parametrize("n", [5, 7, 9, 20])
def test_identical_rounds_are_no_difference(n):
    assert verdict([1.0] * n) == "same"


def test_engines_twice_as_fast_with_a_connector_are_not_equal():
    # What the CPU core reservation did before every server got the same one (docs/machines.md).
    assert not within_cap([150 / 270, 148 / 296, 150 / 268, 151 / 270, 152 / 262])
    assert within_cap([276 / 262, 271 / 262, 304 / 263, 262 / 270, 280 / 265])


def test_cells_that_look_slower_but_are_undecided_get_more_rounds_not_more_tolerance():
    from pytest_kvoffload.admission.check import undecided_slower

    g = Grid("x")
    g.cells[(1024, 1.0)] = [Round(r, 1.0, 512, True, False) for r in (0.95, 1.02, 1.06, 1.07, 1.2)]
    g.cells[(2048, 1.0)] = [Round(r, 1.0, 512, True, False) for r in (0.9, 0.97, 1.0, 1.02, 1.05)]
    assert undecided_slower(g) == [(1024, 1.0)]

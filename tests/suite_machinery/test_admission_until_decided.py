"""Rounds until decided (judge.until_decided): an undecided frontier cell is measured again and judged on all
its rounds; a failed one is not; the 5% a right rule may be failed by noise holds over both looks, and a
rule wrong by 25% in one cell is still failed."""

import math

import numpy as np

from pytest_kvoffload.suite_machinery.admission import judge

# Around p*: loads slower below it (declined is right), paying above it (admitted is right).
TRUE = {512: 1.3, 640: 1.15, 768: 1.05, 1024: 0.93, 1152: 0.85, 1536: 0.7}


def draw(rng, prefix: int, admitted: bool, sigma: float, wrong_by: float = 1.0) -> judge.Decision:
    control = TRUE[prefix] * math.exp(rng.normal(0, sigma))
    guarded = TRUE[prefix] * wrong_by * math.exp(rng.normal(0, sigma)) if admitted else math.exp(rng.normal(0, sigma))
    return judge.Decision(admitted, guarded, control, 1.0)


def simulate(rng, sigma: float, rounds: int = 5, planted: int | None = None, wrong_by: float = 1.0):
    """One frontier judged with rounds until decided: the right rule (declines below p*, admits above), or,
    at `planted`, a rule that admits a load `wrong_by` slower than its true ratio. Returns the verdicts and
    what measure_more was asked for."""
    def decide(prefix):
        return TRUE[prefix] < 1 or prefix == planted

    cells = {p: [draw(rng, p, decide(p), sigma, wrong_by if p == planted else 1.0) for _ in range(rounds)]
             for p in TRUE}
    asked = []

    def measure_more(prefixes, more):
        asked.append((list(prefixes), more))
        for p in prefixes:
            cells[p] += [draw(rng, p, decide(p), sigma, wrong_by if p == planted else 1.0) for _ in range(more)]
        return cells

    verdicts, _ = judge.until_decided(dict(cells), {p: p / 900 for p in TRUE}, 0.02, measure_more)
    return verdicts, asked


def test_an_undecided_cell_is_measured_again_and_decided_on_all_its_rounds():
    rng = np.random.default_rng(5)
    for _ in range(20):
        verdicts, asked = simulate(rng, sigma=0.12)
        if asked:
            break
    assert asked, "a spread of 12% should leave some cell undecided at 5 rounds"
    prefixes, more = asked[0]
    assert more == judge.MORE_ROUNDS * 5
    again = [v for v in verdicts if v.prefix in prefixes]
    assert all(v.looks == 2 and len(v.decisions) == 5 + more for v in again)
    assert all(v.looks == 1 and len(v.decisions) == 5 for v in verdicts if v.prefix not in prefixes)
    assert "(second look)" in again[0].describe()


def test_a_failed_cell_is_never_measured_again():
    rng = np.random.default_rng(6)
    for _ in range(20):
        verdicts, asked = simulate(rng, sigma=0.05, planted=512, wrong_by=1.0)  # admitted at 1.3: wrong
        failed = [v.prefix for v in verdicts if v.failed]
        assert 512 in failed
        assert all(512 not in prefixes for prefixes, _ in asked)


def test_a_right_rule_is_failed_by_noise_at_most_5_percent_over_both_looks():
    rng = np.random.default_rng(7)
    cells = failed = second = 0
    for _ in range(300):
        verdicts, asked = simulate(rng, sigma=0.1)
        cells += len(verdicts)
        failed += sum(v.failed for v in verdicts)
        second += bool(asked)
    assert second > 0  # the second look was taken in some runs, so its share of the 5% was spent
    assert failed / cells <= 0.05, (failed, cells)


def test_a_rule_wrong_by_25_percent_in_one_cell_is_failed_even_when_measured_again():
    rng = np.random.default_rng(8)
    caught = 0
    for _ in range(100):
        verdicts, _ = simulate(rng, sigma=0.12, planted=768, wrong_by=1.25)  # admits at 1.05 x 1.25
        caught += next(v for v in verdicts if v.prefix == 768).failed
    assert caught >= 90, caught


def test_queue_cells_are_judged_with_the_noise_they_are_given_at_both_looks():
    # One queue cell, admitted and right, under the frontier's loud noise: undecided at first, measured again,
    # and judged at the second look with that same noise (one cell cannot measure its own).
    loud = judge.Noise(0.3, 0.3, 0.12, 30)
    right = judge.Decision(True, 0.8, 0.8, 1.0)
    asked = []

    def measure_more(prefixes, more):
        asked.append((prefixes, more))
        return {384: [right] * (5 + more)}

    verdicts, noise = judge.until_decided({384: [right] * 5}, {384: 0.56}, 0.02, measure_more, measured=loud,
                                          declines=False)
    assert noise is loud and asked == [([384], judge.MORE_ROUNDS * 5)]
    assert verdicts[0].looks == 2 and len(verdicts[0].decisions) == 5 + judge.MORE_ROUNDS * 5

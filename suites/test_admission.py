"""The admission rule, judged where its decision is hard: around the break-even prefix p*.

On a drive emulated so that p* falls at half the longest length (all per-load latency, the mix that makes
a wrong decision costly on both sides; suite_machinery/admission/derived_drive.py), a control server takes every load and a
guarded server runs --kv-admission (default queue), interleaved round by round on frontier cells at 0.5,
0.7, 0.85, 1.2, 1.4 and 2 times the p* the control measured. Every decision is judged (suite_machinery/admission/judge.py):
an admitted load wrong when its hit was more than the 10% cap slower than the cold request beside it, a
declined one when the control's load of that cell and round paid by more than the rule's margin plus the
cap. "Never slower" means: in no cell more wrong rounds than noise explains at 95% confidence (noise measured
on the side each decision can be wrong on, as how often the control's hit/cold ratios stray that far from
their cell's median); the summary prints, per cell, the smallest slowdown its rounds detect with 90%
probability; a cell too noisy to decide is measured again and judged on all its rounds, and one still
undecided fails. Every round's hit output is checked.

The controls with which this suite must fail, naming the cells: always, never, static:scale=0.67,
static:scale=0.75, static:scale=1.3, static:scale=1.5, static:no-fixed (--kv-admission=...); not
queue:full-credit, which is right where loads progress behind a queue, as on the CPU build (docs/admission.md).
"""

import pytest

from pytest_kvoffload.suite_machinery.admission import counterfactual, grid_checks as check, judge

pytestmark = [pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session"),
              # The unthrottled drive probe, the control and the guarded rule.
              pytest.mark.kv_servers("{backend}", "{backend}[slow]", "{backend}[admission]")]


@pytest.fixture(scope="module")
def admission(kv_session, kv_backend):
    if kv_backend.name not in kv_session.settings.backends:
        pytest.skip(f"{kv_backend.name} is not among --kv-backend")
    try:
        return check.run_admission(kv_session.recorder, kv_session.servers, kv_backend, kv_session.settings.admission,
                                   kv_session.settings.rounds)
    except check.SlowDriveError as exc:
        pytest.fail(f"admission suite: {exc}", pytrace=False)


def test_every_round_measured_what_it_claims(admission):
    assert not admission.failures, "; ".join(admission.failures)


def test_the_frontier_straddles_the_break_even(admission):
    # The control's teeth: its loads clearly slower below p* and clearly paying above it.
    below = [v for v in admission.verdicts if v.multiple < 1]
    above = [v for v in admission.verdicts if v.multiple > 1]
    assert len(below) >= 2 and len(above) >= 2, f"frontier cells: {sorted(admission.multiples)}"
    slower = [v.prefix for v in below if sum(d.control_ratio > 1 + judge.CAP for d in v.decisions) * 2 > len(v.decisions)]
    paid = [v.prefix for v in above if sum(d.control_ratio < 1 - judge.CAP for d in v.decisions) * 2 > len(v.decisions)]
    assert slower and paid, f"control: slower below p* at {slower}, paid above at {paid}\n{check.frontier_table(admission)}"


def test_the_rule_can_be_told_from_a_near_miss(admission):
    assert admission.too_noisy is None, admission.too_noisy


def test_no_decision_is_wrong_beyond_noise(admission):
    found = judge.failures(admission.verdicts)
    assert not found, f"rule {admission.mode}: " + "; ".join(found)


def test_no_cell_is_left_undecided(admission):
    # Undecided is not a pass: a cell still too noisy after its second look (judge.until_decided) fails here.
    unsure = judge.undecided(admission.verdicts + admission.queue_verdicts)
    assert not unsure, f"rule {admission.mode}: " + "; ".join(unsure)


def test_declined_loads_move_no_tier_tokens(admission):
    for prefix, rounds in admission.guarded.cells.items():
        for i, r in enumerate(rounds):
            if r.declined:
                assert r.tier_tokens == 0, f"{prefix} tokens, round {i}: declined, yet loaded"
            if r.admitted:
                assert r.tier_tokens > 0, f"{prefix} tokens, round {i}: admitted, loaded nothing"


def test_queued_probes_load_exactly_what_was_admitted(admission):
    for (length, fraction), cell in admission.bursts.items():
        for i, r in enumerate(cell["rounds"]):
            assert not r.get("served_ahead"), f"{length} tokens, round {i}: a probe ran ahead of its queue at every try"
            want = cell["expected_disk_tokens"] if r["admitted"] else 0
            assert r["disk_tokens"] == want, (f"{length} tokens, {fraction:g} cached, round {i}: "
                                              f"{r['disk_tokens']} disk tokens, expected {want}")


def test_queue_decisions_are_never_wrong_beyond_noise(admission):
    judged = [v for v in admission.queue_verdicts if len(v.decisions) >= check.JUDGED_ROUNDS]
    assert judged, "no queue cell could be judged (too few paired rounds behind a queue)"
    found = judge.failures(judged)
    assert not found, f"rule {admission.mode} behind a queue: " + "; ".join(found)


def test_near_misses_fail_on_this_runs_rounds(admission, kv_session):
    wrong, alike = counterfactual.near_misses(admission, kv_session.settings.kv_bytes_per_token)
    assert not wrong, "; ".join(wrong)
    if alike:  # where they part from the rule the hit is within the cap either way: nothing there judges
        pytest.skip(f"no frontier cell can tell them from rule {admission.mode}: {'; '.join(alike)}")

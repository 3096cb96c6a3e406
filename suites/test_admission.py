"""The admission rule never makes a hit slower than recompute, takes the loads that pay, and the checks
have teeth.

On a drive slowed so that the break-even prefix falls among the grid's loadable prefixes (derived from
this machine's measurements: pytest_kvoffload/admission/slow_drive.py), a control server takes every load and a
guarded server runs the rule chosen with --kv-admission (default queue). The control must show both
kinds of cell, hits slower than recompute and hits that paid; otherwise a rule that admits everything,
or one that declines everything, would pass unseen. Then the guarded server must have no slower cell
and must not decline the cells that paid. `--kv-admission=always` and `--kv-admission=never` plant those
two faults: each makes this suite fail, naming the cells.

The statistic, per cell, is the paired ratio hit / cold of requests taken side by side in each round,
with a distribution-free 95% bound and a hard 10% cap (pytest_kvoffload/admission/check.py).
"""

import pytest

from pytest_kvoffload.admission import check

pytestmark = [pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session"),
              # The unthrottled drive probe, the control and the guarded rule (a second control, [slow2], only
              # when the first lacked a kind of cell: the closing line then names it as unplanned).
              pytest.mark.kv_servers("{backend}", "{backend}[slow]", "{backend}[admission]")]

# Five paired rounds are the fewest for which "all five slower" means slower with 95% confidence.
MIN_ROUNDS = 5


@pytest.fixture(scope="module")
def admission(kv_session, kv_backend):
    if kv_backend.name not in kv_session.settings.backends:
        pytest.skip(f"{kv_backend.name} is not among --kv-backend")
    try:
        return check.run_admission(kv_session.recorder, kv_session.servers, kv_backend, kv_session.settings.admission,
                                   max(MIN_ROUNDS, kv_session.settings.rounds))
    except check.SlowDriveError as exc:
        pytest.fail(f"admission suite: {exc}", pytrace=False)


def test_every_round_measured_what_it_claims(admission):
    failures = admission.control.failures + admission.guarded.failures
    assert not failures, "; ".join(failures)


def test_negative_control_finds_hits_slower_than_recompute(admission):
    assert check.slower_hits(admission.control), (
        f"with every load taken no cell was slower than recompute ({admission.drive.describe()}): "
        "a rule that admits everything would pass unseen")


def test_positive_control_finds_hits_that_paid(admission):
    assert check.paid_cells(admission.control), (
        f"with every load taken no cell was faster than recompute ({admission.drive.describe()}): "
        "a rule that declines everything would pass unseen")


def test_admission_never_makes_a_hit_slower_than_recompute(admission):
    found = check.slower_hits(admission.guarded)
    assert not found, f"rule {admission.mode}: " + "; ".join(found)


def test_admission_takes_the_loads_that_pay(admission):
    found = check.missed_gains(admission.control, admission.guarded)
    assert not found, f"rule {admission.mode}: " + "; ".join(found)


def test_declined_loads_move_no_tier_tokens(admission):
    for (length, fraction), rounds in admission.guarded.cells.items():
        for i, r in enumerate(rounds):
            if r.declined:
                assert r.tier_tokens == 0, f"{length} tokens, {fraction:g} cached, round {i}: declined, yet loaded"
            if r.admitted:
                assert r.tier_tokens > 0, f"{length} tokens, {fraction:g} cached, round {i}: admitted, loaded nothing"


def test_queued_probes_load_exactly_what_was_admitted(admission):
    for (length, fraction), cell in admission.bursts.items():
        for i, r in enumerate(cell["rounds"]):
            want = cell["expected_disk_tokens"] if r["admitted"] else 0
            assert r["disk_tokens"] == want, (f"{length} tokens, {fraction:g} cached, round {i}: "
                                              f"{r['disk_tokens']} disk tokens, expected {want} "
                                              f"({'admitted' if r['admitted'] else 'declined'})")


def test_queue_aware_admission_never_makes_a_hit_slower_than_recompute(admission):
    # A declined probe is a recompute: cells are judged on their admitted rounds, when there are enough.
    found = []
    for (length, fraction), cell in sorted(admission.bursts.items()):
        ratios = [r["hit_s"] / r["cold_s"] for r in cell["rounds"] if r["admitted"]]
        if len(ratios) >= MIN_ROUNDS and check.verdict(ratios) == "slower":
            found.append(f"{length} tokens, {fraction:g} cached: median ratio {sorted(ratios)[len(ratios) // 2]:.2f}")
    assert not found, "behind a long prefill: " + "; ".join(found)

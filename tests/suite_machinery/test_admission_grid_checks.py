"""The admission suite's judging on rounds from each rule: the connector's own rule object (static, and the
planted near misses) decides each frontier cell of a latency-bound drive, the rounds carry the measured
kind of noise, and judge.py must pass the real rule and fail every planted one, naming its cells."""


import json
from pathlib import Path

import numpy as np
import pytest

from pytest_kvoffload.suite_machinery.admission import judge
from pytest_kvoffload.suite_machinery.admission.grid_checks import MORE_PROBE_ROUNDS, measured_or_refused
from pytest_kvoffload.suite_machinery.admission.derived_drive import (FRONTIER, SlowDriveError, frontier_drive, frontier_prefixes,
                                                   interpolated_break_even, planted_break_even, ratio, step_tokens)
from pytest_kvoffload.connector.admission_rule import Admission, FixedAdmission
from pytest_kvoffload.rigged.knobs import planted_mode as admission_mode
from pytest_kvoffload.rigged.planted_admission import rule as planted_rule
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.core.costs import RecomputeFit, TierFit, break_even_prefix
from pytest_kvoffload.analysis.paired import median_bound, verdict, within_cap
from pytest_kvoffload.analysis.fits import fit_recompute

KV = 4096
RECOMPUTE = RecomputeFit(0.02, 1.8e-4, 0.0)  # this VM in bf16: nearly linear
SPT = 1e-7                                   # the drive's own transfer seconds per token, small
BLOCK = 128
TARGET = 640


def drive():
    return frontier_drive(TARGET, RECOMPUTE, 0.025, SPT, judge.CAP)


def tier(margin=0.02) -> dict:
    """The calibration the control's cells would give: the fitted fixed cost holds the emulated latency."""
    return {"recompute": {"a": RECOMPUTE.a, "b": RECOMPUTE.b, "c": RECOMPUTE.c}, "bandwidth_gbps": KV / SPT / 1e9,
            "fixed_s": 0.025 + drive().latency_s, "margin": margin}


def rule(mode: str):
    if mode in ("always", "never"):
        return FixedAdmission(mode, Counters())
    return planted_rule(tier(), KV, Counters(), mode)


def rounds_of(mode: str, n=5, jitter=0.03) -> tuple[dict, dict]:
    """Each frontier cell's decisions under `mode`: true ratios from the drive, +-jitter noise by round."""
    fixed = tier()["fixed_s"]
    cells, multiples = {}, {}
    for prefix, k in frontier_prefixes(TARGET, BLOCK, FRONTIER).items():
        true = ratio(prefix, RECOMPUTE, fixed, SPT)
        admitted = rule(mode)(prefix, prefix + 1, 0)
        noise = [1 + jitter * ((i * 7) % 5 - 2) / 2 for i in range(n)]
        cells[prefix] = [judge.Decision(admitted, true * e if admitted else e, true / e, e) for e in noise]
        multiples[prefix] = prefix / TARGET
    return cells, multiples


def test_the_real_rule_passes():
    cells, multiples = rounds_of("static")
    assert judge.failures(judge.judge(cells, multiples, margin=0.02)) == []


@pytest.mark.parametrize("mode, wrong_side", [
    ("always", "below"), ("static:no-fixed", "below"), ("static:scale=0.67", "below"),
    ("static:scale=0.75", "below"), ("never", "above"), ("static:scale=1.5", "above"), ("static:scale=1.3", "above"),
])
def test_every_planted_rule_fails_naming_its_cells(mode, wrong_side):
    cells, multiples = rounds_of(mode)
    failed = [v for v in judge.judge(cells, multiples, margin=0.02) if v.failed]
    assert failed, f"{mode} passed"
    assert all((v.multiple < 1) == (wrong_side == "below") for v in failed), [v.describe() for v in failed]
    assert all(f"{v.prefix:,} tokens" in v.describe() for v in failed)


def quiet(rate=1 / 32) -> judge.Noise:
    """Noise as 30 quiet rounds measure it ((0 + 1) / 32 on each side), 3% spread."""
    return judge.Noise(rate, rate, 0.03, 30)


def test_a_rule_wrong_in_two_rounds_of_five_fails_and_in_one_does_not():
    right = judge.Decision(False, 1.0, 1.2, 1.0)
    wrong = judge.Decision(True, 1.3, 1.3, 1.0)
    two = judge.judge({512: [wrong, wrong, right, right, right]}, {512: 0.8}, margin=0.02, measured=quiet())
    one = judge.judge({512: [wrong, right, right, right, right]}, {512: 0.8}, margin=0.02, measured=quiet())
    assert two[0].failed and not one[0].failed and one[0].outcome == "met"


def test_noise_measured_from_the_control_widens_what_is_allowed():
    assert quiet().allowed(5, 0) == 1
    assert judge.Noise(0.3, 0.3, 0.1, 30).allowed(5, 0) >= 3
    calm = {p: [judge.Decision(True, 1.0, 1.0 + 0.01 * (i % 3 - 1), 1.0) for i in range(5)] for p in range(6)}
    noisy = {p: [judge.Decision(True, 1.0, 1.0 + 0.3 * (i % 3 - 1), 1.0) for i in range(5)] for p in range(6)}
    assert judge.noise(calm).up < judge.noise(noisy).up
    assert judge.detectable_slowdown(5, 1, judge.noise(calm).sigma) < judge.detectable_slowdown(5, 1, judge.noise(noisy).sigma)


def test_noise_is_read_on_the_side_a_decision_can_be_wrong_on():
    # Rounds that only ever come out faster than their cell's median (a load that sometimes hides) make a
    # declined round look wrong, never an admitted one: the admitted allowance stays that of quiet rounds.
    faster = {p: [judge.Decision(True, 1.0, 1.0 if i % 3 else 0.8, 1.0) for i in range(6)] for p in range(6)}
    n = judge.noise(faster, margin=0.02)
    assert n.up == pytest.approx(1 / 38) and n.down > 0.3
    assert n.allowed(5, 0) == 1 and n.allowed(0, 5) >= 3
    # The control: the same strays above the median widen the admitted side instead.
    slower = {p: [judge.Decision(True, 1.0, 1.0 if i % 3 else 1.25, 1.0) for i in range(6)] for p in range(6)}
    assert judge.noise(slower, margin=0.02).allowed(5, 0) >= 3


def test_the_power_is_the_beta_quantile_of_the_binomial():
    # 5 rounds, 1 allowed: 2 of 5 above the cap with 90% needs each round above it with q = 0.5839
    # (P(Binomial(5, q) >= 2) = 0.9), a log ratio 0.2119 sigma above the cap's.
    assert judge.detectable_slowdown(5, 1, 0.05) == pytest.approx(1.1 * np.exp(0.05 * 0.2119) - 1, abs=1e-4)
    assert judge.detectable_slowdown(9, 1, 0.05) < judge.detectable_slowdown(5, 1, 0.05)
    assert judge.detectable_slowdown(5, 5, 0.05) == float("inf")


def test_a_cell_too_noisy_to_judge_is_undecided_not_passed():
    right = [judge.Decision(True, 1.0, 1.0, 1.0)] * 5
    # Strays of 20% either way in 24 of 30 rounds: no wrong round, and still not a pass (blind to 34%).
    strays = (0.2,) * 12 + (-0.2,) * 12 + (0.0,) * 6
    loud = judge.judge({512: right}, {512: 1.2}, margin=0.02, measured=judge.Noise(0.4, 0.4, 0.15, 30, strays))
    assert loud[0].undecided and loud[0].outcome == "undecided" and loud[0].detectable > 0.3
    assert judge.undecided(loud) and judge.undecided(loud)[0].startswith("undecided: 512 tokens")
    # Blind to twice the cap: a wide spread with few rounds.
    blind = judge.judge({512: right}, {512: 1.2}, margin=0.02, measured=judge.Noise(1 / 32, 1 / 32, 0.8, 30))
    assert blind[0].detectable > 2 * judge.CAP and blind[0].undecided
    # The control: quiet noise, the same rounds pass.
    assert judge.undecided(judge.judge({512: right}, {512: 1.2}, margin=0.02, measured=quiet())) == []


def test_half_its_rounds_allowed_is_decided_where_the_rounds_keep_their_power():
    # Heavy-tailed noise as the VM's cold prefills make it (docs/notes/2026-12-08-admission-power.md): a
    # third of the rounds stray 13% high, the rest within 1%. Twenty right rounds at the break-even are
    # allowed half of them wrong, yet a slowdown of 20% would put most rounds past the cap: decided, and met.
    strays = (0.12,) * 20 + (0.01, -0.01, 0.0) * 13
    noise = judge.Noise(21 / 61, 1 / 61, 0.03, 59, strays)
    right = [judge.Decision(True, 1.0, 1.0, 1.0)] * 20
    verdict = judge.judge({672: right}, {672: 1.12}, margin=0.02, measured=noise)[0]
    assert 2 * verdict.allowed >= 20 and verdict.detectable < 2 * judge.CAP and verdict.outcome == "met"
    # The near miss under the same noise: admitted 20% slower than recompute in every round fails.
    slow = [judge.Decision(True, 1.2, 1.0, 1.0)] * 20
    assert judge.judge({672: slow}, {672: 1.12}, margin=0.02, measured=noise)[0].failed
    # The near miss: 12% slower in every round, just past the cap, fails as well.
    near = [judge.Decision(True, 1.12, 1.0, 1.0)] * 20
    assert judge.judge({672: near}, {672: 1.12}, margin=0.02, measured=noise)[0].failed


def test_a_decline_is_wrong_only_past_the_margin_and_the_cap():
    assert not judge.Decision(False, 1.0, 0.89, 1.0).wrong(margin=0.02)
    assert judge.Decision(False, 1.0, 0.87, 1.0).wrong(margin=0.02)
    assert not judge.Decision(True, 1.09, 1.0, 1.0).wrong(margin=0.02)
    assert judge.Decision(True, 1.11, 1.0, 1.0).wrong(margin=0.02)


@pytest.mark.parametrize("recompute, fixed", [
    (RecomputeFit(0.02, 1.8e-4, 0.0), 0.025),   # this VM in bf16: nearly linear, fixed costs visible
    (RecomputeFit(0.01, 1e-4, 2e-8), 0.03),     # quadratic attention
    (RecomputeFit(0.3, 1.2e-3, 8e-8), 0.32),    # an AVX2-only CPU in float32: prefill dwarfs fixed costs
])
def test_the_latency_bound_drive_puts_p_star_at_the_target_with_both_errors_visible(recompute, fixed):
    d = frontier_drive(TARGET, recompute, fixed, SPT, judge.CAP)
    assert ratio(TARGET, recompute, fixed + d.latency_s, SPT) == pytest.approx(1.0, abs=0.02)
    assert d.early_cost >= 2 * judge.CAP and d.late_cost >= 2 * judge.CAP
    p = break_even_prefix(TierFit(KV / SPT, fixed + d.latency_s, 0), recompute, KV)
    assert p == pytest.approx(TARGET, rel=0.02)
    assert d.options() == {"read_latency_ms": round(d.latency_s * 1e3, 3)}


def test_no_drive_where_the_tier_already_costs_more_than_recompute():
    with pytest.raises(SlowDriveError, match="no latency puts the break-even there"):
        frontier_drive(256, RecomputeFit(0.01, 1e-5, 0.0), 0.5, SPT, judge.CAP)


def probe(disturbed_s: float, flat: bool = False):
    """measure and fit over probe rounds of 384 and 1,280 tokens on a linear CPU, the first round's 384-token
    cold request `disturbed_s` slower (0f5d785's CI); `flat`: a machine whose prefill is mostly fixed cost."""
    true = RecomputeFit(0.2, 1e-4, 0.0) if flat else RecomputeFit(0.03, 3e-4, 0.0)
    measured: list[dict] = []

    def measure(first, end):
        measured.extend({n: true(n) + (disturbed_s if r == 0 and n == 384 else 0) for n in (384, 1280)}
                        for r in range(first, end))

    def fit():
        medians = {n: float(np.median([r[n] for r in measured])) for n in (384, 1280)}
        return frontier_drive(TARGET, fit_recompute(list(medians), list(medians.values())), 0.03, SPT, judge.CAP)
    return measure, fit, measured


def test_one_disturbed_probe_round_does_not_refuse_the_machine():
    measure, fit, measured = probe(0.1)
    said = []
    measure(0, 2)
    with pytest.raises(SlowDriveError, match="costs 22% at 0.7 p"):
        fit()  # the near miss: refusing from the two rounds alone
    measured.clear()
    d = measured_or_refused(measure, fit, 2, said.append)
    assert len(measured) == 2 + MORE_PROBE_ROUNDS and "more probe rounds" in said[0]
    assert min(d.early_cost, d.late_cost) >= 2 * judge.CAP


def test_a_quiet_probe_measures_no_more_rounds_and_a_flat_machine_is_still_refused():
    measure, fit, measured = probe(0.0)
    measured_or_refused(measure, fit, 2, pytest.fail)
    assert len(measured) == 2
    measure, fit, measured = probe(0.0, flat=True)
    with pytest.raises(SlowDriveError, match="too flat"):
        measured_or_refused(measure, fit, 2, lambda line: None)
    assert len(measured) == 2 + MORE_PROBE_ROUNDS


def test_frontier_cells_sit_on_the_right_side_in_whole_blocks():
    for p_star in (590, 640, 688, 721, 200):
        cells = frontier_prefixes(p_star, BLOCK)
        assert all(p % BLOCK == 0 for p in cells)
        assert all((p < p_star) == (k < 1) for p, k in cells.items()), (p_star, cells)
        assert len(cells) == len(FRONTIER) or p_star < 4 * BLOCK


def test_frontier_cells_round_to_the_nearest_block_so_the_near_cells_stay_near():
    # p* of 721 tokens in 128-token blocks: 0.85 p* is 613 tokens, 640 the nearest block (0.89 p*), where
    # rounding away from p* gave 512 (0.71 p*), outside the region a 0.75x rule decides wrongly.
    cells = frontier_prefixes(721, BLOCK)
    assert 640 in cells and cells[640] == 0.85 and 896 in cells and cells[896] == 1.2


@pytest.mark.parametrize("p_star", [630, 697, 711, 744, 800, 1000])
def test_32_token_blocks_put_a_cell_where_a_rule_wrong_by_13_or_075_parts_from_the_right_one(p_star):
    # The admission servers' blocks (grid_checks.admission_block): with 128 tokens, p* of 697 to 744 put no
    # cell in 1.12 to 1.25 p* (CI runs of 76483e5 and 2a19b96); with 32, each window holds one.
    multiples = [p / p_star for p in frontier_prefixes(p_star, 32)]
    assert any(0.78 <= m <= 0.9 for m in multiples) and any(1.12 <= m <= 1.25 for m in multiples), multiples
    coarse = [p / 711 for p in frontier_prefixes(711, BLOCK)]
    assert not any(1.12 <= m <= 1.25 for m in coarse)


def test_p_star_interpolated_from_the_control_ratios():
    assert interpolated_break_even({256: 1.5, 512: 1.1, 768: 0.9, 1024: 0.7}) == pytest.approx(640)
    assert interpolated_break_even({256: 0.9, 512: 0.8}) is None


def test_a_margin_as_wide_as_a_1_5x_error_is_called_too_noisy():
    from pytest_kvoffload.suite_machinery.admission.grid_checks import too_noisy

    t = tier()
    fit = TierFit(t["bandwidth_gbps"] * 1e9, t["fixed_s"], 0)
    quiet = {**t, "enforced_break_even_prefix_tokens": break_even_prefix(fit, RECOMPUTE, KV, 0.02)}
    noisy = {**t, "enforced_break_even_prefix_tokens": break_even_prefix(fit, RECOMPUTE, KV, 0.5)}
    assert too_noisy(quiet, KV) is None
    assert "too noisy" in too_noisy(noisy, KV)


def test_the_scale_1_5_rule_starts_later_than_the_real_one():
    t = tier()
    fit = TierFit(t["bandwidth_gbps"] * 1e9, t["fixed_s"], 0)
    assert planted_break_even(fit, RECOMPUTE, KV, 1.5) > 1.3 * break_even_prefix(fit, RECOMPUTE, KV, 0.02)


def test_planted_modes_parse_and_bad_ones_are_one_line_errors():
    assert admission_mode("static:scale=0.67").scale == 0.67
    assert admission_mode("static:no-fixed").no_fixed and admission_mode("queue:full-credit").full_credit
    for bad in ("static:scale=0", "static:scale=x", "queue:no-fixed", "static:", "sometimes"):
        with pytest.raises(ValueError, match="admission"):
            admission_mode(bad)


def test_full_credit_admits_behind_a_queue_what_the_measured_overlap_declines():
    t = {**tier(), "queue_overlap": 0.0}
    ahead = [(0, 1280)]
    assert not Admission(t, KV, Counters(), "queue")(256, 257, 0, ahead=ahead)
    assert planted_rule(t, KV, Counters(), "queue:full-credit")(256, 257, 0, ahead=ahead)


def test_step_tokens_half_the_longest_prompt_in_whole_blocks():
    assert step_tokens((512, 1536), 128) == 768
    assert step_tokens((256,), 128) == 256


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


RECORDED = sorted((Path(__file__).parents[1] / "fixtures" / "admission").glob("*.json"))


def recorded(path: Path) -> tuple[dict, list, list]:
    data = json.loads(path.read_text())

    def cells(part, declines=True):
        decisions = {int(p): [judge.Decision(*d) for d in c["decisions"]] for p, c in data[part].items()}
        multiples = {int(p): c["multiple"] for p, c in data[part].items()}
        return judge.judge(decisions, multiples, data["margin"], declines=declines)
    return data, cells("frontier"), cells("queue", declines=data["mode"].startswith("queue"))


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_rounds_of_each_rule_are_judged_as_the_suite_judged_them(path):
    """Rounds recorded by the admission suite on this VM (the fixture's `source` is the command): the real
    rule passes, each planted rule fails, naming cells on the side it is wrong on."""
    data, frontier, queue = recorded(path)
    failed = judge.failures(frontier) + judge.failures(queue)
    if data["mode"] in ("queue", "static"):
        assert not failed, failed
    elif data["mode"] in ("always", "static:no-fixed", "static:scale=0.67"):
        assert failed and all(v.multiple < 1 for v in frontier + queue if v.failed), failed
    elif data["mode"] in ("never", "static:scale=1.5"):
        assert failed and all(v.multiple > 1 for v in frontier + queue if v.failed), failed
    elif data["mode"] == "queue:full-credit":
        # Measured, not planted away: behind a queue on this VM the loads do hide (the control's overlap
        # 0.66 to 0.74), so crediting the whole queue took the same loads as the measured overlap did, and
        # none was slower: docs/admission.md, "What it cannot prove".
        _, _, real = recorded(path.with_name("queue.json"))
        assert not failed and [v.admitted for v in queue] == [v.admitted for v in real]


def test_the_queue_overlap_is_measured_when_the_bandwidth_is_unresolved():
    from pytest_kvoffload.suite_machinery.admission.queue_probe import measured_overlap

    # Loads of 0.1 s fixed cost behind 2,000 tokens of prefill ahead, each hit 60% of the way through the
    # queue faster than the fluid model's no-overlap case: e = 0.6 with the bandwidth known or not.
    unresolved = {**tier(), "bandwidth_gbps": None, "fixed_s": 0.1}
    wait = RECOMPUTE(4048) - RECOMPUTE(2048)
    load, saved = 0.1 - RECOMPUTE.a, RECOMPUTE(512) - RECOMPUTE(0)
    cold = 1.0
    hit = cold + load - saved - 0.6 * wait
    probes = {(640, 0.8): {"background_tokens": 4048, "rounds": [{"disk_tokens": 512, "hit_s": hit, "cold_s": cold}]}}
    assert measured_overlap(probes, unresolved, KV, 2048) == pytest.approx(0.6)
    # The control: no probes, no figure (the rule then gives the queue no credit).
    assert measured_overlap({}, unresolved, KV, 2048) is None


def test_engines_a_little_apart_are_told_from_equal_ones_over_seven_rounds():
    # The near miss: one engine 12% slower in every round (noise of +-3% on top) fails; 6% passes.
    noise = [1.00, 1.03, 0.97, 1.02, 0.98, 1.01, 0.99]
    assert not within_cap([1.12 * n for n in noise])
    assert not within_cap([1 / (1.12 * n) for n in noise])
    assert within_cap([1.06 * n for n in noise])
    # The make test run that failed at 384 tokens (kvoffload-disk 9 ms slower in 4 of 5 rounds).
    assert not within_cap([149 / 68, 75 / 75, 74 / 65, 75 / 66, 69 / 60])


def test_the_drive_probe_reads_the_lengths_its_first_server_decided(monkeypatch):
    """On a CPU too slow for the longest default length, the first server's start drops it from the grid
    (measure/grid_lengths.py): the admission suite, often the first to start one, must read the lengths after."""
    from types import SimpleNamespace

    from pytest_kvoffload.suite_machinery.admission import grid_checks

    class Used(Exception):
        pass

    def design_target(lengths, unit):
        raise Used(tuple(lengths))

    monkeypatch.setattr(grid_checks, "design_target", design_target)
    started = []
    servers = SimpleNamespace(endpoint=lambda backend: started.append(backend) or object())
    recorder = SimpleNamespace(settings=SimpleNamespace(kv_bytes_per_token=KV, block_size=BLOCK),
                               lengths=lambda: (512, 1024, 2048) if started else (512, 1024, 2048, 4096),
                               progress=lambda line: None)
    with pytest.raises(Used) as used:
        grid_checks.probe_drive(recorder, servers, SimpleNamespace(name="kvoffload-disk"), judge.CAP)
    assert used.value.args[0] == (512, 1024, 2048)

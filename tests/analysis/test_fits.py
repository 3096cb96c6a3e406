import math

import pytest

from pytest_kvoffload.analysis.fits import analyse, fit_recompute, fit_tier, fit_tier_paired

from pytest_kvoffload.core.costs import RecomputeFit, TierFit, break_even_bandwidth, break_even_prefix, frontier
B = 4096


def test_recompute_fit_recovers_a_quadratic():
    lengths = [512, 1024, 2048, 4096]
    fit = fit_recompute(lengths, [0.01 + 1e-4 * n + 2e-8 * n * n for n in lengths])
    assert (fit.a, fit.b, fit.c) == pytest.approx((0.01, 1e-4, 2e-8), rel=1e-6)


def test_recompute_fit_falls_back_to_a_line():
    fit = fit_recompute([512, 1024], [0.06, 0.11])
    assert fit.c == 0 and fit.b == pytest.approx(0.05 / 512)


def test_tier_fit_recovers_bandwidth_and_fixed_cost():
    recompute = RecomputeFit(0.01, 1e-4, 2e-8)
    bw, fixed = 50e6, 0.02
    points = [(L, p, fixed + p * B / bw + recompute(L) - recompute(p)) for L, p in
              [(1024, 512), (1024, 896), (4096, 2048), (4096, 3968)]]
    tier = fit_tier(points, recompute, B)
    assert tier.bandwidth_bps == pytest.approx(bw) and tier.fixed_s == pytest.approx(fixed)


def test_break_even_bandwidth_and_prefix_agree():
    recompute = RecomputeFit(0.01, 1e-4, 2e-8)
    tier = TierFit(bandwidth_bps=25e6, fixed_s=0.02, points=4)
    p_star = break_even_prefix(tier, recompute, B)
    assert tier.load_seconds(p_star, B) == pytest.approx(recompute(p_star), rel=1e-6)
    # At the break-even prefix, the break-even bandwidth is the tier's own.
    assert break_even_bandwidth(round(p_star), recompute, 0.02, B) == pytest.approx(25e6, rel=0.01)


def test_a_tier_that_never_pays():
    tier = TierFit(bandwidth_bps=1e3, fixed_s=0.5, points=2)
    assert math.isinf(break_even_prefix(tier, RecomputeFit(0.0, 1e-6, 0.0), B))
    assert break_even_bandwidth(100, RecomputeFit(0.0, 1e-6, 0.0), 0.5, B) == math.inf


def test_frontier_is_the_break_even_prefix_over_the_length():
    assert frontier([1000, 4000], 2000.0) == {1000: None, 4000: 0.5}


def test_analyse_cells():
    recompute = RecomputeFit(0.01, 1e-4, 2e-8)
    cells = [{"backend": "kvoffload-disk", "length": n, "fraction": 0.0, "state": "cold", "ttft": {"p50": recompute(n)},
              "sources": {}} for n in (512, 1024, 2048, 4096)]
    for n in (1024, 4096):
        p = n - 128
        cells.append({"backend": "kvoffload-disk", "length": n, "fraction": 1.0, "state": "tier-hit",
                      "ttft": {"p50": 0.02 + p * B / 50e6 + recompute(n) - recompute(p)}, "sources": {"disk": p}})
    result = analyse(cells, B, {"kvoffload-disk": "disk"})["kvoffload-disk"]
    assert result["tier"]["bandwidth_gbps"] == pytest.approx(0.05)
    assert result["tier"]["break_even_prefix_tokens"] > 0
    assert set(result["tier"]["break_even_gbps"]) == {"512", "1024", "2048", "4096"}


def test_paired_fit_uses_the_engine_hit_of_the_same_cell():
    bw, extra = 40e6, 0.004
    pairs = [(p, extra + p * B / bw) for p in (256, 896, 2048, 3968)]
    tier = fit_tier_paired(pairs, 0.03, B)
    assert tier.bandwidth_bps == pytest.approx(bw) and tier.fixed_s == pytest.approx(0.034)


def test_analyse_prefers_engine_hit_pairs():
    recompute = RecomputeFit(0.01, 1e-4, 2e-8)
    cells = [{"backend": "kvoffload-disk", "length": n, "fraction": 0.0, "state": "cold", "ttft": {"p50": recompute(n)},
              "sources": {}} for n in (512, 1024, 2048, 4096)]
    for n in (1024, 4096):
        p = n - 128
        engine = 0.01 + recompute(n) - recompute(p)
        cells.append({"backend": "kvoffload-disk", "length": n, "fraction": 1.0, "state": "engine-hit",
                      "ttft": {"p50": engine}, "sources": {"device": p}})
        cells.append({"backend": "kvoffload-disk", "length": n, "fraction": 1.0, "state": "tier-hit",
                      "ttft": {"p50": engine + 0.005 + p * B / 50e6}, "sources": {"disk": p}})
    tier = analyse(cells, B, {"kvoffload-disk": "disk"})["kvoffload-disk"]["tier"]
    assert tier["method"] == "paired with engine hits"
    assert tier["bandwidth_gbps"] == pytest.approx(0.05) and tier["fixed_s"] == pytest.approx(0.015)


def test_break_even_prefix_is_where_hits_pay_from_on_not_a_fixed_cost_island():
    # Fixed cost below the recompute intercept (pays for tiny prefixes), transfer dearer than the linear
    # recompute term, quadratic attention catching up later: hits pay again only from the larger root.
    recompute = RecomputeFit(0.048, 5.55e-05, 2.99e-08)
    tier = TierFit(bandwidth_bps=24.3e6, fixed_s=0.041, points=8)
    p_star = break_even_prefix(tier, recompute, B)
    assert 3000 < p_star < 5000
    assert tier.load_seconds(p_star, B) == pytest.approx(recompute(p_star), rel=1e-6)
    assert tier.load_seconds(p_star * 1.1, B) < recompute(p_star * 1.1)
    assert tier.load_seconds(1000, B) > recompute(1000)


def test_seed_model_at_the_measured_prefill_speed():
    from pytest_kvoffload.core.first_order import first_order_at_measured_speed
    from pytest_kvoffload.core.models import load_model

    model = load_model("tiny-llama")
    cold = {512: 0.05, 1024: 0.1, 4096: 0.8}
    seed = first_order_at_measured_speed(model, cold)
    assert seed["from_tokens"] == 4096 and seed["tflops"] > 0
    # At the length it was fitted on, the formula's prefill time is the measured one.
    assert seed["gbps"]["4096"] == pytest.approx(model.kv_bytes_per_token() * 4096 / 0.8 / 1e9)
    # Shorter prompts need more bandwidth per the first-order model (the quadratic term shrinks faster than n).
    assert seed["gbps"]["512"] > seed["gbps"]["4096"]


def test_report_puts_the_seed_model_beside_the_measured_break_even():
    from pytest_kvoffload.record.report import break_even_lines

    analysis = {"kvoffload-disk": {"tier": {
        "source": "disk", "bandwidth_gbps": 0.5, "fixed_s": 0.03, "break_even_prefix_tokens": 900.0,
        "break_even_gbps": {"512": 0.8, "4096": 0.2}, "frontier": {"512": None, "4096": 0.22},
        "first_order": {"tflops": 0.04, "from_tokens": 4096, "gbps": {"512": 0.3, "4096": 0.1}}}}}
    text = "\n".join(break_even_lines(analysis))
    assert "first-order GB/s" in text and "0.300" in text and "at the 0.04 TFLOP/s this run's cold 4,096-token" in text


@pytest.mark.parametrize("planted", [0.0, 0.5, 1.0])
def test_queue_overlap_recovers_a_planted_overlap(planted):
    from pytest_kvoffload.analysis.fits import queue_overlap
    from pytest_kvoffload.core.costs import load_and_recompute
    # An intercept and a quadratic term: the cost of the first p tokens differs from that of the last p.
    recompute = RecomputeFit(0.04, 1e-4, 3e-8)
    fixed, per_token = 0.06, 4096 / 20e6

    def load_and_saved(tokens):
        return load_and_recompute(tokens, 0, recompute, fixed, per_token)

    wait = 0.1  # below every load, so the fluid model's max(0, L - e W) stays unclipped: e is identifiable
    samples = []
    for length, tokens in [(1024, 512), (1024, 768), (2048, 1024), (2048, 1792), (4096, 3840)]:
        load, saved = load_and_saved(tokens)
        cold = wait + recompute(length)
        hit = wait + recompute(length) - saved + max(0.0, load - planted * wait)
        samples.append((length, tokens, hit, cold))
    assert queue_overlap(samples, load_and_saved, wait) == pytest.approx(planted, abs=0.05)


def test_queue_overlap_clamps_and_needs_samples():
    from pytest_kvoffload.analysis.fits import queue_overlap

    assert queue_overlap([(2048, 1792, 3.0, 1.0)], lambda n: (0.3, 0.2), 0.5) == 0.0
    assert queue_overlap([], lambda n: (0.3, 0.2), 0.5) is None


def test_break_even_prefix_and_the_admission_rule_agree_on_random_calibrations():
    """One definition of "a load pays": the rule at margin 0 with nothing local admits exactly the prefixes
    the analysis says pay, so the break-even in calibration.json is the one the connector enforces."""
    import numpy as np

    from pytest_kvoffload.connector.admission_rule import Admission
    from pytest_kvoffload.connector.counters import Counters

    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(300):
        recompute = RecomputeFit(float(rng.uniform(0, 0.1)), float(rng.uniform(1e-5, 5e-4)),
                                 float(rng.choice([0.0, rng.uniform(0, 5e-8)])))
        tier = TierFit(float(rng.uniform(5e6, 5e9)), float(rng.uniform(0, 0.2)), 4)
        p_star = break_even_prefix(tier, recompute, B)
        rule = Admission({"recompute": vars(recompute), "bandwidth_gbps": tier.bandwidth_bps / 1e9,
                          "fixed_s": tier.fixed_s, "margin": 0.0}, B, Counters(), mode="static")
        if math.isinf(p_star) or p_star > 1e6:
            assert not rule(10**6, 10**6 + 1, 0)
            continue
        for p in (p_star * 1.01 + 1, p_star * 2 + 1, p_star * 10 + 1):
            assert rule(round(p), round(p) + 1, 0), (recompute, tier, p_star, p)
        if p_star > 2:
            h = lambda p: recompute(p) - recompute.a - (tier.fixed_s - recompute.a + p * B / tier.bandwidth_bps)
            below = p_star * 0.99 - 1
            assert rule(round(below), round(below) + 1, 0) == (h(round(below)) > 0)
            checked += 1
    assert checked > 50


# ---- bandwidths with their uncertainty ----

def paired_cells(bw, fixed, lengths, spread, n=3, base=0.01):
    """Cells of one tier backend: engine and tier hits of fully cached prompts whose difference is
    extra fixed + p B / bw, each cell measured with `spread` relative noise over n rounds."""
    recompute = RecomputeFit(base, 1e-4, 2e-8)
    cells = [{"backend": "t", "length": L, "fraction": 0.0, "state": "cold", "sources": {},
              "ttft": {"p50": recompute(L), "spread": spread, "n": n}} for L in lengths]
    for L in lengths:
        p = L - 128
        engine = recompute(L) - recompute(p) + base
        cells.append({"backend": "t", "length": L, "fraction": 1.0, "state": "engine-hit", "sources": {"device": p},
                      "ttft": {"p50": engine, "spread": spread, "n": n}})
        cells.append({"backend": "t", "length": L, "fraction": 1.0, "state": "tier-hit", "sources": {"disk": p},
                      "ttft": {"p50": engine + fixed + p * B / bw, "spread": spread, "n": n}})
    return analyse(cells, B, {"t": "disk"})["t"]["tier"]


def test_a_bandwidth_whose_transfers_dominate_is_resolved_with_an_interval_around_it():
    tier = paired_cells(bw=30e6, fixed=0.02, lengths=[512, 1024, 2048, 4096], spread=0.01)
    low, high = tier["bandwidth_interval_gbps"]
    assert tier["resolved"] and low < 0.030 < high and high / low < 1.5
    assert tier["fixed_interval_s"][0] < tier["fixed_s"] < tier["fixed_interval_s"][1]


def test_loads_inside_the_noise_leave_the_bandwidth_unresolved_and_the_break_even_a_bound():
    # 2 GB/s: a 16 MB load takes 8 ms, beside cells of 100 to 1,200 ms measured at 5% spread.
    tier = paired_cells(bw=2e9, fixed=0.005, lengths=[512, 1024, 2048, 4096], spread=0.05)
    assert not tier["resolved"] and tier["bandwidth_interval_gbps"][1] is None
    assert 0 < tier["bandwidth_interval_gbps"][0] < 2.0
    assert tier["break_even_prefix_at_most_tokens"] is not None


def test_the_report_prints_no_bandwidth_without_its_interval_and_flags_one_faster_than_the_drive():
    from pytest_kvoffload.record.report import tier_line

    resolved = paired_cells(bw=30e6, fixed=0.02, lengths=[512, 1024, 2048, 4096], spread=0.01)
    line = tier_line("t", resolved, drive_read_gbps=1.4)
    assert "measured 0.030 GB/s effective (95%: " in line and "FLAG" not in line
    noisy = paired_cells(bw=2e9, fixed=0.005, lengths=[512, 1024, 2048, 4096], spread=0.05)
    line = tier_line("t", noisy, drive_read_gbps=1.4)
    assert "bandwidth unresolved (" in line and "take too little time to tell from the rounds' noise: at least" in line
    assert "pays from at most" in line or "pays at any prefix length" in line
    fast = dict(resolved, bandwidth_gbps=71.369)
    assert "FLAG: 51.0x the O_DIRECT read of this run's drive (1.40 GB/s)" in tier_line("t", fast, drive_read_gbps=1.4)


def test_the_drive_flag_sits_at_one_and_a_half_times_the_drive_not_near_it():
    from pytest_kvoffload.record.report import tier_line

    tier = paired_cells(bw=30e6, fixed=0.02, lengths=[512, 1024, 2048, 4096], spread=0.01)
    assert "FLAG" in tier_line("t", dict(tier, bandwidth_gbps=1.6), drive_read_gbps=1.0)    # 1.6x: a near miss
    assert "FLAG" not in tier_line("t", dict(tier, bandwidth_gbps=1.4), drive_read_gbps=1.0)  # 1.4x: a drive's noise
    host = dict(tier, source="host", bandwidth_gbps=50.0)
    assert "FLAG" not in tier_line("t", host, drive_read_gbps=1.0)  # a memory tier is not held to the drive

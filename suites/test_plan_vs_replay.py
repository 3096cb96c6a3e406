"""The planner (`kvoffload plan`) checked against measurement: the --kv-trace slice replayed one request at
a time through gpu-only and kvoffload-disk, and planned from this run's own figures (the backend's
recompute fit and tier, the engine's KV capacity read from the server), compared request by request.

Where each request's cached tokens came from must agree for at least 95% of the requests (asserted: it
is what the planner simulates, block by block); the median TTFT error is printed beside its 20% target,
never asserted (a speed). Runs after the backend's cells (marker kv_after_cells), whose fit it uses.

A backend with a tier replays the slice after a warming pass that leaves it in the tier and not in the
engine (as the trace replay does), and is planned the same way: at least 20% of its requests are then
served in part by the tier, and the sources of those must agree for 95% of them too (asserted), their
TTFT error printed apart from engine hits' and misses'.
"""

import pytest
from tabulate import tabulate

from pytest_kvoffload.suite_machinery import plan_vs_replay as plan_check
from pytest_kvoffload.analysis.fits import analyse
from pytest_kvoffload.core.progress import Tracker

NAME = "plan vs replay"
# A tier backend's replay must have the tier serve at least this share of its requests to check the plan's tier.
TIER_SHARE = 0.20
# The backends the planner models: the engine's cache alone, and it with this package's disk tier.
CHECKED = ("gpu-only", "kvoffload-disk")

pytestmark = [pytest.mark.xdist_group("trace-replay"), pytest.mark.kv_after_cells]


def _table(comparison: plan_check.Comparison, limit: int = 12) -> str:
    rows = [[r["line"], r["prompt_tokens"], r["measured_sources"], r["planned_sources"],
             f"{r['measured_ttft_s'] * 1e3:,.0f}", f"{r['planned_ttft_s'] * 1e3:,.0f}",
             "-" if r["ttft_error"] is None else f"{r['ttft_error']:.0%}"] for r in comparison.rows[:limit]]
    return tabulate(rows, headers=["trace line", "tokens", "measured from", "planned from", "measured ms",
                                   "planned ms", "error"], disable_numparse=True)


def _by_kind(comparison: plan_check.Comparison, warm: bool) -> str:
    """Per kind of request as measured: its share, the plan's source agreement, the median TTFT error."""
    parts = []
    for kind in plan_check.KINDS:
        agree, error = comparison.agreement(kind), comparison.median_error(kind)
        if agree is not None:
            parts.append(f"{kind} {comparison.share(kind):.0%} of requests, sources agree {agree:.0%}, median TTFT "
                         f"error {'-' if error is None else f'{error:.0%}'}")
    how = "after a warming pass left the slice in the tier only; " if warm else ""
    return f"{how}by kind: " + "; ".join(parts)


def test_plan_matches_the_replay(kv_session, kv_backend, kv_server):
    plan = kv_session.replay_plan
    if plan is None:
        pytest.skip("no --kv-trace given")
    if kv_backend.name not in CHECKED:
        pytest.skip(f"the planner is checked on {' and '.join(CHECKED)}")
    settings = kv_session.settings
    cells = kv_session.cells(kv_backend.name)
    entry = analyse(cells, settings.kv_bytes_per_token, {kv_backend.name: kv_backend.tier} if kv_backend.tier else {}) \
        .get(kv_backend.name) if cells else None
    if not entry or not entry.get("recompute"):
        pytest.skip(f"needs {kv_backend.name}'s cold cells (suites/test_ttft.py) measured in this run")
    if kv_backend.tier and not entry.get("tier"):
        pytest.skip(f"needs {kv_backend.name}'s tier-hit cells (suites/test_ttft.py) measured in this run")
    engine_tokens = plan_check.engine_capacity_tokens(kv_server.metrics_text())
    if engine_tokens is None:
        pytest.skip("the server does not report its KV capacity (vllm:cache_config_info)")
    profile = plan_check.profile_of_run(entry["recompute"], entry.get("tier"), kv_backend.tier,
                                        settings.kv_bytes_per_token, engine_tokens, settings.disk_gb * 1e9,
                                        entry.get("hit_base_s"))
    warm = bool(kv_backend.tier)
    planned = plan_check.plan_slice(plan, profile, settings.block_size,
                                    admission=bool(settings.disk_opts.get("calibration")), warm=warm)
    measured = plan_check.replay_one_at_a_time(
        kv_server, plan, settings.model.vocab_size, f"{kv_session.salt}|plan-check",
        Tracker(kv_session.progress, f"plan check on {kv_backend.name}", len(planned), "requests"),
        warm_for=kv_backend if warm else None)
    shortest = min(c["length"] for c in cells)
    comparison = plan_check.compare(measured, planned, fit_from_tokens=shortest)
    described = plan.describe()
    text = (f"{kv_backend.name}: {comparison.requests} requests one at a time (reuse share "
            f"{described['reuse_share']:.0%}, the whole trace's {described['trace_reuse_share']:.0%}), engine "
            f"{engine_tokens:,} tokens; cache sources agree for {comparison.source_agreement:.0%} (at least "
            f"{plan_check.SOURCE_AGREEMENT:.0%} asserted), median TTFT error {comparison.median_abs_ttft_error:.0%} "
            f"over prompts of {shortest:,}+ tokens, the fit's range (target {plan_check.TTFT_ERROR_TARGET:.0%}, "
            f"not asserted)\n{_by_kind(comparison, warm)}\n" + _table(comparison))
    bench = kv_session.benchmark(NAME)
    texts = {**bench.get("texts", {}), kv_backend.name: text}
    comparisons = {**bench.get("backends", {}), kv_backend.name: comparison.to_dict()}
    kv_session.add_benchmark(NAME, "\n\n".join(texts.values()), {"texts": texts, "backends": comparisons})
    assert comparison.source_agreement >= plan_check.SOURCE_AGREEMENT, \
        "the plan got these requests' cache sources wrong: " + "; ".join(comparison.problems()[:5])
    if warm:
        assert comparison.share("tier") >= TIER_SHARE, \
            f"the tier served {comparison.share('tier'):.0%} of the requests, under {TIER_SHARE:.0%}: no check of the plan's tier"
        assert comparison.agreement("tier") >= plan_check.SOURCE_AGREEMENT, \
            f"tier-served requests: sources agree for {comparison.agreement('tier'):.0%}"

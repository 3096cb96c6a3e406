"""The planner checked against a replay: the same trace slice replayed closed-loop, one request at a time
(each request's cache sources read from the server's counters around it), and planned from this run's own
measurements (its recompute fit, its tier's bandwidth and fixed cost, the server's engine capacity), then
compared request by request: where each request's cached tokens came from, and its TTFT."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pytest_kvoffload.core.costs import RecomputeFit
from pytest_kvoffload.serve.backend import Backend
from pytest_kvoffload.serve.client import Endpoint, measure
from pytest_kvoffload.measure.runner import leave_in_tier_only
from pytest_kvoffload.planner.simulate import Profile, Served, Tier, simulate
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.traces.selection import ReplayPlan
from pytest_kvoffload.planner.simulate import BASELINE

# The share of requests whose cache sources the plan must get right, and the TTFT error it aims at.
SOURCE_AGREEMENT = 0.95
TTFT_ERROR_TARGET = 0.20


@dataclass
class Measured:
    line: int
    prompt_tokens: int
    cached_by_source: dict[str, int]
    ttft_s: float


def sources(tokens_by_source: dict[str, int]) -> str:
    """'device', 'disk', 'device+disk' or 'none': which sources served any of a request's tokens."""
    return "+".join(sorted(name for name, tokens in tokens_by_source.items() if tokens)) or "none"


def planned_sources(served: Served) -> str:
    return sources({"device": served.engine, **served.loaded})


def engine_capacity_tokens(metrics_text: str) -> int | None:
    """The engine's KV capacity, from vLLM's cache_config_info (num_gpu_blocks x block_size)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                blocks, block = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if blocks not in (None, "", "None") and block not in (None, ""):
                    return int(blocks) * int(block)
    return None


def replay_one_at_a_time(endpoint: Endpoint, plan: ReplayPlan, vocab_size: int, salt: str,
                         tracker: Tracker | None = None, warm_for: Backend | None = None) -> list[Measured]:
    """The slice in trace order, each request alone (closed loop, concurrency 1), from empty caches; with
    `warm_for`, after a warming pass of it left in that backend's tiers and not in its engine (as the
    trace replay's, suite_machinery/trace_replay.py:warm_pass; plan_slice(warm=True) plans the same)."""
    endpoint.reset_prefix_cache(external=True)
    items = plan.items(vocab_size, salt)
    if warm_for is not None:
        leave_in_tier_only(endpoint, warm_for, lambda i: [measure(endpoint, item.tokens) for item in items])
    out = []
    for item in items:
        result = measure(endpoint, item.tokens)
        out.append(Measured(item.line, result.prompt_tokens, dict(result.cached_by_source), result.client_ttft_s))
        if tracker is not None:
            tracker.step()
    return out


def profile_of_run(recompute: dict, tier: dict | None, tier_name: str | None, kv_bytes_per_token: int,
                   engine_tokens: int, tier_capacity_bytes: float, hit_base_s: float | None = None) -> Profile:
    """A planner profile from one backend's analysis entry (analysis/fits.py): its recompute fit, what an engine
    hit costs beyond its suffix, and, with a tier, that tier's bandwidth and fixed cost at the tier's
    configured capacity."""
    tiers = {}
    if tier and tier_name:
        bandwidth = tier["bandwidth_gbps"] * 1e9 if tier.get("bandwidth_gbps") else float("inf")
        tiers[tier_name] = Tier(tier_name, bandwidth, tier_capacity_bytes, max(0.0, tier["fixed_s"]), includes_base=True)
    return Profile(RecomputeFit(**recompute), kv_bytes_per_token, float(engine_tokens * kv_bytes_per_token), tiers,
                   "this run's measurements", hit_base_s)


def plan_slice(plan: ReplayPlan, profile: Profile, block_size: int, admission: bool, warm: bool = False) -> list[Served]:
    """The planner on the replayed slice, in the configuration of the backend: its tier if it has one."""
    result = simulate(plan.requests(), plan.trace.format, plan.scaling, profile, block_size, admission=admission,
                      warm=warm)
    config = "+" + next(iter(profile.tiers)) if profile.tiers else BASELINE
    return result["configs"][config]


@dataclass
class Comparison:
    requests: int
    source_agreement: float
    median_abs_ttft_error: float
    rows: list[dict]

    def to_dict(self) -> dict:
        return {**asdict(self), "tier_share": self.share("tier"), "tier_agreement": self.agreement("tier"),
                "median_abs_ttft_error_by_kind": {k: self.median_error(k) for k in KINDS}}

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.rows if r["kind"] == kind]

    def share(self, kind: str) -> float:
        """The share of requests of one kind (KINDS), as measured."""
        return len(self.of_kind(kind)) / len(self.rows) if self.rows else 0.0

    def agreement(self, kind: str) -> float | None:
        """Source agreement over the requests of one kind; None where there are none."""
        rows = self.of_kind(kind)
        return float(np.mean([r["measured_sources"] == r["planned_sources"] for r in rows])) if rows else None

    def median_error(self, kind: str) -> float | None:
        errors = [r["ttft_error"] for r in self.of_kind(kind) if r["ttft_error"] is not None]
        return float(np.median(errors)) if errors else None

    def problems(self) -> list[str]:
        """What a failing check says: the requests whose sources the plan got wrong."""
        wrong = [r for r in self.rows if r["measured_sources"] != r["planned_sources"]]
        return [f"line {r['line']}: measured {r['measured_sources']} {r['measured_cached']}, planned "
                f"{r['planned_sources']} {r['planned_cached']}" for r in wrong]


# A request served in part by a tier, by the engine alone, or by neither (as measured).
KINDS = ("tier", "engine", "miss")


def kind_of(cached_by_source: dict[str, int]) -> str:
    if any(n for source, n in cached_by_source.items() if source != "device"):
        return "tier"
    return "engine" if cached_by_source.get("device") else "miss"


def compare(measured: list[Measured], planned: list[Served], fit_from_tokens: int = 0) -> Comparison:
    """Request by request. TTFT errors only of prompts of at least `fit_from_tokens` (the shortest length
    the recompute fit was measured at): below it the fit extrapolates, even to negative times."""
    rows = []
    for m, p in zip(measured, planned):
        planned_cached = {"device": p.engine, **p.loaded}
        rows.append({"line": m.line, "prompt_tokens": m.prompt_tokens, "kind": kind_of(m.cached_by_source),
                     "measured_sources": sources(m.cached_by_source), "planned_sources": planned_sources(p),
                     "measured_cached": {k: v for k, v in m.cached_by_source.items() if v},
                     "planned_cached": {k: v for k, v in planned_cached.items() if v},
                     "measured_ttft_s": m.ttft_s, "planned_ttft_s": p.ttft_s,
                     "ttft_error": abs(p.ttft_s - m.ttft_s) / m.ttft_s
                     if m.ttft_s and m.prompt_tokens >= fit_from_tokens else None})
    agree = float(np.mean([r["measured_sources"] == r["planned_sources"] for r in rows])) if rows else 0.0
    errors = [r["ttft_error"] for r in rows if r["ttft_error"] is not None]
    return Comparison(len(rows), agree, float(np.median(errors)) if errors else float("nan"), rows)

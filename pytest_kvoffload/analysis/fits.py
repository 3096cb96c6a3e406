"""From measured cells to break-even figures: recompute fit, tier fit, break-even bandwidth and prefix.

Model (core/costs.py; the suffix a partial hit still computes included):
    cold TTFT            t(n) = a + b n + c n^2
    tier-hit TTFT        t_fixed + p B / bw + (t(L) - t(p))      p cached tokens of an L-token prompt
so  tier-hit TTFT - (t(L) - t(p)) = t_fixed + p B / bw, a straight line in p.
A hit of p tokens pays when t_fixed + p B / bw < t(p); the break-even prefix p* is where they meet.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

from pytest_kvoffload.core.costs import (RecomputeFit, TierFit, admission_margin, break_even_bandwidth,
                                         break_even_prefix, frontier)
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.analysis.intervals import t_quantile


def fit_recompute(lengths: list[float], seconds: list[float]) -> RecomputeFit:
    """Least squares of a + b n + c n^2; c and then b held at zero if the data make them negative."""
    n = np.asarray(lengths, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if len(n) == 0:
        raise ValueError("no cold measurements to fit")
    if len(set(n)) >= 3:
        a, b, c = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], 1), t, rcond=None)[0]
        if c >= 0 and b >= 0:
            return RecomputeFit(float(a), float(b), float(c))
    if len(set(n)) >= 2:
        a, b = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), t, rcond=None)[0]
        if b >= 0:
            return RecomputeFit(float(a), float(b), 0.0)
    return RecomputeFit(float(t.mean()), 0.0, 0.0)


def line_with_errors(x: np.ndarray, y: np.ndarray, sigma: np.ndarray | None = None,
                     sigma_df: int = 0) -> tuple[float, float, float, float, int]:
    """Least squares y = slope x + intercept, the standard errors of both, and their degrees of freedom. The
    noise is the larger of the residuals' (n - 2 degrees of freedom) and the points' own (`sigma`, each
    point's standard error from its rounds, on `sigma_df`): two points leave no residual, yet their medians
    were noisy. With neither, the standard errors are infinite: a line through two points shows nothing."""
    n = len(x)
    slope, intercept = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)[0]
    residual = y - (slope * x + intercept)
    variance, df = (float(np.sum(residual ** 2) / (n - 2)), n - 2) if n > 2 else (math.inf, 0)
    if sigma is not None and len(sigma) and sigma_df > 0:
        own = float(np.mean(np.asarray(sigma) ** 2))
        if own >= variance or df == 0:
            variance, df = own, sigma_df
    sxx = float(np.sum((x - x.mean()) ** 2))
    se_slope = math.sqrt(variance / sxx) if sxx > 0 else math.inf
    se_intercept = math.sqrt(variance * (1 / n + x.mean() ** 2 / sxx)) if sxx > 0 else math.inf
    return float(slope), float(intercept), se_slope, se_intercept, df


def tier_fit_with_interval(slope: float, fixed: float, se_slope: float, se_fixed: float, points: int,
                           df: int) -> TierFit:
    """A TierFit from a line's slope (seconds per byte) and intercept, with its 95% t interval."""
    t = t_quantile(df)
    low_slope, high_slope = slope - t * se_slope, slope + t * se_slope
    bandwidth = 1.0 / slope if slope > 0 else math.inf
    return TierFit(bandwidth, fixed, points,
                   bandwidth_low_bps=1.0 / high_slope if high_slope > 0 and math.isfinite(high_slope) else 0.0,
                   bandwidth_high_bps=1.0 / low_slope if low_slope > 0 else math.inf,
                   fixed_low_s=fixed - t * se_fixed, fixed_high_s=fixed + t * se_fixed)


def point_sigma(cell: dict) -> float:
    """The standard error of a cell's median TTFT from its rounds: spread is the relative half
    inter-quartile range (0.674 sigma for normal noise), and a median of n rounds has 1.25 sigma / sqrt(n)."""
    t = cell["ttft"]
    return 1.2533 * (t.get("spread", 0.0) * t["p50"] / 0.6745) / math.sqrt(max(1, t.get("n", 1)))


def fit_tier(points: list[tuple[int, int, float]], recompute: RecomputeFit, kv_bytes_per_token: int) -> TierFit | None:
    """points: (prompt tokens L, cached tokens p, tier-hit TTFT seconds), p > 0."""
    usable = [(L, p, t) for L, p, t in points if p > 0]
    if not usable:
        return None
    x = np.asarray([p * kv_bytes_per_token for _, p, _ in usable], dtype=float)
    y = np.asarray([t - (recompute(L) - recompute(p)) for L, p, t in usable], dtype=float)
    if len(set(x)) < 2:
        return TierFit(math.inf, float(y.mean()), len(usable))
    slope, fixed, se_slope, se_fixed, df = line_with_errors(x, y)
    if slope <= 0:
        # Transfer time below what this grid resolves: all of the cost is fixed.
        spread = t_quantile(df) * se_slope
        return TierFit(math.inf, float(y.mean()), len(usable),
                       bandwidth_low_bps=1.0 / spread if 0 < spread < math.inf else 0.0)
    return tier_fit_with_interval(slope, fixed, se_slope, se_fixed, len(usable), df)


def fit_tier_paired(pairs: list[tuple[int, float]], base_s: float, kv_bytes_per_token: int,
                    sigmas: list[float] | None = None, sigma_df: int = 0) -> TierFit | None:
    """pairs: (cached tokens p, tier-hit TTFT minus engine-hit TTFT of the same cell); sigmas: each
    difference's standard error from the two cells' rounds (point_sigma), for the interval.

    An engine hit of the same cell computes the same suffix, so the difference is the tier's own cost,
    extra_fixed + p B / bw, free of the recompute fit's noise. base_s (what a hit costs with nothing to
    transfer) is added to the intercept so the fixed cost compares with t(p) like the first-order model's.
    """
    usable = [(p, d) for p, d in pairs if p > 0]
    if not usable:
        return None
    x = np.asarray([p * kv_bytes_per_token for p, _ in usable], dtype=float)
    y = np.asarray([d for _, d in usable], dtype=float)
    sigma = np.asarray([s for (p, _), s in zip(pairs, sigmas) if p > 0], dtype=float) if sigmas else None
    if len(set(x)) >= 2:
        slope, extra, se_slope, se_extra, df = line_with_errors(x, y, sigma, sigma_df)
    else:
        slope, extra = (y[0] / x[0], 0.0) if y[0] > 0 else (0.0, float(y[0]))
        se_slope, se_extra, df = math.inf, math.inf, 0  # one prefix length: bandwidth and fixed cost inseparable
    fixed = base_s + max(0.0, float(extra))
    if slope <= 0:
        t = t_quantile(df)
        low = 1.0 / (t * se_slope) if 0 < t * se_slope < math.inf else 0.0
        return TierFit(math.inf, fixed, len(usable), bandwidth_low_bps=low,
                       fixed_low_s=fixed - t * se_extra, fixed_high_s=fixed + t * se_extra)
    return tier_fit_with_interval(slope, fixed, se_slope, se_extra, len(usable), df)


def analyse(cells: list[dict], kv_bytes_per_token: int, tiers: dict[str, str]) -> dict:
    """Per backend: the recompute fit, each tier's fit and its break-even figures. tiers: backend -> source."""
    out: dict = {}
    for backend in sorted({c["backend"] for c in cells}):
        mine = [c for c in cells if c["backend"] == backend]
        cold = [c for c in mine if c["state"] == State.COLD.value]
        if not cold:
            continue
        recompute = fit_recompute([c["length"] for c in cold], [c["ttft"]["p50"] for c in cold])
        lengths = sorted({c["length"] for c in cold})
        # The cells' typical relative spread: how close to the threshold a decision is a coin flip.
        spreads = [c["ttft"].get("spread", 0.0) for c in mine if c["state"] in (State.COLD.value, State.TIER_HIT.value)]
        entry: dict = {"recompute": asdict(recompute), "tier": None, "noise": float(np.median(spreads))}
        source = tiers.get(backend)
        tier_cells = [c for c in mine if c["state"] == State.TIER_HIT.value and source]
        engine = {(c["length"], c["fraction"]): c for c in mine if c["state"] == State.ENGINE_HIT.value}
        paired = [(c, engine[(c["length"], c["fraction"])]) for c in tier_cells if (c["length"], c["fraction"]) in engine]
        pairs = [(round(c["sources"].get(source, 0)), c["ttft"]["p50"] - e["ttft"]["p50"]) for c, e in paired]
        sigmas = [math.hypot(point_sigma(c), point_sigma(e)) for c, e in paired]
        # Each difference's standard error rests on its two cells' rounds.
        sigma_df = sum(max(0, c["ttft"].get("n", 1) - 1) + max(0, e["ttft"].get("n", 1) - 1) for c, e in paired)
        # What a hit costs beyond its suffix when nothing is transferred: the engine hits' residual.
        residual = [e["ttft"]["p50"] - (recompute(e["length"]) - recompute(round(e["sources"].get("device", 0))))
                    for e in engine.values()]
        if residual:
            entry["hit_base_s"] = max(0.0, float(np.median(residual)))
        loaded = [round(c["sources"].get(source, 0)) * kv_bytes_per_token / 1e6 for c in tier_cells
                  if c["sources"].get(source)]
        if pairs:
            tier = fit_tier_paired(pairs, entry["hit_base_s"], kv_bytes_per_token, sigmas, sigma_df)
            method = "paired with engine hits"
        else:
            hits = [(c["length"], round(c["sources"].get(source, 0)), c["ttft"]["p50"]) for c in tier_cells]
            tier = fit_tier(hits, recompute, kv_bytes_per_token) if hits else None
            method = "against the recompute fit"
        if tier is not None:
            p_star = break_even_prefix(tier, recompute, kv_bytes_per_token)
            margin = admission_margin(entry["noise"])
            enforced = break_even_prefix(tier, recompute, kv_bytes_per_token, margin)
            # The break-even prefix at the interval's lowest bandwidth: with the bandwidth unresolved, the
            # prefix from which hits pay is known only as at most this.
            slowest = TierFit(tier.bandwidth_low_bps or math.inf, tier.fixed_s, tier.points)
            p_bound = break_even_prefix(slowest, recompute, kv_bytes_per_token) if tier.bandwidth_low_bps else math.inf
            entry["tier"] = {
                "source": source,
                "method": method,
                "bandwidth_gbps": None if math.isinf(tier.bandwidth_bps) else tier.bandwidth_bps / 1e9,
                "resolved": tier.resolved,
                "bandwidth_interval_gbps": [tier.bandwidth_low_bps / 1e9,
                                            None if math.isinf(tier.bandwidth_high_bps) else tier.bandwidth_high_bps / 1e9],
                "fixed_interval_s": [None if math.isinf(tier.fixed_low_s) else tier.fixed_low_s,
                                     None if math.isinf(tier.fixed_high_s) else tier.fixed_high_s],
                "break_even_prefix_at_most_tokens": None if math.isinf(p_bound) else p_bound,
                # What the connector's static rule takes, margin included (calibration.json carries both).
                "margin": margin,
                "enforced_break_even_prefix_tokens": None if math.isinf(enforced) else enforced,
                "load_mb": [min(loaded), max(loaded)] if loaded else None,
                "fixed_s": tier.fixed_s,
                "points": tier.points,
                "break_even_prefix_tokens": None if math.isinf(p_star) else p_star,
                "break_even_gbps": {str(n): _finite(break_even_bandwidth(n, recompute, tier.fixed_s,
                                                                          kv_bytes_per_token)) for n in lengths},
                "frontier": {str(n): f for n, f in frontier(lengths, p_star).items()},
            }
        out[backend] = entry
    return out


def _finite(bps: float) -> float | None:
    return None if math.isinf(bps) else bps / 1e9


def queue_overlap(samples: list[tuple[int, int, float, float]], load_and_saved, wait_s: float) -> float | None:
    """How much of a queue a load really hides in: 0 (the load waits its turn too) to 1 (fully hidden).

    samples: (prompt length, tokens loaded, hit TTFT, cold TTFT) of probes sent behind the same long
    prefill, with every load taken; load_and_saved(tokens) the (load, recompute) seconds of
    load_and_recompute for those tokens; wait_s the prefill ahead of the probe (W). In the fluid model a
    load of L seconds that progresses for a share e of W, replacing t_p seconds of recompute, gives
    hit - cold = max(0, L - e W) - t_p; so e = (L - t_p - (hit - cold)) / W, the median over samples,
    within [0, 1].
    """
    if wait_s <= 0 or not samples:
        return None
    shares = []
    for _, tokens, hit, cold in samples:
        load, saved = load_and_saved(tokens)
        shares.append((load - saved - (hit - cold)) / wait_s)
    return float(min(1.0, max(0.0, np.median(shares))))

"""From measured cells to break-even figures: recompute fit, tier fit, break-even bandwidth and prefix.

Model (the seed's, with the suffix that a partial hit still computes):
    cold TTFT            t(n) = a + b n + c n^2
    tier-hit TTFT        t_fixed + p B / bw + (t(L) - t(p))      p cached tokens of an L-token prompt
so  tier-hit TTFT - (t(L) - t(p)) = t_fixed + p B / bw, a straight line in p.
A hit of p tokens pays when t_fixed + p B / bw < t(p); the break-even prefix p* is where they meet.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .cells import State


@dataclass(frozen=True)
class RecomputeFit:
    a: float
    b: float
    c: float

    def __call__(self, n: float) -> float:
        return self.a + self.b * n + self.c * n * n


@dataclass(frozen=True)
class TierFit:
    bandwidth_bps: float  # effective bytes per second of the tier (inf when loads cost nothing measurable)
    fixed_s: float
    points: int

    def load_seconds(self, tokens: float, kv_bytes_per_token: int) -> float:
        return self.fixed_s + tokens * kv_bytes_per_token / self.bandwidth_bps


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


def fit_tier(points: list[tuple[int, int, float]], recompute: RecomputeFit, kv_bytes_per_token: int) -> TierFit | None:
    """points: (prompt tokens L, cached tokens p, tier-hit TTFT seconds), p > 0."""
    usable = [(L, p, t) for L, p, t in points if p > 0]
    if not usable:
        return None
    x = np.asarray([p * kv_bytes_per_token for _, p, _ in usable], dtype=float)
    y = np.asarray([t - (recompute(L) - recompute(p)) for L, p, t in usable], dtype=float)
    if len(set(x)) >= 2:
        slope, fixed = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)[0]
    else:
        slope, fixed = 0.0, float(y.mean())
    if slope <= 0:
        # Transfer time below what this grid resolves: all of the cost is fixed.
        return TierFit(math.inf, float(y.mean()), len(usable))
    return TierFit(float(1.0 / slope), float(fixed), len(usable))


def load_and_recompute(tokens: float, local: float, recompute: RecomputeFit, fixed_s: float,
                       seconds_per_token: float) -> tuple[float, float]:
    """What loading `tokens` (on top of `local` tokens already in the engine) adds to a request, and what
    recomputing them costs instead; the one definition of "a load pays" (load < recompute) that the
    break-even prefix and the connector's admission rule share.

    Both fits measure TTFT, so the tier's fixed cost includes the base cost every request pays
    (recompute.a, the cold curve's intercept): only what lies above that base is the load's.
    """
    load = fixed_s - recompute.a + tokens * seconds_per_token
    return load, recompute(local + tokens) - recompute(local)


def break_even_bandwidth(n: int, recompute: RecomputeFit, fixed_s: float, kv_bytes_per_token: int) -> float:
    """Bytes/s at which loading n cached tokens ties recomputing them (inf: a hit never pays)."""
    budget = recompute(n) - fixed_s
    return n * kv_bytes_per_token / budget if budget > 0 else math.inf


def break_even_prefix(tier: TierFit, recompute: RecomputeFit, kv_bytes_per_token: int) -> float:
    """The prefix length from which every longer hit beats recomputing it (inf: no such length).

    h(p) = t(p) - load(p) = (a - fixed) + (b - s) p + c p^2, s the transfer seconds per token: a hit pays
    where h > 0. With c > 0 that is outside the roots, so the answer is the larger root (1 when h has
    none); a hit may also pay below the smaller root, on fixed costs alone, but not from there on.
    """
    s = 0.0 if math.isinf(tier.bandwidth_bps) else kv_bytes_per_token / tier.bandwidth_bps
    # h(p) = recompute - load of load_and_recompute(p, 0, ...), expanded:
    a, b, c = recompute.a - tier.fixed_s, recompute.b - s, recompute.c
    if c > 0:
        disc = b * b - 4 * a * c
        if disc < 0:
            return 1.0
        return max(1.0, (-b + math.sqrt(disc)) / (2 * c))
    if b > 0:
        return max(1.0, -a / b) if a < 0 else 1.0
    return math.inf


def frontier(lengths: list[int], p_star: float) -> dict[int, float | None]:
    """Smallest cached fraction that pays at each length (None: not even a full hit pays)."""
    return {n: (p_star / n if p_star < n else None) for n in lengths}


def fit_tier_paired(pairs: list[tuple[int, float]], base_s: float, kv_bytes_per_token: int) -> TierFit | None:
    """pairs: (cached tokens p, tier-hit TTFT minus engine-hit TTFT of the same cell).

    An engine hit of the same cell computes the same suffix, so the difference is the tier's own cost,
    extra_fixed + p B / bw, free of the recompute fit's noise. base_s (what a hit costs with nothing to
    transfer) is added to the intercept so the fixed cost compares with t(p) like the seed's formula.
    """
    usable = [(p, d) for p, d in pairs if p > 0]
    if not usable:
        return None
    x = np.asarray([p * kv_bytes_per_token for p, _ in usable], dtype=float)
    y = np.asarray([d for _, d in usable], dtype=float)
    if len(set(x)) >= 2:
        slope, extra = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)[0]
    else:
        slope, extra = (y[0] / x[0], 0.0) if y[0] > 0 else (0.0, float(y[0]))
    fixed = base_s + max(0.0, float(extra))
    if slope <= 0:
        return TierFit(math.inf, fixed, len(usable))
    return TierFit(float(1.0 / slope), fixed, len(usable))


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
        pairs = [(round(c["sources"].get(source, 0)), c["ttft"]["p50"] - engine[(c["length"], c["fraction"])]["ttft"]["p50"])
                 for c in tier_cells if (c["length"], c["fraction"]) in engine]
        # What a hit costs beyond its suffix when nothing is transferred: the engine hits' residual.
        residual = [e["ttft"]["p50"] - (recompute(e["length"]) - recompute(round(e["sources"].get("device", 0))))
                    for e in engine.values()]
        if residual:
            entry["hit_base_s"] = max(0.0, float(np.median(residual)))
        if pairs:
            tier = fit_tier_paired(pairs, entry["hit_base_s"], kv_bytes_per_token)
            method = "paired with engine hits"
        else:
            hits = [(c["length"], round(c["sources"].get(source, 0)), c["ttft"]["p50"]) for c in tier_cells]
            tier = fit_tier(hits, recompute, kv_bytes_per_token) if hits else None
            method = "against the recompute fit"
        if tier is not None:
            p_star = break_even_prefix(tier, recompute, kv_bytes_per_token)
            entry["tier"] = {
                "source": source,
                "method": method,
                "bandwidth_gbps": None if math.isinf(tier.bandwidth_bps) else tier.bandwidth_bps / 1e9,
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

"""The emulated drive of the admission suite and the frontier cells around its break-even prefix, all derived
from this machine's measurements.

Which drive makes a wrong decision visible on both sides of the break-even prefix p*? Write a load of p
tokens as F + s p above the base cost (F its per-load latency and fixed cost, s its transfer seconds per
token) and its recompute as r(p) = b p + c p^2. At p* they are equal; let phi = F / r(p*) be the latency's
share of the load there. For a nearly linear recompute (c small beside b, as on a slow CPU):

    R(k p*) = load / recompute = phi / k + (1 - phi):   R(0.7 p*) = 1 + 0.43 phi,   R(1.4 p*) = 1 - 0.29 phi

A bandwidth-bound drive (phi near 0) costs the same share of recompute at every prefix, so no decision is
wrong by more than the noise anywhere; a latency-bound one (phi = 1) makes both directions visible and the
most: admitting at 0.7 p* costs 43% (more where the recompute curves up), declining at 1.4 p* forgoes 29%.
The drive is therefore all latency: the connector's `read_latency_ms` sized so that loading the target p*
costs what recomputing it does on the measured curve, its bandwidth the drive's own (whose transfer time at
these sizes is part of the fitted fixed cost). `frontier_drive` refuses a machine on which a wrong decision
at 0.7 p* or 1.4 p* would cost less than twice the suite's cap.

The target p* is half the session's longest length (so the frontier, up to 2 p*, fits the grid the prefill
budget chose), in whole storage units. Frontier cells are then placed around the p* the control measures
(`interpolated_break_even`, from its hit/cold ratios, not from the calibration the rule reads): a prefix of
P tokens is a prompt of P + 1 tokens, all of it shared, so the hit loads P and recomputes one token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.optimize import brentq

from pytest_kvoffload.core.costs import RecomputeFit, TierFit, break_even_prefix, load_and_recompute

# Multiples of p* the frontier cells sit at: close in on both sides, and one far on each. The judged frontier
# places its two nearest cells where the near misses part from the rule (telling_multiples) instead of 0.85 and 1.2.
FRONTIER = (0.5, 0.7, 0.85, 1.2, 1.4, 2.0)
FRONTIER_FAR = (0.5, 0.7, 1.4, 2.0)
# Where those two may sit, in multiples of p* (the verdicts issue's windows): between 0.9 and 1.1 p* a hit is
# within the cap either way, so nothing there can be judged wrong.
NEAR_WINDOWS = ((0.78, 0.9), (1.12, 1.25))
# A wrong decision at 0.7 p* or 1.4 p* must cost at least this many times the suite's cap.
VISIBLE = 2.0


class SlowDriveError(RuntimeError):
    """No emulated drive gives this machine a frontier both kinds of error show on; the message says why."""


@dataclass(frozen=True)
class SlowDrive:
    latency_s: float
    target: int  # the p* the drive was sized for
    early_cost: float  # R(0.7 p*) - 1 on the measured curve: what admitting too early costs
    late_cost: float   # 1 - R(1.4 p*): what declining too late forgoes

    def options(self) -> dict:
        """The connector options that emulate this drive."""
        return {"read_latency_ms": round(self.latency_s * 1e3, 3)}

    def describe(self) -> str:
        return (f"drive emulated with {self.latency_s * 1e3:,.1f} ms of latency a load (bandwidth the drive's own), "
                f"so that loading {self.target:,} tokens costs what recomputing them does; on the measured curve "
                f"a load at 0.7 p* costs {self.early_cost:+.0%} over recompute, at 1.4 p* {-self.late_cost:+.0%}")


def ratio(p: float, recompute: RecomputeFit, fixed_s: float, seconds_per_token: float) -> float:
    """Predicted tier hit / cold of a prompt of p + 1 tokens whose p-token prefix is loaded."""
    load, saved = load_and_recompute(p, 0, recompute, fixed_s, seconds_per_token)
    base = recompute(1)
    return (base + load) / (base + saved)


def telling_multiples(p_star: float, recompute: RecomputeFit, fixed_s: float, seconds_per_token: float,
                      margin: float, cap: float, scales) -> tuple[float, ...]:
    """Multiples of `p_star` for the frontier's cells nearest it, one per near miss in `scales` (a rule whose
    predicted load is `scale` times the right one's): where the calibrated model predicts the geometric middle
    of the hit/cold ratios at which that rule decides unlike the right one and wrongly past the cap (0.75x
    admits hits 1 + cap to (1 - margin) / 0.75 times slower; 1.3x declines loads that pay (1 - margin) / 1.3
    to 1 - margin - cap), kept in NEAR_WINDOWS. A fixed 1.2 p* put the cell at a predicted 0.76, where a rule
    wrong by 1.3x admits as the right one does (notes/2026-12-07-admission-blocks.md)."""
    out = []
    for scale in scales:
        lo, hi = NEAR_WINDOWS[scale > 1]
        ends = (1 + cap, (1 - margin) / scale) if scale < 1 else ((1 - margin) / scale, 1 - margin - cap)
        target = math.sqrt(ends[0] * ends[1])

        def off(k: float) -> float:  # falls as the prefix grows
            return ratio(k * p_star, recompute, fixed_s, seconds_per_token) - target

        out.append(lo if off(lo) <= 0 else hi if off(hi) >= 0 else float(brentq(off, lo, hi)))
    return tuple(out)


def frontier_drive(target: int, recompute: RecomputeFit, fixed_s: float, seconds_per_token: float,
                   cap: float) -> SlowDrive:
    """The latency that puts the break-even at `target` tokens; fixed_s, seconds_per_token: the unthrottled
    tier's fitted figures (base cost included in fixed_s, as the rule reads it)."""
    natural, saved = load_and_recompute(target, 0, recompute, fixed_s, seconds_per_token)
    latency = saved - natural
    if latency <= 0:
        raise SlowDriveError(f"loading {target:,} tokens already costs {natural * 1e3:.0f} ms, more than the "
                             f"{saved * 1e3:.0f} ms of recomputing them: no latency puts the break-even there; "
                             "use longer --kv-lengths")
    early = ratio(0.7 * target, recompute, fixed_s + latency, seconds_per_token) - 1
    late = 1 - ratio(1.4 * target, recompute, fixed_s + latency, seconds_per_token)
    if min(early, late) < VISIBLE * cap:
        raise SlowDriveError(f"with the break-even at {target:,} tokens a wrong decision costs {early:.0%} at 0.7 p* "
                             f"and {late:.0%} at 1.4 p*, less than {VISIBLE:g}x the {cap:.0%} cap: the recompute "
                             "curve is too flat here for the suite to tell a wrong rule; use longer --kv-lengths")
    return SlowDrive(latency, target, early, late)


def design_target(lengths, unit: int) -> int:
    """Half the longest length, in whole storage units (at least two units)."""
    return max(2 * unit, max(lengths) // 2 // unit * unit)


def frontier_prefixes(p_star: float, unit: int, multiples=FRONTIER) -> dict[int, float]:
    """Prefix tokens in whole units at each multiple of p_star, {prefix: multiple}: the unit nearest the
    multiple, unless that lands on p* or past it (then the unit on its own side), the nearest to p* first,
    pushed one unit further out where two would share a prefix; below one unit dropped. Rounding every cell
    away from p* put make test's 0.85 p* cell at 0.71 (p* of 721 tokens, 128-token units), where a rule wrong
    by 0.75x decides as the right one does."""
    out: dict[int, float] = {}
    for k in sorted((k for k in multiples if k < 1), reverse=True):
        p = math.floor(k * p_star / unit + 0.5) * unit
        p = p if p < p_star else math.floor(k * p_star / unit) * unit
        while p in out:
            p -= unit
        if p >= unit:
            out[p] = k
    for k in sorted(k for k in multiples if k >= 1):
        p = math.floor(k * p_star / unit + 0.5) * unit
        p = max(unit, p if p > p_star else math.ceil(k * p_star / unit) * unit)
        while p in out:
            p += unit
        out[p] = k
    return dict(sorted(out.items()))


def interpolated_break_even(ratios: dict[int, float]) -> float | None:
    """Where the control's median hit/cold ratio crosses 1, by linear interpolation between the two
    prefixes around the last crossing from above to below (None: no crossing measured)."""
    points = sorted(ratios.items())
    crossing = None
    for (p0, r0), (p1, r1) in zip(points, points[1:]):
        if r0 > 1 >= r1:
            crossing = p0 + (r0 - 1) / (r0 - r1) * (p1 - p0)
    return crossing


def planted_break_even(tier: TierFit, recompute: RecomputeFit, kv_bytes_per_token: int, scale: float,
                       margin: float = 0.0) -> float:
    """Where the static rule with its predicted load times `scale` starts to admit (its fixed cost above the
    base cost and its transfer time both scaled), at the given margin."""
    fixed = recompute.a + scale * (tier.fixed_s - recompute.a)
    scaled = TierFit(tier.bandwidth_bps / scale, fixed, tier.points)
    return break_even_prefix(scaled, recompute, kv_bytes_per_token, margin)


def step_tokens(lengths, block_size: int) -> int:
    """The admission servers' --max-num-batched-tokens: half the longest prompt, in whole blocks, so that the
    queue a probe waits behind (two steps) costs about one longest prefill on any CPU."""
    half = max(lengths) // 2
    return max(2 * block_size, -(-half // block_size) * block_size)


def seconds_per_token(gbps: float | None, kv_bytes_per_token: int) -> float:
    """A tier's transfer seconds per token from its fitted GB/s (0: unresolved, no measurable transfer)."""
    return kv_bytes_per_token / (gbps * 1e9) if gbps else 0.0

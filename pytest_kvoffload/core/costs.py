"""The cost model both sides share: what recomputing a prefix costs (RecomputeFit, a + b n + c n^2), what
loading it from a tier costs (TierFit: a fixed cost plus bytes over a bandwidth), whether a load pays
(load_and_recompute, the one definition), and the break-even bandwidth and prefix derived from them.

The connector's admission rule (connector/admission_rule.py) and the record layer's fits (analysis/fits.py)
both import it; it imports nothing of the package but its tolerances (core/tolerances.py).

Model (the suffix a partial hit still computes included):
    cold TTFT            t(n) = a + b n + c n^2
    tier-hit TTFT        t_fixed + p B / bw + (t(L) - t(p))      p cached tokens of an L-token prompt
A hit of p tokens pays when t_fixed + p B / bw < t(p); the break-even prefix p* is where they meet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pytest_kvoffload.core.tolerances import ADMISSION_MARGIN_CEILING, ADMISSION_MARGIN_FLOOR


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
    # The fit's 95% t interval (analysis/fits.py): the bandwidth's is (low, high), high inf when
    # the slope's interval reaches 0: the loads were too small for this noise to tell their transfer time.
    bandwidth_low_bps: float = 0.0
    bandwidth_high_bps: float = math.inf
    fixed_low_s: float = -math.inf
    fixed_high_s: float = math.inf

    @property
    def resolved(self) -> bool:
        """Whether the transfer time was told apart from the noise (the bandwidth has an upper bound)."""
        return math.isfinite(self.bandwidth_high_bps) and math.isfinite(self.bandwidth_bps)

    def load_seconds(self, tokens: float, kv_bytes_per_token: int) -> float:
        return self.fixed_s + tokens * kv_bytes_per_token / self.bandwidth_bps


def load_and_recompute(tokens: float, local: float, recompute: RecomputeFit, fixed_s: float,
                       seconds_per_token: float, prompt_tokens: float | None = None) -> tuple[float, float]:
    """What loading `tokens` (on top of `local` tokens already in the engine) adds to a request, and what
    recomputing them costs instead; the one definition of "a load pays" (load < recompute) that the
    break-even prefix and the connector's admission rule share.

    Both fits measure TTFT, so the tier's fixed cost includes the base cost every request pays
    (recompute.a, the cold curve's intercept): only what lies above that base is the load's. A load that
    covers the whole prompt (of `prompt_tokens`, where given) still leaves its last token to compute (vLLM
    computes one token to sample from), so it replaces the recompute of one token fewer than it loads.
    """
    load = fixed_s - recompute.a + tokens * seconds_per_token
    replaced = tokens if prompt_tokens is None or local + tokens < prompt_tokens else prompt_tokens - 1 - local
    return load, recompute(local + replaced) - recompute(local)


def break_even_bandwidth(n: int, recompute: RecomputeFit, fixed_s: float, kv_bytes_per_token: int) -> float:
    """Bytes/s at which loading n cached tokens ties recomputing them (inf: a hit never pays)."""
    budget = recompute(n) - fixed_s
    return n * kv_bytes_per_token / budget if budget > 0 else math.inf


def admission_margin(noise: float) -> float:
    """The share by which the connector's rule wants a load predicted to beat recompute before it takes it:
    twice the cells' median relative spread, 2% to 50% (a smaller predicted gain is within the noise)."""
    return round(min(ADMISSION_MARGIN_CEILING, max(ADMISSION_MARGIN_FLOOR, 2 * noise)), 4)


def break_even_prefix(tier: TierFit, recompute: RecomputeFit, kv_bytes_per_token: int, margin: float = 0.0) -> float:
    """The prefix length from which every longer hit beats recomputing it (inf: no such length); with a
    `margin`, beats (1 - margin) of it: the prefix from which the connector's rule admits a load.

    h(p) = (1 - m) (t(p) - a) - (load(p) - ...) = (a - fixed) + ((1 - m) b - s) p + (1 - m) c p^2, s the
    transfer seconds per token: a hit is taken where h > 0 (load_and_recompute at local 0). With c > 0 that
    is outside the roots, so the answer is the larger root (1 when h has none); a hit may also pay below the
    smaller root, on fixed costs alone, but not from there on.
    """
    s = 0.0 if math.isinf(tier.bandwidth_bps) else kv_bytes_per_token / tier.bandwidth_bps
    # h(p) = (1 - m) recompute - load of load_and_recompute(p, 0, ...), expanded:
    keep = 1.0 - margin
    a, b, c = recompute.a - tier.fixed_s, keep * recompute.b - s, keep * recompute.c
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

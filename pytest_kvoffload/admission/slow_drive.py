"""The emulated drive and step budget of the admission suite, derived from this machine's measurements.

The admission rule has something to decide only when some of the grid's loads pay and some do not, and
the suite's controls need both kinds clearly (beyond its 10% cap): a hit clearly slower than recompute
and one clearly faster. Where that happens depends on the CPU (prefill speed) and the drive, so the drive
is emulated by the connector (`read_gbps`, and `read_latency_ms` per load) with both figures solved from
measurements of this machine:

1. On the unthrottled kvoffload-disk server, measure cold, engine-hit and tier-hit cells of the grid
   (two rounds each) and fit them (analysis.analyse): the recompute curve t(n) and the tier's own fixed
   cost above a request's base cost.
2. Ask that a load of the grid's smallest loadable prefix cost SLOW times its recompute, and of the
   largest FAST times (analysis.load_and_recompute, the definition the rule uses). That is two linear
   equations in the latency and the seconds per token. A bandwidth limit alone is not enough: where
   prefill is nearly linear in length and fixed costs are small beside it (a slow CPU), a load then
   costs nearly the same share of recompute at every length, and no cell clearly pays or clearly loses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pytest_kvoffload.core.costs import RecomputeFit, TierFit, break_even_prefix, load_and_recompute
from pytest_kvoffload.measure.prompts import expected_cached, prefix_length

SLOW = 2.0  # a load of the smallest prefix costs this many times its recompute
FAST = 0.5  # and of the largest, this share


class SlowDriveError(RuntimeError):
    """No emulated drive can give this grid both kinds of cell; the message says why."""


@dataclass(frozen=True)
class SlowDrive:
    gbps: float
    latency_s: float
    prefixes: tuple[int, ...]
    break_even_prefix: float | None

    def options(self) -> dict:
        """The connector options that emulate this drive."""
        return {"read_gbps": self.gbps, "read_latency_ms": round(self.latency_s * 1e3, 3)}

    def describe(self) -> str:
        p = "-" if self.break_even_prefix is None else f"{self.break_even_prefix:,.0f}"
        return (f"drive emulated at {self.gbps * 1e3:,.1f} MB/s with {self.latency_s * 1e3:,.1f} ms of latency a load, "
                f"so that loading {self.prefixes[0]:,} tokens costs {SLOW:g}x their recompute and {self.prefixes[-1]:,} "
                f"tokens {FAST:g}x (break-even near {p} tokens)")


def loadable_prefixes(lengths, fractions, block_size: int, granularity: int) -> tuple[int, ...]:
    """The distinct numbers of tokens the grid's tier hits load (0 left out: nothing to decide)."""
    found = {expected_cached(prefix_length(n, f), n, block_size, granularity) for n in lengths for f in fractions}
    return tuple(sorted(p for p in found if p > 0))


def slow_drive(prefixes: tuple[int, ...], recompute: RecomputeFit, fixed_s: float, kv_bytes_per_token: int) -> SlowDrive:
    """The drive for which loads of prefixes[0] cost SLOW x and of prefixes[-1] FAST x their recompute.

    fixed_s: the unthrottled tier's fixed cost as fitted (base cost included, as the rule reads it).
    """
    if len(prefixes) < 2:
        raise SlowDriveError(f"the grid loads {len(prefixes)} prefix size(s) ({', '.join(map(str, prefixes)) or 'none'}); "
                             "it needs two or more: use more --kv-lengths or --kv-fractions")
    small, large = prefixes[0], prefixes[-1]
    natural_small, saved_small = load_and_recompute(small, 0, recompute, fixed_s, 0.0)
    natural_large, saved_large = load_and_recompute(large, 0, recompute, fixed_s, 0.0)
    per_token = (FAST * saved_large - SLOW * saved_small) / (large - small)
    if per_token <= 0:
        raise SlowDriveError(
            f"recomputing {large:,} tokens ({saved_large * 1e3:.0f} ms) costs less than {SLOW / FAST:g}x recomputing "
            f"{small:,} ({saved_small * 1e3:.0f} ms): the grid's prefixes span too little; use a wider --kv-lengths")
    latency = SLOW * saved_small - per_token * small - natural_small
    if latency < 0:
        # The tier's own fixed cost already makes the smallest load dear enough: no latency added, and the
        # bandwidth alone brings the largest load to FAST x its recompute.
        latency = 0.0
        per_token = (FAST * saved_large - natural_large) / large
        if per_token <= 0:
            raise SlowDriveError(
                f"a load of {large:,} tokens costs {natural_large * 1e3:.0f} ms before any transfer, more than "
                f"{FAST:g}x the {saved_large * 1e3:.0f} ms of recomputing it: no drive makes loads pay here; "
                "use longer --kv-lengths")
    bandwidth = kv_bytes_per_token / per_token
    p_star = break_even_prefix(TierFit(bandwidth, fixed_s + latency, 0), recompute, kv_bytes_per_token)
    return SlowDrive(bandwidth / 1e9, latency, prefixes, None if math.isinf(p_star) else p_star)


def step_tokens(lengths, block_size: int) -> int:
    """The admission servers' --max-num-batched-tokens: half the longest prompt, in whole blocks, so that the
    queue a probe waits behind (two steps) costs about one longest prefill on any CPU."""
    half = max(lengths) // 2
    return max(2 * block_size, -(-half // block_size) * block_size)

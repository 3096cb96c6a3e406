"""The slowed drive and step budget of the admission suite, derived from this machine's measurements.

The admission rule has something to decide only when the break-even prefix lies among the prefixes the
grid loads: some loads must pay and some must not. Where that lies depends on the CPU (prefill speed)
and the drive, so the drive is emulated (the connector's `read_gbps`) at the speed that puts it there:

1. On the unthrottled kvoffload-disk server, measure cold, engine-hit and tier-hit cells of the grid
   (two rounds each) and fit them (analysis.analyse): the recompute curve t(n) and the tier's fixed cost.
2. Take the target prefix p_t between the two middle loadable prefixes (their geometric mean), so that
   about half the grid's loads pay and half do not, and none sits at the tie.
3. Solve load(p_t) = recompute(p_t) for the bandwidth, with analysis.load_and_recompute, the same
   definition the rule uses: bw = p_t B / (t(p_t) - t(0) - (t_fixed - a)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .analysis import RecomputeFit, load_and_recompute
from .prompts import expected_cached, prefix_length


class SlowDriveError(RuntimeError):
    """No emulated drive can put the break-even prefix inside this grid; the message says why."""


@dataclass(frozen=True)
class SlowDrive:
    gbps: float
    target_prefix: float
    prefixes: tuple[int, ...]

    def describe(self) -> str:
        return (f"drive slowed to {self.gbps * 1e3:,.1f} MB/s, so that the break-even prefix falls near "
                f"{self.target_prefix:,.0f} tokens, between the grid's loadable prefixes "
                f"{', '.join(f'{p:,}' for p in self.prefixes)}")


def loadable_prefixes(lengths, fractions, block_size: int, granularity: int) -> tuple[int, ...]:
    """The distinct numbers of tokens the grid's tier hits load (0 left out: nothing to decide)."""
    found = {expected_cached(prefix_length(n, f), n, block_size, granularity) for n in lengths for f in fractions}
    return tuple(sorted(p for p in found if p > 0))


def target_prefix(prefixes: tuple[int, ...]) -> float:
    if not prefixes:
        raise SlowDriveError("the grid loads nothing (every shared prefix is shorter than one stored chunk): "
                             "use longer --kv-lengths or larger --kv-fractions")
    if len(prefixes) == 1:
        return float(prefixes[0])
    k = len(prefixes) // 2
    return math.sqrt(prefixes[k - 1] * prefixes[k])


def slow_drive(prefixes: tuple[int, ...], recompute: RecomputeFit, fixed_s: float, kv_bytes_per_token: int) -> SlowDrive:
    target = target_prefix(prefixes)
    extra, saved = load_and_recompute(target, 0, recompute, fixed_s, 0.0)
    budget = saved - extra  # seconds the transfer may take for the load to tie recompute
    if budget <= 0:
        raise SlowDriveError(
            f"a load of {target:,.0f} tokens costs {extra * 1e3:.0f} ms before any transfer, more than the "
            f"{saved * 1e3:.0f} ms of recomputing it: no drive, however fast, makes loads pay here; "
            "use longer --kv-lengths")
    return SlowDrive(target * kv_bytes_per_token / budget / 1e9, target, prefixes)


def step_tokens(lengths, block_size: int) -> int:
    """The admission servers' --max-num-batched-tokens: half the longest prompt, in whole blocks, so that the
    queue a probe waits behind (two steps) costs about one longest prefill on any CPU."""
    half = max(lengths) // 2
    return max(2 * block_size, -(-half // block_size) * block_size)

"""The admission rule: load a stored prefix only when the calibration predicts it beats recomputing it.

load cost      t_fixed + tokens x B / bw                         (the tier's calibrated figures)
recompute cost t(local + tokens) - t(local)                      (the calibrated recompute curve)
A declined prefix is recomputed: the answer is the same, only the time differs.

Beyond the static threshold, bw follows the connector's own loads once it has seen a few: an
exponentially weighted average of delivered bytes per wall second, so a drive that got slower (or a
store moved to a faster one) changes the decisions without recalibrating.
"""

from __future__ import annotations

import logging
import math

from ..analysis import RecomputeFit
from .stats import Counters

log = logging.getLogger("pytest_kvoffload.connector")


class Admission:
    def __init__(self, tier: dict, kv_bytes_per_token: int, counters: Counters) -> None:
        self.recompute = RecomputeFit(**tier["recompute"])
        gbps = tier.get("bandwidth_gbps")
        self.seconds_per_token = 0.0 if not gbps else kv_bytes_per_token / (gbps * 1e9)
        self.fixed_s = max(0.0, float(tier.get("fixed_s") or 0.0))
        self.counters = counters
        self.kv_bytes_per_token = kv_bytes_per_token
        self.online_bps: float | None = None
        self.samples = 0

    ONLINE_AFTER = 3  # loads seen before the online estimate replaces the calibrated bandwidth
    WEIGHT = 0.3

    def observe(self, nbytes: float, seconds: float) -> None:
        """One finished load's delivered bandwidth."""
        if nbytes <= 0 or seconds <= 0:
            return
        bps = nbytes / seconds
        self.online_bps = bps if self.online_bps is None else (1 - self.WEIGHT) * self.online_bps + self.WEIGHT * bps
        self.samples += 1
        self.counters.set("online_read_gbps", self.online_bps / 1e9)

    def transfer_seconds_per_token(self) -> float:
        if self.samples >= self.ONLINE_AFTER and self.online_bps:
            return self.kv_bytes_per_token / self.online_bps
        return self.seconds_per_token

    def predicted(self, load_tokens: int, local_tokens: int) -> tuple[float, float]:
        load = self.fixed_s + load_tokens * self.transfer_seconds_per_token()
        recompute = self.recompute(local_tokens + load_tokens) - self.recompute(local_tokens)
        return load, recompute

    def __call__(self, load_tokens: int, prompt_tokens: int, local_tokens: int) -> bool:
        load, recompute = self.predicted(load_tokens, local_tokens)
        admit = load < recompute or math.isclose(load, recompute)
        self.counters.add("loads_admitted" if admit else "loads_declined")
        if not admit:
            self.counters.add("tokens_declined", load_tokens)
        log.info("kvoffload admission: %s %d of %d prompt tokens (%d already local): predicted load %.1f ms "
                 "(%s bandwidth), recompute %.1f ms", "load" if admit else "decline", load_tokens, prompt_tokens,
                 local_tokens, load * 1e3, "online" if self.samples >= self.ONLINE_AFTER else "calibrated",
                 recompute * 1e3)
        return admit

"""The admission rule: load a stored prefix only when the calibration predicts it beats recomputing it.

load cost      t_fixed - a + tokens x B / bw       (the tier's calibrated figures above the base cost a)
recompute cost t(local + tokens) - t(local)         (the calibrated recompute curve t(n) = a + b n + c n^2)
Both come from analysis.load_and_recompute, the definition the calibration's break-even prefix uses.
A declined prefix is recomputed: the answer is the same, only the time differs. A load is admitted
only when predicted to beat recompute by more than the calibration's `margin` (twice the measured
relative spread of its cells), since a smaller predicted gain is within the noise of the prediction.

Modes (connector option `admission`):
- static: the break-even threshold of the cost model (core/costs.py), with the calibrated bandwidth.
- online: bw follows the connector's own loads once it has seen a few (the transfer rate fitted over
  recent loads of differing sizes, latency apart), so a drive that got slower, or a store moved to a faster
  one, changes the decisions without recalibrating.
- always / never: take every load / none (no calibration needed): the controls that show a check of
  the rule can fail, and a way to compare policies.
- planted near misses, wrong on purpose, are the test-only connector's (rigged/planted_admission.py): the
  admission suite's proof that it catches a rule that is only a little wrong.
- queue (default): online, and a load that finishes while the request would be queued anyway is free.
  In a fluid model of a FCFS engine with W seconds of prefill work ahead of the request, recompute ends
  at W + t(p) + t(s) and a load of L seconds at max(L, W) + t(s): the load pays when L - e W <= t(p),
  where e, the share of the queue a load really progresses in, is measured by the calibration sweep
  (`queue_overlap`; absent means 0, no credit). vLLM starts async loads after launching the step's
  forward pass: at once on a GPU, after the computation on the CPU build (e measured 0.66 to 0.80 there
  with the admission suite's latency-bound drive: docs/admission.md).
  W counts only the running requests' remaining prefill (their decodes and the step overhead would make
  it larger), and L counts the loads already in flight ahead of this one: both err towards recompute.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import numpy as np

from pytest_kvoffload.core.costs import RecomputeFit, load_and_recompute
from pytest_kvoffload.core.calibration import CalibrationError
from pytest_kvoffload.connector.config import admission_mode
from pytest_kvoffload.connector.counters import Counters

log = logging.getLogger("pytest_kvoffload.connector")

MODES = ("static", "online", "queue", "always", "never")
# Modes that decide without a calibration file.
FIXED_MODES = ("always", "never")


class Admission:
    ONLINE_AFTER = 3  # loads seen before the online estimate replaces the calibrated bandwidth
    WINDOW = 32       # recent loads the online estimate is fitted on

    def __init__(self, tier: dict, kv_bytes_per_token: int, counters: Counters, mode: str = "queue") -> None:
        base = admission_mode(mode)
        if base in FIXED_MODES:
            raise ValueError(f"admission mode {mode!r}: a calibrated rule is one of static, online, queue")
        self.mode = base
        self.recompute = RecomputeFit(**tier["recompute"])
        gbps = tier.get("bandwidth_gbps")
        self.seconds_per_token = 0.0 if not gbps else kv_bytes_per_token / (gbps * 1e9)
        self.fixed_s = max(0.0, float(tier.get("fixed_s") or 0.0))
        self.counters = counters
        self.kv_bytes_per_token = kv_bytes_per_token
        self.online_bps: float | None = None
        self.samples = 0
        self.window: list[tuple[float, float]] = []
        overlap = tier.get("queue_overlap") or 0.0
        if not isinstance(overlap, (int, float)):
            raise CalibrationError(f"calibration: queue_overlap {overlap!r} must be a number from 0 to 1")
        self.queue_overlap = min(1.0, max(0.0, float(overlap)))
        margin = tier.get("margin") or 0.0
        if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise CalibrationError(f"calibration: margin {margin!r} must be a number from 0 to below 1")
        self.margin = float(margin)

    def observe(self, nbytes: float, seconds: float) -> None:
        """One finished load: its bytes and wall seconds, latency included.

        The calibration's fixed cost already holds a load's latency, so the online figure must be the
        transfer rate alone: the slope of wall seconds over bytes across recent loads of differing sizes
        (seconds = latency + bytes / bw), not bytes over seconds, which would count the latency twice.
        """
        if nbytes <= 0 or seconds <= 0:
            return
        self.window.append((nbytes, seconds))
        del self.window[:-self.WINDOW]
        sizes = [b for b, _ in self.window]
        if len(self.window) < self.ONLINE_AFTER or max(sizes) < 1.5 * min(sizes):
            return  # loads of one size cannot tell latency from transfer
        slope = float(np.polyfit(sizes, [t for _, t in self.window], 1)[0])
        if slope <= 0:
            return
        self.online_bps = 1.0 / slope
        self.samples = len(self.window)
        self.counters.set("online_read_gbps", self.online_bps / 1e9)

    @property
    def online(self) -> bool:
        return self.mode != "static" and self.samples >= self.ONLINE_AFTER and bool(self.online_bps)

    def transfer_seconds_per_token(self) -> float:
        return self.kv_bytes_per_token / self.online_bps if self.online else self.seconds_per_token

    def predicted(self, load_tokens: int, local_tokens: int, prompt_tokens: int | None = None) -> tuple[float, float]:
        """(load seconds, seconds of the recompute it replaces; costs.load_and_recompute)."""
        return load_and_recompute(load_tokens, local_tokens, self.recompute, self.fixed_cost(),
                                  self.transfer_seconds_per_token(), prompt_tokens)

    def fixed_cost(self) -> float:
        """A load's fixed seconds, as calibrated."""
        return self.fixed_s

    def queue_credit(self) -> float:
        """The share of the queue's wait ahead a load is hidden behind, as calibrated (queue_overlap)."""
        return self.queue_overlap

    def queue_wait(self, ahead: Iterable[tuple[int, int]]) -> float:
        """Seconds of prefill the engine runs before this request's own: (computed, prompt) per running request."""
        return sum(max(0.0, self.recompute(total) - self.recompute(done)) for done, total in ahead if total > done)

    def __call__(self, load_tokens: int, prompt_tokens: int, local_tokens: int,
                 ahead: Iterable[tuple[int, int]] = (), loading_tokens: int = 0) -> bool:
        load, recompute = self.predicted(load_tokens, local_tokens, prompt_tokens)
        wait = 0.0
        if self.mode == "queue":
            load += loading_tokens * self.transfer_seconds_per_token()
            wait = self.queue_credit() * self.queue_wait(ahead)
        # A predicted gain inside the calibration's noise is a coin flip: recompute, which is never slower.
        threshold = recompute * (1 - self.margin)
        admit = load - wait < threshold or math.isclose(load - wait, threshold)
        self.counters.add("loads_admitted" if admit else "loads_declined")
        if not admit:
            self.counters.add("tokens_declined", load_tokens)
        elif load > threshold and not math.isclose(load, threshold):
            # Only the time it would have queued anyway makes this load pay: the static rule declines it.
            self.counters.add("loads_admitted_queued")
        log.info("kvoffload admission: %s %d of %d prompt tokens (%d already local): predicted load %.1f ms "
                 "(%s bandwidth), recompute %.1f ms, hidden by the queue %.1f ms", "load" if admit else "decline",
                 load_tokens, prompt_tokens, local_tokens, load * 1e3, "online" if self.online else "calibrated",
                 recompute * 1e3, wait * 1e3)
        return admit


class FixedAdmission:
    """`always` or `never`: every load taken, or none; counted like the calibrated rule's decisions."""

    def __init__(self, mode: str, counters: Counters) -> None:
        if mode not in FIXED_MODES:
            raise ValueError(f"admission mode {mode!r}: expected one of {', '.join(FIXED_MODES)}")
        self.mode = mode
        self.counters = counters

    def __call__(self, load_tokens: int, prompt_tokens: int, local_tokens: int,
                 ahead: Iterable[tuple[int, int]] = (), loading_tokens: int = 0) -> bool:
        admit = self.mode == "always"
        self.counters.add("loads_admitted" if admit else "loads_declined")
        if not admit:
            self.counters.add("tokens_declined", load_tokens)
        return admit

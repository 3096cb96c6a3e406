"""Replaying a trace against one server: open loop at the trace's (scaled) arrival times with bounded
concurrency, or closed loop with a fixed number of clients. Per-request TTFT and cached tokens come
from each response; per-source hit counts from the server's counters around the whole replay."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from pytest_kvoffload.serve.client import Endpoint, RequestError, stream_completion
from pytest_kvoffload.measure.paired import interval, verdict
from pytest_kvoffload.core.progress import Tracker


@dataclass
class ReplayRecord:
    line: int
    scheduled_s: float
    sent_s: float
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None  # from the moment the request was sent
    error: str | None = None

    @property
    def late_s(self) -> float:
        """How long the request waited past its scheduled arrival for a free client (open loop)."""
        return max(0.0, self.sent_s - self.scheduled_s)

    @property
    def ttft_from_arrival_s(self) -> float | None:
        """What a user waits: TTFT counted from the scheduled arrival, so waiting for a free client
        (--kv-trace-concurrency) counts too (no coordinated omission)."""
        return None if self.ttft_s is None else self.late_s + self.ttft_s


@dataclass(frozen=True)
class ReplayItem:
    line: int
    arrival_s: float
    tokens: list[int]
    max_tokens: int


def replay(endpoint: Endpoint, items: list[ReplayItem], mode: str = "open", concurrency: int = 4,
           timeout_s: float = 600.0, tracker: Tracker | None = None) -> list[ReplayRecord]:
    """Send every item; returns one record per item in trace order. Bounded in count and time; `tracker`
    steps once per answered request."""
    if mode not in ("open", "closed"):
        raise ValueError(f"replay mode {mode!r}: expected 'open' or 'closed'")
    local = threading.local()
    started = time.monotonic()
    deadline = started + timeout_s

    def client() -> Endpoint:
        if not hasattr(local, "endpoint"):
            local.endpoint = Endpoint(endpoint.url, endpoint.model_name)
        return local.endpoint

    def send(item: ReplayItem) -> ReplayRecord:
        record = send_one(item)
        if tracker is not None:
            tracker.step()
        return record

    def send_one(item: ReplayItem) -> ReplayRecord:
        if mode == "open":
            delay = started + item.arrival_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        sent = time.monotonic() - started
        if time.monotonic() > deadline:
            return ReplayRecord(item.line, item.arrival_s, sent, len(item.tokens), 0, None, "replay time limit")
        try:
            result = stream_completion(client(), item.tokens, max_tokens=item.max_tokens,
                                       timeout=max(1.0, deadline - time.monotonic()))
        except (RequestError, OSError) as exc:
            return ReplayRecord(item.line, item.arrival_s, sent, len(item.tokens), 0, None, str(exc)[:200])
        return ReplayRecord(item.line, item.arrival_s, sent, result.prompt_tokens, result.cached_tokens or 0,
                            result.client_ttft_s)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kv-replay") as pool:
        return list(pool.map(send, items))


def per_request_mean(runs: list[list[float | None]]) -> list[float | None]:
    """Each request's mean TTFT over the repeats; None for a request some repeat did not answer."""
    if not runs:
        return []
    return [None if any(run[i] is None for run in runs) else float(np.mean([run[i] for run in runs]))
            for i in range(min(len(run) for run in runs))]


def paired_verdict(base_runs: list[list[float | None]], runs: list[list[float | None]]) -> dict:
    """A backend's repeated replays against gpu-only's, request by request: each request's mean TTFT over
    the repeats divided by gpu-only's for the same request (the same prompt at the same place in the
    trace). Pairing cancels what requests differ in (length, reuse); the repeats carry the servers' noise.
    The median ratio, its two-sided 95% interval and paired.verdict ('paid', 'same' or 'slower')."""
    ratios = [b / a for a, b in zip(per_request_mean(base_runs), per_request_mean(runs))
              if a and b is not None]
    if not ratios:
        return {"pairs": 0, "median_ratio": None, "interval": [None, None], "verdict": "undecided"}
    low, high = interval(ratios)
    return {"pairs": len(ratios), "median_ratio": float(np.median(ratios)), "interval": [low, high],
            "verdict": verdict(ratios)}


def offload_verdict(base: dict, r: dict) -> str:
    """A backend's replay against gpu-only's, request by request over the repeats (paired_verdict); no
    ratio at all when its tier served nothing."""
    pv = paired_verdict(base["ttft_s_by_repeat"], r["ttft_s_by_repeat"])
    tier_share = sum(v for s, v in r["hit_ratio"].items() if s != "device")
    reads_counted = r.get("admission", "-") != "-"  # our connector counts the bytes it read; vLLM's tiers do not
    if not tier_share or (reads_counted and not r.get("bytes_loaded")):
        # Nothing came from the tier (or nothing was read): a ratio would credit the servers' difference to
        # offload, so none is printed.
        return f"offload played no part: no tier hits, {r.get('bytes_loaded', 0) / 1e6:.0f} MB loaded"
    if pv["median_ratio"] is None:
        return "undecided: no request answered by both"
    low, high = pv["interval"]
    spread = f"95% {low:.2f} to {high:.2f}" if low is not None and high is not None else "too few requests for an interval"
    text = f"median request {pv['median_ratio']:.2f}x gpu-only ({spread}, {pv['pairs']} requests)"
    return f"{text}: " + {"paid": "paid", "same": "no difference shown", "slower": "cost you"}[pv["verdict"]]

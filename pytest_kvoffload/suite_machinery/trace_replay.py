"""Replaying a trace against one server: open loop at the trace's (scaled) arrival times with bounded
concurrency, or closed loop with a fixed number of clients. Per-request TTFT and cached tokens come
from each response; per-source hit counts from the server's counters around the whole replay.

Each measured replay follows a warming pass (warm_pass): the slice once, then the engine's prefix cache
emptied and the tiers kept, as in each backend's tier-only cells. The measured pass then finds what the
slice computed in the tiers and not in the engine, as a server whose working set outgrew its engine
would: an engine of 32,768 tokens holds a whole slice, and vLLM sizes none below --max-model-len. A
request was served by the tier where its cached tokens exceed gpu-only's for the same request (which
only its engine could serve)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from tabulate import tabulate

from pytest_kvoffload.serve.backend import Backend
from pytest_kvoffload.serve.client import Endpoint, RequestError, stream_completion
from pytest_kvoffload.serve.builtin.lmcache_disk import CHUNK_TOKENS, L2_LOADED_CHUNKS
from pytest_kvoffload.serve.metrics import OFFLOAD_LOADED_BYTES
from pytest_kvoffload.analysis.paired import FLOOR, interval
from pytest_kvoffload.measure.runner import leave_in_tier_only
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.traces.selection import ReplayItem
from pytest_kvoffload.serve.builtin.gpu_only import NAME as BASELINE


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


def warm_pass(endpoint: Endpoint, backend: Backend, items: list[ReplayItem], mode: str, concurrency: int,
              tracker: Tracker | None = None) -> None:
    """The slice replayed (as often as the backend's tier must see a prefix to keep it), then the engine's
    prefix cache emptied and the tiers kept: the measured replay that follows starts where a server
    whose engine could not hold the slice would be."""
    leave_in_tier_only(endpoint, backend, lambda i: replay(endpoint, items, mode, concurrency, tracker=tracker))


def loaded_bytes(extra: dict[str, float], kv_bytes_per_token: int) -> float:
    """What a backend's tier loaded, by the counter its connector keeps: ours (kvoffload:), vLLM's
    offloading (its copies into the KV cache) or LMCache's server (whole chunks: an upper bound)."""
    return max(extra.get("kvoffload:bytes_read_total", 0.0),
               max(extra.get(name, 0.0) for name in OFFLOAD_LOADED_BYTES),
               extra.get(L2_LOADED_CHUNKS, 0.0) * CHUNK_TOKENS * kv_bytes_per_token)


# Below this share of requests served by the tier, an offload ratio says little of offload: it is printed
# with that caveat.
FEW_TIER_REQUESTS = 0.05


def tier_served(base: dict | None, r: dict) -> float | None:
    """The share of requests whose cached tokens exceed gpu-only's for the same request in the same repeat
    (the same prompt at the same place: what only the engine could serve), over the repeats; None
    without gpu-only's replay."""
    if not base or "cached_by_repeat" not in base or "cached_by_repeat" not in r:
        return None
    pairs = [(c, c0) for run, run0 in zip(r["cached_by_repeat"], base["cached_by_repeat"]) for c, c0 in zip(run, run0)]
    return float(np.mean([c > c0 for c, c0 in pairs])) if pairs else None


def per_request_mean(runs: list[list[float | None]]) -> list[float | None]:
    """Each request's mean TTFT over the repeats; None for a request some repeat did not answer."""
    if not runs:
        return []
    return [None if any(run[i] is None for run in runs) else float(np.mean([run[i] for run in runs]))
            for i in range(min(len(run) for run in runs))]


def paired_verdict(base_runs: list[list[float | None]], runs: list[list[float | None]],
                   keep: list[bool] | None = None) -> dict:
    """A backend's repeated replays against gpu-only's, request by request: each request's mean TTFT over
    the repeats divided by gpu-only's for the same request (the same prompt at the same place in the
    trace). Pairing cancels what requests differ in (length, reuse); the repeats carry the servers' noise.
    `keep`: which requests to pair (None: all). The median ratio, its two-sided 95% interval and a verdict
    from that interval alone: 'paid' below 1 - FLOOR, 'slower' above 1 + FLOOR, 'same' otherwise (no
    difference shown), 'undecided' with too few requests for an interval; 'sees' how far it reaches from 1."""
    pairs = zip(per_request_mean(base_runs), per_request_mean(runs))
    ratios = [b / a for i, (a, b) in enumerate(pairs) if a and b is not None and (keep is None or keep[i])]
    if not ratios:
        return {"pairs": 0, "median_ratio": None, "interval": [None, None], "verdict": "undecided", "sees": None}
    low, high = interval(ratios)
    decided = "undecided" if low is None or high is None else (
        "paid" if high < 1 - FLOOR else "slower" if low > 1 + FLOOR else "same")
    return {"pairs": len(ratios), "median_ratio": float(np.median(ratios)), "interval": [low, high],
            "verdict": decided, "sees": None if low is None or high is None else max(high - 1, 1 - low)}


def served_requests(base: dict | None, r: dict) -> list[bool] | None:
    """Per request in trace order: whether the tier served it in some repeat (more cached tokens than on
    gpu-only for the same request); None without both replays' cached tokens."""
    if not base or "cached_by_repeat" not in base or "cached_by_repeat" not in r:
        return None
    runs = list(zip(r["cached_by_repeat"], base["cached_by_repeat"]))
    return [any(run[i] > run0[i] for run, run0 in runs) for i in range(min(len(run) for run, _ in runs))]


def offload_verdict(base: dict, r: dict) -> str:
    """A backend's replay against gpu-only's, request by request over the repeats (paired_verdict), on the
    requests its tier served (where offload plays a part; all requests where that is not known), with the
    median over all requests beside it; no ratio at all when its tier served nothing."""
    tier_share = sum(v for s, v in r["hit_ratio"].items() if s != "device")
    # Whether the backend's connector counts the bytes it loads (lmcache-inproc-disk's does not).
    reads_counted = r.get("bytes_counted", r.get("admission", "-") != "-")
    if not tier_share or (reads_counted and not r.get("bytes_loaded")):
        # Nothing came from the tier (or nothing was read): a ratio would credit the servers' difference to
        # offload, so none is printed.
        return f"offload played no part: no tier hits, {r.get('bytes_loaded', 0) / 1e6:.0f} MB loaded"
    every = paired_verdict(base["ttft_s_by_repeat"], r["ttft_s_by_repeat"])
    mask = served_requests(base, r)
    pv = paired_verdict(base["ttft_s_by_repeat"], r["ttft_s_by_repeat"], keep=mask) if mask and any(mask) else every
    if pv["median_ratio"] is None:
        return "undecided: no request answered by both"
    low, high = pv["interval"]
    spread = f"95% {low:.2f} to {high:.2f}" if low is not None and high is not None else "too few requests for an interval"
    if pv is every:
        text = f"median request {pv['median_ratio']:.2f}x {BASELINE} ({spread}, {pv['pairs']} requests)"
    else:
        text = f"tier-served requests ({pv['pairs']} of {len(mask)}): median {pv['median_ratio']:.2f}x {BASELINE} ({spread})"
    served = tier_served(base, r)
    caveat = (f" (the tier served only {served:.0%} of requests: a figure of the engines more than of offload)"
              if served is not None and served < FEW_TIER_REQUESTS else "")
    outcome = {"paid": "paid", "same": "no difference shown", "slower": "cost you", "undecided": "undecided"}[pv["verdict"]]
    if pv["verdict"] == "same" and pv["sees"] is not None:
        outcome += f" (sees from {pv['sees']:.0%})"
    rest = f"; every request {every['median_ratio']:.2f}x" if pv is not every and every["median_ratio"] else ""
    return f"{text}: {outcome}{caveat}{rest}"


def replay_result(runs: list, p_star: float | None, shared: list[int], kv_bytes_per_token: int) -> dict:
    """A backend's replays summed up: `runs` each (records, counters moved, wall seconds); `p_star` the
    break-even prefix measured in this session, `shared` each request's reusable prefix in tokens."""
    records = [r for run, _, _ in runs for r in run]
    prompt_tokens = sum(r.prompt_tokens for r in records)
    cached: dict[str, float] = {}
    extra: dict[str, float] = {}
    for _, delta, _ in runs:
        for source, v in delta.cached_by_source.items():
            cached[source] = cached.get(source, 0.0) + v
        for key, v in delta.extra.items():
            extra[key] = extra.get(key, 0.0) + v
    ttfts = np.asarray([r.ttft_s for r in records])
    from_arrival = np.asarray([r.ttft_from_arrival_s for r in records])
    result = {
        "requests": len(runs[0][0]),
        "repeats": len(runs),
        # Over every repeat's requests.
        "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p90_s": float(np.percentile(ttfts, 90)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)), "ttft_mean_s": float(ttfts.mean()),
        "hit_ratio": {s: v / prompt_tokens for s, v in cached.items()},
        "bytes_loaded": loaded_bytes(extra, kv_bytes_per_token),
        "bytes_counted": any(k in extra for k in ("kvoffload:bytes_read_total", L2_LOADED_CHUNKS, *OFFLOAD_LOADED_BYTES)),
        "admission": (f"{extra.get('kvoffload:loads_admitted_total', 0):.0f} in, "
                      f"{extra.get('kvoffload:loads_declined_total', 0):.0f} out")
        if any(k.startswith("kvoffload:loads_") for k in extra) else "-",
        "break_even_prefix_tokens": p_star,
        # A request's reusable prefix (what an earlier request of the replay had), not its length.
        "share_above_break_even": None if p_star is None else float(np.mean([s >= p_star for s in shared])),
        "arrival_p50_s": float(np.percentile(from_arrival, 50)), "arrival_p99_s": float(np.percentile(from_arrival, 99)),
        "wall_s": float(np.mean([wall for _, _, wall in runs])),
        "late_s_max": max(r.late_s for r in records),
        # Each repeat's TTFT per request in trace order: the pairs of the verdict against gpu-only.
        "ttft_s_by_repeat": [[r.ttft_s for r in run] for run, _, _ in runs],
        # And its cached tokens: more than gpu-only's for the same request is a request the tier served.
        "cached_by_repeat": [[r.cached_tokens for r in run] for run, _, _ in runs],
        "per_request": [vars(r) for r in runs[0][0]],
    }
    return result


def offload_verdicts(results: dict) -> dict[str, str]:
    """Each backend's offload column against gpu-only (run.json keeps it for the run's verdict block)."""
    base = results.get(BASELINE)
    return {name: offload_verdict(base, r) for name, r in results.items() if base and name != BASELINE}


def replay_table(results: dict) -> str:
    """One row per backend: TTFT from the send and from arrival, hit ratios, bytes, admission, verdict."""
    rows = []
    base = results.get(BASELINE)
    for name, r in results.items():
        verdict = offload_verdict(base, r) if base and name != BASELINE else "-"
        served = tier_served(base, r) if name != BASELINE else None
        rows.append([name, r["requests"], "-" if served is None else f"{served:.0%}", f"{r['ttft_p50_s'] * 1e3:,.0f}", f"{r['ttft_p90_s'] * 1e3:,.0f}",
                     f"{r['ttft_p99_s'] * 1e3:,.0f}",
                     f"{r['arrival_p50_s'] * 1e3:,.0f} / {r['arrival_p99_s'] * 1e3:,.0f}",
                     f"{r['late_s_max'] * 1e3:,.0f}",
                     ", ".join(f"{s} {v:.0%}" for s, v in sorted(r["hit_ratio"].items()) if v) or "none",
                     f"{r['bytes_loaded'] / 1e6:,.1f}", r["admission"],
                     "-" if r["share_above_break_even"] is None else f"{r['share_above_break_even']:.0%}",
                     f"{r['wall_s']:.1f}", verdict])
    return tabulate(rows, headers=["backend", "requests", "tier-served", "p50 ms", "p90 ms", "p99 ms",
                                   "from arrival p50 / p99 ms", "latest send ms", "hit ratio by source",
                                   "MB loaded", "admission", "above break-even", "wall s (mean)", "offload"],
                    disable_numparse=True)

"""A request trace through each selected backend: same prompts, same order, caches emptied before each
replay, --kv-trace-repeats replays per backend.

Reports per backend TTFT p50/p90/p99, hit ratio by source, bytes loaded, admission decisions and the
share of requests above the break-even prefix measured in this session, and says whether offload paid
on this trace against gpu-only: each request's TTFT paired with gpu-only's for the same request, the
median ratio with its 95% interval (replay.paired_verdict). Give the trace with --kv-trace (see
docs/trace-replay.md for the scaling options).
"""

import time

import numpy as np
import pytest
from tabulate import tabulate

from pytest_kvoffload.record.analysis import analyse
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.traces.replay import offload_verdict, replay

NAME = "trace replay"

# Under pytest-xdist every backend replays in one worker, on the same GPUs, one after another: the
# comparison with gpu-only is then between servers on the same hardware.
pytestmark = [pytest.mark.xdist_group("trace-replay"), pytest.mark.kv_after_cells]


def _settled(endpoint, before, prompt_tokens, deadline_s=30.0):
    end = time.monotonic() + deadline_s
    while True:
        after = endpoint.metrics()
        if after.prompt_tokens - before.prompt_tokens >= prompt_tokens or time.monotonic() > end:
            return after.delta(before)
        time.sleep(0.2)


def _break_even_prefix(kv_session, backend):
    cells = kv_session.cells(backend.name)
    if not backend.tier or not cells:
        return None
    tier = analyse(cells, kv_session.settings.kv_bytes_per_token, {backend.name: backend.tier}) \
        .get(backend.name, {}).get("tier")
    return tier.get("break_even_prefix_tokens") if tier else None


def _table(results: dict) -> str:
    rows = []
    base = results.get("gpu-only")
    for name, r in results.items():
        verdict = offload_verdict(base, r) if base and name != "gpu-only" else "-"
        rows.append([name, r["requests"], f"{r['ttft_p50_s'] * 1e3:,.0f}", f"{r['ttft_p90_s'] * 1e3:,.0f}",
                     f"{r['ttft_p99_s'] * 1e3:,.0f}",
                     f"{r['arrival_p50_s'] * 1e3:,.0f} / {r['arrival_p99_s'] * 1e3:,.0f}",
                     f"{r['late_s_max'] * 1e3:,.0f}",
                     ", ".join(f"{s} {v:.0%}" for s, v in sorted(r["hit_ratio"].items()) if v) or "none",
                     f"{r['bytes_loaded'] / 1e6:,.1f}", r["admission"],
                     "-" if r["share_above_break_even"] is None else f"{r['share_above_break_even']:.0%}",
                     f"{r['wall_s']:.1f}", verdict])
    return tabulate(rows, headers=["backend", "requests", "p50 ms", "p90 ms", "p99 ms",
                                   "from arrival p50 / p99 ms", "latest send ms", "hit ratio by source",
                                   "MB loaded", "admission", "above break-even", "wall s (mean)", "offload"],
                    disable_numparse=True)


def _replay_once(kv_session, kv_backend, kv_server, plan, repeat: int):
    """One replay from empty caches: its records and the counters it moved."""
    # The same prompts for every backend in the same repeat; fresh ones in the next.
    items = plan.items(kv_session.settings.model.vocab_size, f"{kv_session.salt}|repeat{repeat}")
    kv_server.reset_prefix_cache(external=True)
    before = kv_server.metrics()
    started = time.monotonic()
    records = replay(kv_server, items, plan.mode, plan.concurrency,
                     tracker=Tracker(kv_session.progress, f"replay {repeat + 1}/{plan.repeats} on {kv_backend.name}",
                                     len(items), "requests"))
    wall = time.monotonic() - started
    errors = [f"line {r.line}: {r.error}" for r in records if r.error]
    assert not errors, "; ".join(errors[:5])
    return records, _settled(kv_server, before, sum(r.prompt_tokens for r in records)), wall


def test_replay_trace(kv_session, kv_backend, kv_server):
    plan = kv_session.replay_plan
    if plan is None:
        pytest.skip("no --kv-trace given")
    runs = [_replay_once(kv_session, kv_backend, kv_server, plan, repeat) for repeat in range(plan.repeats)]
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
    p_star = _break_even_prefix(kv_session, kv_backend)
    shared = plan.shared_prefixes(kv_session.settings.block_size)
    result = {
        "requests": len(runs[0][0]),
        "repeats": len(runs),
        # Over every repeat's requests.
        "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p90_s": float(np.percentile(ttfts, 90)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)), "ttft_mean_s": float(ttfts.mean()),
        "hit_ratio": {s: v / prompt_tokens for s, v in cached.items()},
        "bytes_loaded": extra.get("kvoffload:bytes_read_total", 0.0),
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
        "per_request": [vars(r) for r in runs[0][0]],
    }
    bench = kv_session.benchmark(NAME)
    bench = {"trace": plan.describe(), "backends": {**bench.get("backends", {}), kv_backend.name: result}}
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "per_request"} for k, v in bench["backends"].items()}
    described = plan.describe()
    chosen = "a slice of whole prefix trees, " if plan.slice_size else ""
    text = (f"{plan.trace.path.name}: {result['requests']} requests ({chosen}reuse share {described['reuse_share']:.0%}, "
            f"the whole trace's {described['trace_reuse_share']:.0%}), {described['scaling']}, {plan.mode} loop, "
            f"concurrency {plan.concurrency}, {plan.repeats} replays per backend from empty caches; p50-p99 over "
            f"every replay from the send, 'from arrival' from the scheduled arrival (waiting for a free client "
            f"included), 'latest send' the longest such wait; 'above break-even' compares each request's "
            f"reusable prefix; 'offload' pairs each request with gpu-only's over the replays\n" + _table(summary))
    kv_session.add_benchmark(NAME, text, {"trace": bench["trace"], "backends": bench["backends"]})

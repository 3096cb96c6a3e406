"""A request trace through each selected backend: same prompts, same order, caches emptied before each
replay, --kv-trace-repeats replays per backend, each after a warming pass that leaves the slice in the
tiers and not in the engine (suite_machinery/trace_replay.py: the tiers then serve part of the replay).

Reports per backend TTFT p50/p90/p99, hit ratio by source, bytes loaded, admission decisions and the
share of requests above the break-even prefix measured in this session, and says whether offload paid
on this trace against gpu-only: on the requests the tier served, each one's TTFT paired with gpu-only's for
the same request, the median ratio with its 95% interval (replay.paired_verdict). Give the trace with --kv-trace (see
docs/trace-replay.md for the scaling options).
"""

import time

import pytest

from pytest_kvoffload.analysis.fits import analyse
from pytest_kvoffload.core.progress import Tracker
from pytest_kvoffload.suite_machinery.trace_replay import offload_verdicts, replay, replay_result, replay_table, warm_pass

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


def _replay_once(kv_session, kv_backend, kv_server, plan, repeat: int):
    """One replay from empty caches: its records and the counters it moved."""
    # The same prompts for every backend in the same repeat; fresh ones in the next.
    items = plan.items(kv_session.settings.model.vocab_size, f"{kv_session.salt}|repeat{repeat}")
    kv_server.reset_prefix_cache(external=True)
    warm_pass(kv_server, kv_backend, items, plan.mode, plan.concurrency)
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
    result = replay_result(runs, _break_even_prefix(kv_session, kv_backend),
                           plan.shared_prefixes(kv_session.settings.block_size, after_warm=True), kv_session.settings.kv_bytes_per_token)
    bench = kv_session.benchmark(NAME)
    bench = {"trace": plan.describe(), "backends": {**bench.get("backends", {}), kv_backend.name: result}}
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "per_request"} for k, v in bench["backends"].items()}
    described = plan.describe()
    chosen = "a slice of whole prefix trees, " if plan.slice_size else ""
    text = (f"{plan.trace.path.name}: {result['requests']} requests ({chosen}reuse share {described['reuse_share']:.0%}, "
            f"the whole trace's {described['trace_reuse_share']:.0%}), {described['scaling']}, {plan.mode} loop, "
            f"concurrency {plan.concurrency}, {plan.repeats} replays per backend from empty caches, each after a warming "
            f"pass (the slice once, then the engine's prefix cache emptied, the tiers kept: the tiers serve what "
            f"the engine of a longer trace would have lost); 'tier-served' the requests that got more cached "
            f"tokens than on gpu-only; p50-p99 over "
            f"every replay from the send, 'from arrival' from the scheduled arrival (waiting for a free client "
            f"included), 'latest send' the longest such wait; 'above break-even' compares each request's "
            f"reusable prefix; 'offload' pairs each request with gpu-only's over the replays\n" + replay_table(summary))
    kv_session.add_benchmark(NAME, text, {"trace": bench["trace"], "backends": bench["backends"],
                                          "offload": offload_verdicts(summary)})

"""Trace replay against the shared gpu-only server, on a small trace made here."""

import json

import numpy as np
import pytest

from pytest_kvoffload.suite_machinery.trace_replay import replay
from pytest_kvoffload.traces.selection import ReplayPlan
from pytest_kvoffload.traces.read import Scaling, read_trace


def make_trace(tmp_path):
    lines = [{"timestamp": i * 200, "input_length": 1024, "output_length": 8, "hash_ids": ids}
             for i, ids in enumerate([[1, 2], [1, 2], [3, 4], [1, 5], [3, 4], [6, 7]])]
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return path


@pytest.mark.server
@pytest.mark.parametrize("kv_backend", ["gpu-only"], indirect=True, scope="session")
@pytest.mark.parametrize("mode", ["open", "closed"])
def test_replay_reproduces_the_trace_prefix_sharing(kv_session, kv_server, tmp_path, mode):
    plan = ReplayPlan(read_trace(make_trace(tmp_path)), Scaling(tokens_per_block=256, time_factor=0.5), mode, 2, 2)
    items = plan.items(kv_session.settings.model.vocab_size, f"{kv_session.salt}|replay-{mode}")
    assert [len(i.tokens) for i in items] == [512] * 6 and all(i.max_tokens == 2 for i in items)
    kv_server.reset_prefix_cache(external=False)
    before = kv_server.metrics()
    records = replay(kv_server, items, mode=mode, concurrency=2, timeout_s=300)
    assert [r.line for r in records] == [1, 2, 3, 4, 5, 6]
    assert not [r.error for r in records if r.error]
    assert all(r.ttft_s and r.ttft_s > 0 for r in records)
    if mode == "open":
        assert [round(r.scheduled_s, 2) for r in records] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    # Request 6 shares nothing with the others; 2 and 5 repeat earlier ids and 4 shares one 256-token
    # trace block with 1 (hits when the earlier twin finished first: closed loop sends 1 and 2 at once).
    assert records[5].cached_tokens == 0
    if mode == "open":
        assert records[0].cached_tokens == 0 and records[1].cached_tokens == 384
    cached = kv_server.metrics().delta(before).cached_by_source
    assert cached.get("device", 0) == sum(r.cached_tokens for r in records) > 0


def test_ttft_counts_from_the_scheduled_arrival_and_lateness_is_kept():
    from pytest_kvoffload.suite_machinery.trace_replay import ReplayRecord
    on_time = ReplayRecord(1, scheduled_s=2.0, sent_s=2.0, prompt_tokens=10, cached_tokens=0, ttft_s=0.1)
    waited = ReplayRecord(2, scheduled_s=2.0, sent_s=2.5, prompt_tokens=10, cached_tokens=0, ttft_s=0.1)
    assert on_time.ttft_from_arrival_s == pytest.approx(0.1) and on_time.late_s == 0.0
    assert waited.ttft_from_arrival_s == pytest.approx(0.6) and waited.late_s == pytest.approx(0.5)


def test_shared_prefix_is_what_an_earlier_request_had_in_whole_blocks(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
             {"timestamp": 1, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 9, 10]},
             {"timestamp": 2, "input_length": 4096, "output_length": 1, "hash_ids": [5, 6, 7, 8, 11, 12, 13, 14]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plan = ReplayPlan(read_trace(path), Scaling(tokens_per_block=16), "closed", 1, 1)
    # 16 tokens a trace block, 64-token prompts: two 16-token blocks shared by the second request.
    assert plan.shared_prefixes(16) == [0, 32, 0]
    assert plan.shared_prefixes(32) == [0, 32, 0]
    assert plan.shared_prefixes(64) == [0, 0, 0]  # a 64-token block is never whole before the last token


def test_paired_verdict_pairs_requests_over_the_repeats():
    from pytest_kvoffload.suite_machinery.trace_replay import paired_verdict
    rng = np.random.default_rng(0)
    sizes = rng.uniform(0.05, 2.0, 12)  # requests differ 40-fold: only pairing keeps a 15% effect visible

    def runs(factor):
        return [list(sizes * factor * rng.uniform(0.98, 1.02, sizes.size)) for _ in range(3)]

    base = runs(1.0)
    assert paired_verdict(base, runs(0.85))["verdict"] == "paid"
    assert paired_verdict(base, runs(1.15))["verdict"] == "slower"  # the planted fault: a slower backend
    same = paired_verdict(base, runs(1.0))
    assert same["verdict"] == "same" and same["pairs"] == 12
    low, high = same["interval"]
    assert low < 1.0 < high or abs(same["median_ratio"] - 1) < 0.02


def test_paired_verdict_leaves_out_unanswered_requests():
    from pytest_kvoffload.suite_machinery.trace_replay import paired_verdict
    result = paired_verdict([[1.0, None, 2.0]], [[0.5, 1.0, 1.0]])
    assert result["pairs"] == 2 and result["median_ratio"] == 0.5
    assert paired_verdict([], [[1.0]])["verdict"] == "undecided"


def test_a_replay_whose_tier_loaded_nothing_prints_no_offload_ratio():
    from pytest_kvoffload.suite_machinery.trace_replay import offload_verdict

    base = {"ttft_s_by_repeat": [[0.10, 0.20, 0.30]] * 3}
    faster = {"ttft_s_by_repeat": [[0.09, 0.18, 0.27]] * 3}
    nothing = offload_verdict(base, {**faster, "hit_ratio": {"device": 0.3}, "bytes_loaded": 0.0,
                                     "admission": "0 in, 0 out"})
    assert nothing == "offload played no part: no tier hits, 0 MB loaded" and "x gpu-only" not in nothing
    # Tokens counted from the tier, yet our connector read no byte (every load failed): still no ratio.
    counted = offload_verdict(base, {**faster, "hit_ratio": {"disk": 0.2}, "bytes_loaded": 0.0, "admission": "3 in, 0 out"})
    assert counted.startswith("offload played no part")
    loaded = offload_verdict(base, {**faster, "hit_ratio": {"disk": 0.2}, "bytes_loaded": 5e6, "admission": "3 in, 0 out"})
    assert loaded.startswith("median request 0.90x gpu-only")


def test_a_request_served_by_the_tier_got_more_cached_tokens_than_on_gpu_only():
    from pytest_kvoffload.suite_machinery.trace_replay import offload_verdict, tier_served

    base = {"ttft_s_by_repeat": [[0.10, 0.20, 0.30]] * 2, "cached_by_repeat": [[0, 896, 0]] * 2}
    tier = {"ttft_s_by_repeat": [[0.05, 0.18, 0.20]] * 2, "cached_by_repeat": [[768, 896, 640], [768, 896, 0]],
            "hit_ratio": {"disk": 0.3, "device": 0.2}, "bytes_loaded": 5e6, "admission": "-", "bytes_counted": True}
    assert tier_served(base, tier) == pytest.approx(3 / 6)
    assert tier_served({"ttft_s_by_repeat": []}, tier) is None
    assert "x gpu-only" in offload_verdict(base, tier) and "served only" not in offload_verdict(base, tier)
    # Under 5% of requests from the tier: the ratio carries the caveat.
    few = {**tier, "cached_by_repeat": [[0, 896, 0]] * 2}
    assert offload_verdict(base, few).endswith("a figure of the engines more than of offload)")
    # vLLM's tiers count their bytes too: a tier share with nothing loaded is no offload.
    assert offload_verdict(base, {**tier, "bytes_loaded": 0.0}).startswith("offload played no part")


def test_bytes_loaded_are_read_from_whichever_counter_the_connector_keeps():
    from pytest_kvoffload.serve.builtin.lmcache_disk import CHUNK_TOKENS, L2_LOADED_CHUNKS
    from pytest_kvoffload.suite_machinery.trace_replay import loaded_bytes

    assert loaded_bytes({"kvoffload:bytes_read_total": 4096.0}, 4096) == 4096.0
    assert loaded_bytes({'vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}': 8192.0,
                         'vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}': 1e9}, 4096) == 8192.0
    assert loaded_bytes({L2_LOADED_CHUNKS: 2.0}, 4096) == 2 * CHUNK_TOKENS * 4096
    assert loaded_bytes({}, 4096) == 0.0


@pytest.mark.server
@pytest.mark.parametrize("kv_backend", ["kvoffload-disk"], indirect=True, scope="session")
def test_after_a_warming_pass_the_replay_is_served_by_the_tier_not_the_engine(kv_session, kv_backend, kv_server,
                                                                              tmp_path):
    from pytest_kvoffload.suite_machinery.trace_replay import warm_pass

    plan = ReplayPlan(read_trace(make_trace(tmp_path)), Scaling(tokens_per_block=256), "closed", 1, 1)
    vocab = kv_session.settings.model.vocab_size
    warmed, control = (plan.items(vocab, f"{kv_session.salt}|warm-{name}")[:1] for name in ("pass", "control"))
    kv_server.reset_prefix_cache(external=True)
    warm_pass(kv_server, kv_backend, warmed, "closed", 1)
    served = {}
    for name, items in (("warmed", warmed), ("control", control)):
        before = kv_server.metrics()
        assert not [r.error for r in replay(kv_server, items, mode="closed", concurrency=1) if r.error]
        served[name] = {s: n for s, n in kv_server.metrics().delta(before).cached_by_source.items() if n}
    # 512 tokens: at least one whole 256-token chunk from the store, nothing from the engine; the control,
    # never warmed, nothing at all.
    assert set(served["warmed"]) == {"disk"} and served["warmed"]["disk"] >= 256 and served["control"] == {}, served


def test_the_offload_verdict_is_decided_on_the_requests_the_tier_served():
    from pytest_kvoffload.suite_machinery.trace_replay import offload_verdict

    rng = np.random.default_rng(1)
    sizes = rng.uniform(0.02, 0.3, 24)
    served = np.arange(24) % 3 == 0  # a third of the requests find their prefix only in the tier

    def replay(factor_served, cached=768):
        return {"ttft_s_by_repeat": [list(sizes * np.where(served, factor_served, 1.0) * rng.uniform(0.98, 1.02, 24))
                                     for _ in range(2)],
                "cached_by_repeat": [list(np.where(served, cached, 0)) for _ in range(2)],
                "hit_ratio": {"disk": 0.3}, "bytes_loaded": 5e6, "bytes_counted": True}

    base = {**replay(1.0, cached=0), "hit_ratio": {"device": 0.0}}
    paid = offload_verdict(base, replay(0.5))
    assert paid.startswith("tier-served requests (8 of 24): median 0.50x gpu-only") and ": paid" in paid
    # Over every request the median is one the engine serves either way: no difference there.
    assert float(paid.rsplit("every request ", 1)[1].rstrip("x")) == pytest.approx(1.0, abs=0.02)
    # The near miss: 15% slower on the requests the tier served fails; no change shows no difference.
    assert ": cost you" in offload_verdict(base, replay(1.15))
    assert "no difference shown (sees from" in offload_verdict(base, replay(1.0))

"""The planner-against-replay comparison (suite_machinery/plan_vs_replay.py) and the ordering that runs it after the cells."""

from pathlib import Path

import pytest

from pytest_kvoffload.suite_machinery import plan_vs_replay as plan_check
from pytest_kvoffload.planner.simulate import Served
from pytest_kvoffload.traces.selection import ReplayPlan
from pytest_kvoffload.traces.read import Scaling, read_trace

METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="512"} 1.0
"""


def served(engine=0, loaded=None, ttft=0.1):
    return Served(prompt=1024, engine=engine, found=dict(loaded or {}), loaded=dict(loaded or {}), ttft_s=ttft,
                  shared=engine)


def measured(line, sources, ttft=0.1):
    return plan_check.Measured(line, 1024, sources, ttft)


def test_sources_name_what_served_any_tokens():
    assert plan_check.sources({"device": 256, "disk": 0}) == "device"
    assert plan_check.sources({"disk": 512, "device": 128}) == "device+disk"
    assert plan_check.sources({}) == "none"
    assert plan_check.planned_sources(served(engine=0, loaded={"disk": 256})) == "disk"


def test_engine_capacity_from_vllms_cache_config_info():
    assert plan_check.engine_capacity_tokens(METRICS) == 512 * 128
    assert plan_check.engine_capacity_tokens("vllm:prompt_tokens_total 3.0\n") is None


def test_comparison_agrees_and_a_planted_wrong_plan_is_caught():
    real = [measured(1, {}), measured(2, {"device": 896}, 0.04), measured(3, {"disk": 512}, 0.06)]
    right = [served(), served(engine=896, ttft=0.05), served(loaded={"disk": 512}, ttft=0.06)]
    good = plan_check.compare(real, right)
    assert good.source_agreement == 1.0 and good.median_abs_ttft_error == pytest.approx(0.0)
    # The control: a plan whose engine forgets everything (as with a one-block engine) must fail the check.
    forgetful = [served(), served(), served()]
    bad = plan_check.compare(real, forgetful)
    assert bad.source_agreement < plan_check.SOURCE_AGREEMENT
    assert bad.problems()[0].startswith("line 2: measured device {'device': 896}, planned none")


FIT = {"a": 0.01, "b": 1e-4, "c": 0.0}
TIER = {"bandwidth_gbps": 1.0, "fixed_s": 0.001}


def two_requests(tmp_path: Path) -> ReplayPlan:
    """512-token trace blocks scaled to 256 tokens: 1,024 and 1,280 tokens, 7 of the first's whole 128-token
    blocks shared (vLLM never serves a prompt's last token, so its last block is not counted)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]}\n'
                     '{"timestamp": 1, "input_length": 2560, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5]}\n')
    return ReplayPlan(read_trace(trace), Scaling(tokens_per_block=256), "closed", 1, 1)


def test_the_slice_is_planned_in_the_backends_configuration(tmp_path: Path):
    plan, fit = two_requests(tmp_path), FIT
    engine_only = plan_check.profile_of_run(fit, None, None, 4096, engine_tokens=10_000, tier_capacity_bytes=0)
    planned = plan_check.plan_slice(plan, engine_only, block_size=128, admission=False)
    assert [plan_check.planned_sources(s) for s in planned] == ["none", "device"]
    # An engine of one block keeps only the first request's last block: the disk tier serves the prefix.
    with_disk = plan_check.profile_of_run(fit, TIER, "disk", 4096, engine_tokens=128, tier_capacity_bytes=1e9)
    planned = plan_check.plan_slice(plan, with_disk, block_size=128, admission=False)
    assert [plan_check.planned_sources(s) for s in planned] == ["none", "disk"]
    assert planned[1].engine == 0 and planned[1].loaded == {"disk": 7 * 128}


def test_after_a_warming_pass_the_tier_serves_what_the_engine_lost(tmp_path: Path):
    plan = two_requests(tmp_path)
    with_disk = plan_check.profile_of_run(FIT, TIER, "disk", 4096, engine_tokens=10_000, tier_capacity_bytes=1e9)
    cold = plan_check.plan_slice(plan, with_disk, block_size=128, admission=False)
    warm = plan_check.plan_slice(plan, with_disk, block_size=128, admission=False, warm=True)
    assert [plan_check.planned_sources(s) for s in cold] == ["none", "device"]
    # The first request finds its 7 whole blocks in the tier; the second its prefix in the engine again,
    # its own last whole blocks in the tier.
    assert [plan_check.planned_sources(s) for s in warm] == ["disk", "device+disk"]
    assert warm[0].loaded == {"disk": 7 * 128} and warm[1].engine == 7 * 128
    assert plan.shared_prefixes(128) == [0, 7 * 128] and plan.shared_prefixes(128, after_warm=True) == [7 * 128, 9 * 128]


def test_the_comparison_says_per_kind_of_request_how_the_plan_did():
    real = [measured(1, {}), measured(2, {"device": 896}, 0.04), measured(3, {"disk": 512}, 0.06),
            measured(4, {"device": 256, "disk": 512}, 0.05)]
    plan = [served(), served(engine=896, ttft=0.05), served(loaded={"disk": 512}, ttft=0.06), served(engine=768)]
    c = plan_check.compare(real, plan)
    assert [r["kind"] for r in c.rows] == ["miss", "engine", "tier", "tier"]
    assert c.share("tier") == 0.5 and c.agreement("tier") == 0.5 and c.agreement("miss") == 1.0
    assert c.median_error("tier") == pytest.approx(0.5) and c.to_dict()["tier_share"] == 0.5


def test_tests_that_read_cells_run_last_in_their_backends_run():
    from pytest_kvoffload.harness.plugin import after_cells_last

    class Item:
        def __init__(self, name, backend, after=False):
            self.name, self.after = name, after
            self.callspec = type("C", (), {"params": {"kv_backend": backend}})() if backend else None

        def get_closest_marker(self, name):
            return True if self.after and name == "kv_after_cells" else None

    # A test without the backend parameter (one using the default server) may sit inside a backend's run.
    items = [Item("a-replay", "a", True), Item("a-cell", "a"), Item("plain", None), Item("a-cell-2", "a"),
             Item("b-replay", "b", True), Item("b-cell", "b"), Item("c-replay", "c", True)]
    assert [i.name for i in after_cells_last(items)] == ["a-cell", "plain", "a-cell-2", "a-replay", "b-cell",
                                                        "b-replay", "c-replay"]


def test_a_test_that_kills_its_backends_server_runs_after_every_other_test_of_it():
    from pytest_kvoffload.harness.plugin import after_cells_last

    class Item:
        def __init__(self, name, backend, marker=None):
            self.name, self.marker = name, marker
            self.callspec = type("C", (), {"params": {"kv_backend": backend}})()

        def get_closest_marker(self, name):
            return True if name == self.marker else None

    items = [Item("kill", "a", "kv_kills_server"), Item("a-cell", "a"), Item("a-replay", "a", "kv_after_cells"),
             Item("b-cell", "b")]
    assert [i.name for i in after_cells_last(items)] == ["a-cell", "a-replay", "kill", "b-cell"]


def test_an_engine_hit_costs_the_measured_hit_base_not_the_cold_intercept():
    fit = {"a": -0.005, "b": 1e-4, "c": 0.0}  # a cold fit's intercept can be negative; a hit never is free
    plain = plan_check.profile_of_run(fit, None, None, 4096, engine_tokens=10_000, tier_capacity_bytes=0)
    based = plan_check.profile_of_run(fit, None, None, 4096, engine_tokens=10_000, tier_capacity_bytes=0,
                                      hit_base_s=0.02)
    assert plain.ttft(1024, 896, {}) == pytest.approx(128 * 1e-4 - 0.005)
    assert based.ttft(1024, 896, {}) == pytest.approx(128 * 1e-4 + 0.02)
    assert based.ttft(1024, 0, {}) == plain.ttft(1024, 0, {})  # a cold prompt is the fit's

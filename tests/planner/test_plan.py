"""kvoffload plan: the cache model on traces whose answer is known, its admission, slices, and bad input."""

import json
import math
from pathlib import Path

import pytest

from pytest_kvoffload import cli
from pytest_kvoffload.core.costs import RecomputeFit
from pytest_kvoffload.planner.simulate import LRU, PlanError, Profile, Tier, parse_engine, parse_tier, simulate, summarize
from pytest_kvoffload.traces.prefix_trees import reuse_share, slice_by_tree
from pytest_kvoffload.traces.read import Scaling, TraceRequest

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"
BLOCK = 512


def request(line, hash_ids, blocks=None):
    length = (blocks if blocks is not None else len(hash_ids)) * BLOCK + 1  # whole blocks plus one token
    return TraceRequest(line, float(line), length, 1, tuple(hash_ids))


def profile(tiers=(), engine_blocks=100, kv=1000):
    # Recompute 1 ms a token, no base: numbers easy to check by hand.
    return Profile(RecomputeFit(0.0, 1e-3, 0.0), kv, engine_blocks * BLOCK * kv, {t.name: t for t in tiers}, "test")


def tier(name, gbps, blocks, fixed_s=0.0, kv=1000):
    return Tier(name, gbps * 1e9, blocks * BLOCK * kv, fixed_s)


def run(requests, prof, **kw):
    return simulate(requests, "mooncake", Scaling(), prof, BLOCK, **kw)


def test_a_repeated_prompt_hits_the_engine_and_a_tier_serves_what_the_engine_lost():
    first, again, other = request(1, [1, 2, 3]), request(2, [1, 2, 3]), request(3, [7, 8])
    # The engine holds 3 blocks: `other` pushes out the prompt's first block, and a prefix hit needs it.
    result = run([first, again, other, request(4, [1, 2, 3])], profile([tier("disk", 1.0, 100)], engine_blocks=3))
    gpu, disk = result["configs"]["gpu-only"], result["configs"]["+disk"]
    assert [s.engine for s in gpu] == [0, 3 * BLOCK, 0, 0]
    assert disk[3].loaded == {"disk": 3 * BLOCK} and disk[3].found == {"disk": 3 * BLOCK}
    # 1,537 tokens: gpu-only recomputes them all (1.537 s); the disk hit loads 1,536 x 1,000 bytes at 1 GB/s.
    assert gpu[3].ttft_s == pytest.approx(1.537)
    assert disk[3].ttft_s == pytest.approx(0.001 + 1536 * 1000 / 1e9)
    assert [s.shared for s in gpu] == [0, 3 * BLOCK, 0, 3 * BLOCK]


def test_admission_declines_a_load_slower_than_recompute_and_without_it_the_load_costs_time():
    requests = [request(1, [1, 2]), request(2, [9]), request(3, [1, 2])]
    slow = profile([tier("disk", 0.0005, 100)], engine_blocks=1)  # 2 us a byte: 2 ms a token, recompute 1 ms
    guarded = run(requests, slow)["configs"]
    assert guarded["+disk"][2].found == {"disk": 2 * BLOCK} and guarded["+disk"][2].loaded == {}
    assert guarded["+disk"][2].ttft_s == pytest.approx(guarded["gpu-only"][2].ttft_s)
    forced = run(requests, slow, admission=False)["configs"]
    assert forced["+disk"][2].loaded == {"disk": 2 * BLOCK}
    assert forced["+disk"][2].ttft_s > forced["gpu-only"][2].ttft_s
    assert summarize(guarded["+disk"], guarded["gpu-only"])["paying_share"] == 0.0


def test_a_tier_smaller_than_the_engine_serves_nothing_and_bigger_never_serves_less():
    requests = [request(i, [i % 7, 100 + i % 7, 200 + i % 7]) for i in range(60)]
    small = run(requests, profile([tier("host", 10.0, 3)], engine_blocks=6))
    assert all(not s.loaded for s in small["configs"]["+host"])
    result = run(requests, profile([tier("disk", 10.0, 12)], engine_blocks=6), curve_points=4)
    served = [sum(s.loaded.get("disk", 0) for s in runs) for runs in result["curve"]["disk"]]
    assert served == sorted(served) and served[-1] > 0


def test_host_is_looked_up_before_disk_and_both_count_by_source():
    requests = [request(1, [1, 2, 3, 4]), request(2, [5, 6, 7, 8]), request(3, [1, 2, 3, 4])]
    prof = profile([tier("host", 50.0, 6), tier("disk", 5.0, 100)], engine_blocks=1)
    configs = run(requests, prof)["configs"]
    # Host holds the last 6 blocks written (3 and 4 of the first request, all of the second): the third
    # request's blocks 1 and 2 come from disk, 3 and 4 from host.
    assert configs["+host+disk"][2].loaded == {"disk": 2 * BLOCK, "host": 2 * BLOCK}
    # Host alone: the run stops at the first block it lacks, though it holds blocks 3 and 4.
    assert configs["+host"][2].found == {} and configs["+host"][2].loaded == {}


def test_lru_evicts_the_least_recently_used():
    lru = LRU(2)
    lru.touch([1, 2])
    lru.touch([1])
    lru.touch([3])
    assert 1 in lru and 3 in lru and 2 not in lru


def test_a_slice_of_whole_prefix_trees_keeps_the_traces_reuse():
    if not MOONCAKE.is_file():
        pytest.skip("the shared Mooncake trace is not here")
    from pytest_kvoffload.traces.read import read_trace, select
    requests = select(read_trace(MOONCAKE), Scaling())
    window = requests[:120]
    trees = slice_by_tree(requests, 120)
    whole = reuse_share(requests)
    assert reuse_share(window) < 0.1 < whole
    assert abs(reuse_share(trees) - whole) < abs(reuse_share(window) - whole)
    assert [r.line for r in trees] == sorted(r.line for r in trees)


@pytest.mark.parametrize("text, message", [
    ("ssd=6GB/s:1TB", "--tier 'ssd=6GB/s:1TB': expected NAME=BANDWIDTH:CAPACITY[:LATENCY] with NAME host or disk"),
    ("disk=6GB:1TB", "--tier disk '6GB': expected a bandwidth such as 6GB/s or 500MB/s"),
    ("disk=6GB/s:0TB", "--tier disk capacity '0TB': a capacity must be above zero"),
    ("disk=6GB/s:lots", "--tier disk capacity 'lots': expected a size such as 256GiB, 1TB or 64GB"),
    ("disk=6GB/s:1TB:soon", "--tier disk latency 'soon': expected a latency such as 0.2ms"),
])
def test_bad_tiers_name_the_argument(text, message):
    with pytest.raises(PlanError) as info:
        parse_tier(text)
    assert str(info.value).startswith(message)


def test_engine_capacity_in_tokens_or_bytes():
    assert parse_engine("1000", 4096) == 4096000 and parse_engine("1000tok", 4096) == 4096000
    assert parse_engine("2GiB", 4096) == 2 * 2**30
    with pytest.raises(PlanError, match="--engine-kv '0': a capacity must be above zero"):
        parse_engine("0", 4096)


def write_trace(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("args, message", [
    (["--tier", "disk=6GB/s:0GB"], "--tier disk capacity '0GB': a capacity must be above zero"),
    (["--tier", "disk=cal:1TB"], "--tier ...=cal: a calibrated bandwidth needs --calibration"),
    (["--calibration", "missing.json"], "calibration missing.json: no such file"),
    (["--mfu", "2"], "--peak-tflops 989 / --mfu 2: expected a peak above 0 and an MFU in (0, 1]"),
    (["--engine-kv", "0"], "--engine-kv '0': a capacity must be above zero"),
    (["--gpu-memory-gib", "1"], "--gpu-memory-gib 1: the weights"),
])
def test_bad_plan_arguments_are_one_line_and_write_nothing(tmp_path, capsys, args, message):
    trace = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 1024, "output_length": 1,
                                                "hash_ids": [1, 2]}])
    out = tmp_path / "out"
    code = cli.main(["plan", str(trace), "--model", "qwen3-4b", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"kvoffload plan: {message}") and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("lines, message", [
    (["not json"], "not JSON"),
    ([json.dumps({"timestamp": 0, "input_length": 5})], "missing output_length, hash_ids"),
])
def test_a_trace_in_neither_format_is_one_line(tmp_path, capsys, lines, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert cli.main(["plan", str(trace), "--model", "qwen3-4b", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_plan_prints_tables_and_writes_json_and_png(tmp_path, capsys):
    lines = [{"timestamp": i * 100, "input_length": 512 * 40 + 7, "output_length": 1,
              "hash_ids": [i % 5] + [1000 * (i % 5) + k for k in range(39)]} for i in range(200)]
    trace = write_trace(tmp_path / "t.jsonl", lines)
    out = tmp_path / "out"
    assert cli.main(["plan", str(trace), "--model", "qwen3-4b", "--engine-kv", "40000", "--tier",
                     "disk=6GB/s:1TB", "--tier", "host=55GB/s:256GiB", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for expected in ("gpu-only", "+host+disk", "break-even prefix", "mean TTFT gain vs gpu-only"):
        assert expected in text
    record = json.loads((out / "plan.json").read_text())
    assert set(record["configurations"]) == {"gpu-only", "+host", "+disk", "+host+disk"}
    assert record["configurations"]["+host+disk"]["vs_gpu_only"] < 1.0
    pytest.importorskip("matplotlib")
    assert (out / "capacity.png").stat().st_size > 1000


def test_a_calibration_profile_takes_measured_figures(tmp_path, capsys):
    calibration = {"schema": "pytest-kvoffload/calibration", "schema_version": 1,
                   "fingerprint": {"model": "tiny-llama", "kv_bytes_per_token": 4096, "device": "cpu"},
                   "tiers": {"kvoffload-disk": {"source": "disk", "bandwidth_gbps": 0.8, "fixed_s": 0.012,
                                                "recompute": {"a": 0.01, "b": 1.7e-4, "c": 0.0}}}}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration))
    trace = write_trace(tmp_path / "t.jsonl", [{"timestamp": i, "input_length": 4096, "output_length": 1,
                                                "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8]} for i in range(3)])
    args = ["plan", str(trace), "--model", "tiny-llama", "--calibration", str(path), "--tier", "disk=cal:1GB",
            "--out", str(tmp_path / "out"), "--block-size", "128", "--tokens-per-block", "128"]
    assert cli.main(args) == 2
    assert "--engine-kv: required with --calibration" in capsys.readouterr().err
    assert cli.main(args + ["--engine-kv", "256"]) == 0
    record = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert record["tiers"]["disk"]["bandwidth_bps"] == 0.8e9 and record["tiers"]["disk"]["fixed_s"] == 0.012
    assert not math.isnan(record["configurations"]["+disk"]["mean_ttft"])


def calibration_with_base(base_s: float) -> dict:
    return {"fingerprint": {"model": "tiny-llama", "kv_bytes_per_token": 4096, "device": "cpu"},
            "tiers": {"kvoffload-disk": {"source": "disk", "bandwidth_gbps": 0.8, "fixed_s": base_s + 0.012,
                                         "recompute": {"a": base_s, "b": 1.7e-4, "c": 1e-9}}}}


def test_no_load_costs_less_than_its_transfer_over_random_calibrations_and_tiers():
    """A hand-given tier beside a calibration with a non-zero base once cost -30 ms for 16 tokens."""
    import random

    from pytest_kvoffload.planner.simulate import calibration_profile

    rng = random.Random(7)
    for _ in range(300):
        base = rng.choice([0.0, rng.uniform(0, 3.0)])
        calibration = calibration_with_base(base)
        calibration["tiers"]["kvoffload-disk"]["fixed_s"] = rng.uniform(0, 2 * base + 0.05)  # noise: below the base too
        hand = Tier("host", rng.uniform(1e6, 60e9), 1e12, rng.uniform(0, 1e-3))
        measured = Tier("disk", math.nan, 1e12)
        profile = calibration_profile(calibration, [hand, measured], 1e9)
        for name in ("host", "disk"):
            tokens = rng.randint(1, 100_000)
            t = profile.tiers[name]
            transfer = tokens * profile.kv_bytes_per_token / t.bandwidth_bps
            assert profile.load_seconds({name: tokens}) >= transfer - 1e-12, (name, base, t)


def test_a_hand_given_tier_pays_its_latency_on_top_of_the_calibrated_base():
    from pytest_kvoffload.planner.simulate import break_even_prefix_tokens, calibration_profile

    profile = calibration_profile(calibration_with_base(3.0), [parse_tier("disk=0.001GB/s:1TB:0ms")], 1e9)
    # 1 MB/s: 512 tokens (2 MB) take 2 s to load; the base is paid either way, so the load costs 2 s.
    assert profile.load_seconds({"disk": 512}) == pytest.approx(512 * 4096 / 1e6)
    # ...and never pays against recomputing 512 tokens (about 0.09 s): no break-even within reach.
    assert profile.ttft(1024, 512, {"disk": 512}) > profile.ttft(1024, 0, {})
    assert break_even_prefix_tokens(profile, "disk") > 10_000 or math.isinf(break_even_prefix_tokens(profile, "disk"))


def one_large_tree(n_sub=30, per_sub=8, seed=3):
    """Every request shares its first block (one prefix tree, a system prompt); under it, sub-trees of
    requests sharing a document, each request with its own question at the end."""
    import random

    rng = random.Random(seed)
    requests, line = [], 0
    order = [(s, q) for s in range(n_sub) for q in range(per_sub)]
    rng.shuffle(order)
    for s, q in order:
        doc = [1000 + s * 10 + k for k in range(4)]
        requests.append(TraceRequest(line, float(line), 7 * BLOCK + 1, 1, tuple([0, *doc, 100_000 + line, 200_000 + line])))
        line += 1
    return requests


@pytest.mark.parametrize("size", [12, 24])
def test_a_slice_of_one_large_tree_keeps_the_traces_reuse_within_10_points(size):
    requests = one_large_tree()
    whole = reuse_share(requests)
    window = requests[:size]
    sliced = slice_by_tree(requests, size)
    assert size <= len(sliced) < size + 8  # whole sub-trees: "about" size
    for chosen in (sliced, sliced[:size]):  # the replay keeps the first `size` (traces/selection.py)
        assert abs(reuse_share(chosen) - whole) <= 0.10, (reuse_share(chosen), whole, reuse_share(window))
    assert abs(reuse_share(window) - whole) > 0.10  # the window the old slice fell back to loses it


@pytest.mark.parametrize("size", [12, 24])
def test_a_slice_of_the_shared_trace_keeps_its_reuse_within_10_points(size):
    if not MOONCAKE.is_file():
        pytest.skip("the shared Mooncake trace is not here")
    from pytest_kvoffload.traces.read import read_trace, select
    requests = select(read_trace(MOONCAKE), Scaling())
    assert abs(reuse_share(slice_by_tree(requests, size)[:size]) - reuse_share(requests)) <= 0.10


def test_the_planner_prints_and_applies_the_break_even_the_connector_enforces():
    from pytest_kvoffload.core.costs import RecomputeFit as Fit
    from pytest_kvoffload.core.costs import TierFit, break_even_prefix
    from pytest_kvoffload.planner.simulate import break_even_prefix_tokens, calibration_profile

    recompute = {"a": 0.01, "b": 1.7e-4, "c": 1e-8}
    cal = {"fingerprint": {"kv_bytes_per_token": 4096, "model": "m", "device": "cpu"},
           "tiers": {"kvoffload-disk": {"source": "disk", "bandwidth_gbps": 0.05, "fixed_s": 0.03, "margin": 0.2,
                                        "recompute": recompute}}}
    profile = calibration_profile(cal, [Tier("disk", math.nan, 1e12)], 1e9)
    enforced = break_even_prefix(TierFit(0.05e9, 0.03, 0), Fit(**recompute), 4096, 0.2)
    assert break_even_prefix_tokens(profile, "disk") == pytest.approx(enforced)
    assert enforced > break_even_prefix(TierFit(0.05e9, 0.03, 0), Fit(**recompute), 4096)

import json
from pathlib import Path

import pytest

from pytest_kvoffload.core.calibration import (CalibrationError, build_calibration, check_fingerprint, read_calibration,
                                          tier_entry, write_calibration)
from pytest_kvoffload.connector.admission_rule import Admission
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.core.settings import Settings

B_KV = 4096
TIER = {"source": "disk", "bandwidth_gbps": 0.025, "fixed_s": 0.03, "break_even_prefix_tokens": 1500.0,
        "recompute": {"a": 0.01, "b": 1e-4, "c": 2e-8}}


def settings():
    return Settings(backends=("kvoffload-disk",), model=load_model("tiny-llama"), lengths=(512,), fractions=(1.0,),
                    rounds=1, results_dir=Path("/tmp"), block_size=128)


def calibration():
    analysis = {"kvoffload-disk": {"recompute": TIER["recompute"], "tier": {**TIER, "points": 4}},
                "gpu-only": {"recompute": TIER["recompute"], "tier": None}}
    return build_calibration(analysis, settings(), {"device": "cpu", "vllm": "0.32.0"}, connector_tier="kvoffload-disk")


def test_round_trip(tmp_path):
    write_calibration(tmp_path / "c.json", calibration())
    data = read_calibration(tmp_path / "c.json")
    assert data["fingerprint"]["kv_bytes_per_token"] == 4096
    assert list(data["tiers"]) == ["kvoffload-disk"]
    assert tier_entry(data)["bandwidth_gbps"] == 0.025
    # A file that names no connector tier is a one-line error listing its tiers, not a guess.
    del data["connector_tier"]
    with pytest.raises(CalibrationError, match="names no connector_tier .*one of kvoffload-disk"):
        tier_entry(data)


@pytest.mark.parametrize("content,match", [
    (None, "no such file; run the sweep"),
    ("{", "not readable JSON"),
    (json.dumps({"schema": "x"}), "not a pytest-kvoffload calibration file"),
])
def test_bad_files_get_one_line_errors(tmp_path, content, match):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CalibrationError, match=match):
        read_calibration(path)


def test_fingerprint_mismatch_says_what_differs_and_how_to_recalibrate():
    actual = {"model": "llama-3.2-3b", "kv_bytes_per_token": 114688, "block_size": 128, "device": "cpu"}
    with pytest.raises(CalibrationError, match=r"model: file 'tiny-llama', server 'llama-3.2-3b'.*"
                                               r"kv_bytes_per_token.*recalibrate with pytest suites/"):
        check_fingerprint(calibration(), actual)
    check_fingerprint(calibration(), {"model": "tiny-llama", "kv_bytes_per_token": 4096, "block_size": 128,
                                      "device": "cpu"})


def test_admission_declines_what_costs_more_than_recompute():
    counters = Counters()
    admit = Admission(TIER, 4096, counters)
    # 256 tokens: load 30 ms + 42 ms vs recompute ~27 ms -> decline. 4,000 tokens: 686 ms vs 730 ms -> load.
    assert not admit(256, 300, 0)
    assert admit(4000, 4100, 0)
    c = counters.drain()
    assert c["loads_declined"] == 1 and c["tokens_declined"] == 256 and c["loads_admitted"] == 1


def test_admission_counts_only_the_tokens_beyond_the_local_cache():
    admit = Admission(TIER, 4096, Counters())
    load, recompute = admit.predicted(1000, 3000)
    assert recompute == pytest.approx(admit.recompute(4000) - admit.recompute(3000))


def test_online_bandwidth_replaces_the_calibrated_one_after_a_few_loads():
    counters = Counters()
    admit = Admission(TIER, 4096, counters)
    assert not admit(1024, 1100, 0)  # 30 ms + 168 ms at 25 MB/s against 123 ms of recompute
    calibrated = admit.predicted(4000, 0)[0]
    # A drive at 1 GB/s (40x the calibrated 25 MB/s) with 5 ms of latency a load.
    for nbytes in (4e6, 16e6):
        admit.observe(nbytes, 0.005 + nbytes / 1e9)
    assert admit.predicted(4000, 0)[0] == calibrated
    admit.observe(8e6, 0.005 + 8e6 / 1e9)
    # The transfer rate alone: the latency is already in the calibrated fixed cost (30 ms, 10 ms of it the
    # base every request pays), so it must not be counted again.
    assert admit.predicted(4000, 0)[0] == pytest.approx(0.02 + 4000 * 4096 / 1e9)
    assert admit(1024, 1100, 0)  # at the drive's real speed the same prefix pays
    assert counters.drain()["online_read_gbps"] == pytest.approx(1.0)


def test_online_bandwidth_needs_loads_of_differing_sizes():
    admit = Admission(TIER, 4096, Counters())
    calibrated = admit.predicted(4000, 0)[0]
    for _ in range(5):
        admit.observe(16e6, 0.021)
    assert admit.predicted(4000, 0)[0] == calibrated


def test_static_mode_ignores_the_online_estimate():
    admit = Admission(TIER, 4096, Counters(), mode="static")
    calibrated = admit.predicted(4000, 0)[0]
    for nbytes in (4e6, 8e6, 16e6, 32e6):
        admit.observe(nbytes, nbytes / 1e9)
    assert admit.predicted(4000, 0)[0] == calibrated


def test_queue_mode_counts_a_load_hidden_behind_queued_prefill_as_free():
    counters = Counters()
    admit = Admission({**TIER, "queue_overlap": 1.0}, 4096, counters, mode="queue")
    # 1,024 tokens: 30 + 168 ms of load against 123 ms of recompute: declined when nothing is ahead ...
    assert not admit(1024, 1100, 0)
    assert not admit(1024, 1100, 0, ahead=[(2048, 2048)])  # finished prefills are no queue
    # ... admitted when 2,000 tokens of another request's prefill run first (about 120 ms of queue).
    ahead = [(2048, 4048)]
    wait = admit.queue_wait(ahead)
    assert wait == pytest.approx(admit.recompute(4048) - admit.recompute(2048))
    assert admit(1024, 1100, 0, ahead=ahead)
    c = counters.drain()
    assert c["loads_admitted_queued"] == 1 and c["loads_declined"] == 2
    # Loads already in flight go first on the drive: the same queue no longer hides this one.
    assert not admit(1024, 1100, 0, ahead=ahead, loading_tokens=4000)


def test_static_mode_gives_no_credit_for_queueing():
    admit = Admission(TIER, 4096, Counters(), mode="static")
    assert not admit(1024, 1100, 0, ahead=[(2048, 4048)])


def test_unknown_admission_mode_is_refused():
    with pytest.raises(ValueError, match="admission 'fast' must be one of queue, static, online"):
        Admission(TIER, 4096, Counters(), mode="fast")
    with pytest.raises(ValueError, match="admission mode 'always': a calibrated rule is one of static, online, queue"):
        Admission(TIER, 4096, Counters(), mode="always")


def test_queue_credit_is_the_measured_share_of_the_queue():
    ahead = [(2048, 4048)]
    # Without a measured overlap the queue hides nothing: the same decision as online.
    assert not Admission(TIER, 4096, Counters(), mode="queue")(1024, 1100, 0, ahead=ahead)
    assert not Admission({**TIER, "queue_overlap": 0.1}, 4096, Counters(), mode="queue")(1024, 1100, 0, ahead=ahead)
    assert Admission({**TIER, "queue_overlap": 0.9}, 4096, Counters(), mode="queue")(1024, 1100, 0, ahead=ahead)
    assert Admission({**TIER, "queue_overlap": 7}, 4096, Counters()).queue_overlap == 1.0


def test_a_bad_queue_overlap_is_named():
    from pytest_kvoffload.core.calibration import CalibrationError
    with pytest.raises(CalibrationError, match="queue_overlap 'lots' must be a number from 0 to 1"):
        Admission({**TIER, "queue_overlap": "lots"}, 4096, Counters())


def test_a_predicted_gain_inside_the_margin_is_declined():
    load, recompute = Admission(TIER, 4096, Counters()).predicted(4000, 0)
    assert load < recompute  # about 6% cheaper than recomputing ...
    assert Admission({**TIER, "margin": 0.02}, 4096, Counters())(4000, 4100, 0)
    assert not Admission({**TIER, "margin": 0.1}, 4096, Counters())(4000, 4100, 0)  # ... but inside 10% of noise


def test_calibration_margin_is_twice_the_noise_within_bounds():
    from pytest_kvoffload.core.calibration import build_calibration

    def margin(noise):
        analysis = {"kvoffload-disk": {"recompute": TIER["recompute"], "tier": {**TIER, "points": 4}, "noise": noise}}
        return build_calibration(analysis, settings(), {"device": "cpu"})["tiers"]["kvoffload-disk"]["margin"]

    assert margin(0.04) == 0.08 and margin(0.0) == 0.02 and margin(0.9) == 0.5


# ---- calibrations that know their machine ----

from pytest_kvoffload.core import machine  # noqa: E402
from pytest_kvoffload.core.calibration import filesystem_of, machine_fingerprint  # noqa: E402
from pytest_kvoffload.harness.options import OptionError, OptionValues, build_settings  # noqa: E402


def here(tmp_path) -> dict:
    return {"model": "tiny-llama", "kv_bytes_per_token": 4096, "block_size": 128, "device": "cpu",
            "dtype": "bfloat16", **machine_fingerprint(tmp_path, 1)}


def test_the_fingerprint_names_the_machine_and_the_store_filesystem(tmp_path):
    fp = build_calibration({}, settings(), {"device": "cpu"}, store_dir=tmp_path)["fingerprint"]
    assert fp["cpu"] == machine.cpu_model() and fp["tensor_parallel"] == 1
    assert fp["cpu_flags"] == " ".join(f for f in machine.RECORDED_FLAGS if f in machine.cpu_flags())
    assert fp["store_fs"] == filesystem_of(tmp_path) and " on /" in fp["store_fs"]
    assert "vllm" in fp and "gpu" in fp


@pytest.mark.parametrize("field,foreign", [("cpu", "Intel Xeon Platinum 8480+"), ("cpu_flags", "avx2"),
                                           ("gpu", "NVIDIA H100 80GB HBM3"), ("tensor_parallel", 2),
                                           ("vllm", "0.1.0"), ("store_fs", "/dev/nvme0n1 on /nvme (xfs)")])
def test_a_calibration_from_another_machine_is_refused_naming_the_field(tmp_path, field, foreign):
    cal = calibration()
    cal["fingerprint"].update(machine_fingerprint(tmp_path, 1), dtype="bfloat16")
    check_fingerprint(cal, here(tmp_path))  # its own machine: accepted
    if foreign == here(tmp_path)[field]:  # a machine whose own flags are avx2 alone: another machine's differ
        foreign = f"{foreign} avx512f"
    cal["fingerprint"][field] = foreign
    with pytest.raises(CalibrationError) as exc:
        check_fingerprint(cal, here(tmp_path), "c.json")
    message = str(exc.value)
    assert "\n" not in message and f"{field}: file {foreign!r}, server " in message
    assert "calibration_mismatch=accept" in message
    assert check_fingerprint(cal, here(tmp_path), "c.json", mismatch="accept") == [
        f"{field}: file {foreign!r}, server {here(tmp_path)[field]!r}"]


def test_a_foreign_calibration_stops_the_run_before_any_server_and_can_be_accepted(tmp_path):
    from pytest_kvoffload.serve.builtin import default_registry
    settings_now = build_settings(OptionValues.from_mapping({"kv_results_dir": str(tmp_path)}), default_registry())
    cal = build_calibration({"kvoffload-disk": {"recompute": TIER["recompute"], "tier": {**TIER, "points": 4}}},
                            settings_now, {"device": machine.device_kind()})
    path = tmp_path / "cal.json"
    write_calibration(path, cal)
    opts = {"kv_results_dir": str(tmp_path), "kv_disk_opts": [f"calibration={path}"]}
    build_settings(OptionValues.from_mapping(opts), default_registry())  # measured here: taken
    cal["fingerprint"]["cpu"] = "Another CPU"
    write_calibration(path, cal)
    with pytest.raises(OptionError, match=r"^--kv-disk-opt: calibration .*cpu: file 'Another CPU', server "):
        build_settings(OptionValues.from_mapping(opts), default_registry())
    accepted = {**opts, "kv_disk_opts": [f"calibration={path}", "calibration_mismatch=accept"]}
    assert build_settings(OptionValues.from_mapping(accepted), default_registry()).disk_opts["calibration_mismatch"] == "accept"


def test_a_version_1_file_is_refused_by_the_connector_check_and_read_by_the_planner(tmp_path):
    old = calibration()
    old["schema_version"] = 1
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    data = read_calibration(path)  # the planner reads it: it checks no machine
    with pytest.raises(CalibrationError, match="version 1, whose fingerprint does not name the machine"):
        check_fingerprint(data, here(tmp_path), path)


def test_the_enforced_break_even_is_where_the_static_rule_starts_to_admit_at_any_margin():
    """calibration.json's enforced prefix agrees with the connector's decisions, margin included (random
    calibrations and margins; at margin 0 it is the prefix from which hits pay)."""
    import math
    import random

    from pytest_kvoffload.core.costs import RecomputeFit, TierFit, break_even_prefix
    rng = random.Random(11)
    checked = 0
    for _ in range(400):
        recompute = {"a": rng.uniform(0, 0.05), "b": rng.uniform(1e-5, 3e-4), "c": rng.choice([0.0, rng.uniform(0, 5e-8)])}
        bw, fixed, margin = rng.uniform(5e6, 3e9), rng.uniform(0, 0.1), rng.choice([0.0, rng.uniform(0.02, 0.5)])
        p = break_even_prefix(TierFit(bw, fixed, 4), RecomputeFit(**recompute), B_KV, margin)
        if math.isinf(p) or p <= 2 or p > 200_000:
            continue
        tier = {"bandwidth_gbps": bw / 1e9, "fixed_s": fixed, "recompute": recompute, "margin": margin}
        admit = Admission(tier, B_KV, Counters(), mode="static")
        above, below = math.ceil(p * 1.01) + 1, math.floor(p * 0.99) - 1
        assert admit(above, above + 1, 0), (p, margin)
        if below >= 1:
            assert not admit(below, below + 1, 0), (p, margin)
        checked += 1
    assert checked > 100


def test_the_calibration_file_carries_the_enforced_prefix_beside_the_paying_one():
    from pytest_kvoffload.analysis.fits import analyse

    rc = {"a": 0.01, "b": 1e-4, "c": 2e-8}

    def t(n):
        return rc["a"] + rc["b"] * n + rc["c"] * n * n
    cells = [{"backend": "kvoffload-disk", "length": n, "fraction": 0.0, "state": "cold", "sources": {},
              "ttft": {"p50": t(n), "spread": 0.05, "n": 5}} for n in (512, 1024, 2048, 4096)]
    for n in (1024, 4096):
        p = n - 128
        engine = t(n) - t(p) + rc["a"]
        cells += [{"backend": "kvoffload-disk", "length": n, "fraction": 1.0, "state": "engine-hit",
                   "sources": {"device": p}, "ttft": {"p50": engine, "spread": 0.05, "n": 5}},
                  {"backend": "kvoffload-disk", "length": n, "fraction": 1.0, "state": "tier-hit",
                   "sources": {"disk": p}, "ttft": {"p50": engine + 0.02 + p * B_KV / 25e6, "spread": 0.05, "n": 5}}]
    analysis = analyse(cells, B_KV, {"kvoffload-disk": "disk"})
    tier = build_calibration(analysis, settings(), {"device": "cpu"})["tiers"]["kvoffload-disk"]
    assert tier["margin"] == 0.1
    assert tier["enforced_break_even_prefix_tokens"] > tier["break_even_prefix_tokens"]
    assert analysis["kvoffload-disk"]["tier"]["enforced_break_even_prefix_tokens"] == tier["enforced_break_even_prefix_tokens"]

"""Runs split over pytest-xdist workers: GPU groups per worker, backend groups, one merged run folder."""

import json

import pytest

from pytest_kvoffload.harness.distributed import devices_for, merge_runs
from pytest_kvoffload.harness.options import OptionError


def test_each_worker_gets_its_own_group_of_gpus():
    gpus = ["0", "1", "2", "3", "4", "5", "6", "7"]
    assert devices_for("gw0", 1, gpus) == "0"
    assert devices_for("gw3", 2, gpus) == "6,7"
    assert devices_for("gw1", 4, ["2", "3", "5", "7", "8", "9", "10", "11"]) == "8,9,10,11"
    with pytest.raises(OptionError, match=r"worker gw4 has no GPUs: 8 visible GPU\(s\) in groups of 2 .* -n 4 or fewer"):
        devices_for("gw4", 2, gpus)


def test_merge_keeps_every_measurement_and_each_backends_furthest_status():
    base = {"run_id": "r", "backends": {"a": {"status": "selected"}, "b": {"status": "selected"}},
            "measurements": []}
    runs = [
        {"worker": "gw0", "backends": {"a": {"status": "measured"}, "b": {"status": "selected"}},
         "measurements": [{"backend": "a"}], "benchmarks": {"disk": {"text": "x"}}},
        {"worker": "gw1", "backends": {"a": {"status": "selected"}, "b": {"status": "skipped", "reason": "no GPU"}},
         "measurements": [{"backend": "b"}, {"backend": "b"}], "benchmarks": {"disk": {"text": "y"}}},
    ]
    merged = merge_runs(runs, base)
    assert len(merged["measurements"]) == 3 and merged["workers"] == ["gw0", "gw1"]
    assert merged["backends"]["a"] == {"status": "measured", "worker": "gw0"}
    assert merged["backends"]["b"]["status"] == "skipped" and merged["backends"]["b"]["worker"] == "gw1"
    assert set(merged["benchmarks"]) == {"disk", "disk (gw1)"}


RECORDING = """
import os

def record(kv_session, kv_backend, name):
    kv_session.record({"backend": kv_backend.name, "length": 512, "fraction": 1.0, "state": "cold", "round": 1,
                       "purpose": "note", "test": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                       "devices": kv_session.devices})

def test_one(kv_session, kv_backend):
    record(kv_session, kv_backend, "one")

def test_two(kv_session, kv_backend):
    record(kv_session, kv_backend, "two")
"""


def run_split(pytester, *args):
    pytester.makepyfile(RECORDING)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist", "--kv-backend=gpu-only,kvoffload-disk",
                                           "--kv-results-dir=res", *args)
    result.assert_outcomes(passed=4)
    (run_dir,) = (pytester.path / "res").iterdir()
    return run_dir, json.loads((run_dir / "run.json").read_text())


def test_workers_share_one_run_folder_and_each_backend_stays_in_one_worker(pytester, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_DEVICE", "cpu")
    run_dir, run = run_split(pytester)
    notes = run["measurements"]
    assert sorted((m["backend"], m["test"]) for m in notes) == [
        ("gpu-only", "one"), ("gpu-only", "two"), ("kvoffload-disk", "one"), ("kvoffload-disk", "two")]
    for backend in ("gpu-only", "kvoffload-disk"):
        assert len({m["worker"] for m in notes if m["backend"] == backend}) == 1
    assert run["status"] == "complete" and (run_dir / "workers").is_dir()
    assert all(m["devices"] is None for m in notes)  # no GPU: nothing to pin


def test_workers_on_a_gpu_machine_are_pinned_to_their_own_gpus(pytester, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_DEVICE", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    _, run = run_split(pytester, "--kv-tensor-parallel=2")
    pinned = {m["worker"]: m["devices"] for m in run["measurements"]}
    assert all(pinned[w] == {"gw0": "4,5", "gw1": "6,7"}[w] for w in pinned)

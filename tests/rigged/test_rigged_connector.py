"""The test-only connector (pytest_kvoffload/rigged/): its knobs are read apart from the product's and checked
in one line each, its emulated drive holds reads to its rate, its planted rules are wrong as they say, and the
harness starts it only for a server whose options hold a knob (the product connector for every other)."""

import json
import time
from pathlib import Path

import pytest
import torch

from pytest_kvoffload.connector.config import ConnectorConfig, ConnectorConfigError
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.connector.chunk_format import Layout
from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.rigged.emulated_drive import PacedChunkStore
from pytest_kvoffload.rigged.knobs import needs_rig, split
from pytest_kvoffload.rigged.planted_admission import PlantedAdmission, rule
from pytest_kvoffload.rigged.planted_kv import planted, stale_block
from pytest_kvoffload.serve.backend import LaunchContext, with_connector_options
from pytest_kvoffload.serve.builtin import default_registry

TIER = {"recompute": {"a": 0.01, "b": 1e-5, "c": 0.0}, "bandwidth_gbps": 1.0, "fixed_s": 0.02, "margin": 0.0}


@pytest.mark.parametrize("extra", [{"read_gbps": 0.5}, {"read_latency_ms": 3}, {"fault": "zero"},
                                   {"admission": "static:scale=1.3"}, {"admission": "queue:full-credit"}])
def test_the_deployed_connector_refuses_each_knob_in_one_line_and_the_rigged_one_takes_it(extra):
    with pytest.raises(ConnectorConfigError) as refused:
        ConnectorConfig.from_extra({"store_dir": "/x", **extra}, 128)
    assert "\n" not in str(refused.value) and "pytest_kvoffload.rigged" in str(refused.value)
    config, rig = split({"store_dir": "/x", **extra}, 128)
    assert config.admission in ("queue", "static") and needs_rig(extra)


@pytest.mark.parametrize("extra,match", [
    ({"read_gbps": 0}, "read_gbps 0 must be a number of GB/s above 0"),
    ({"read_gbps": "fast"}, "read_gbps 'fast' must be a number of GB/s above 0"),
    ({"read_latency_ms": -1}, "read_latency_ms -1 must be a number of milliseconds, 0 or more"),
    ({"fault": "flip"}, "fault 'flip' must be one of zero, shift, alternate, stale"),
    ({"admission": "static:scale=0"}, "scale must be a number above 0"),
    ({"admission": "queue:no-fixed"}, "must be one of queue, static"),
    ({"io_threads": 0}, "io_threads 0 must be at least 1"),  # the product's own options, checked as before
])
def test_a_bad_knob_is_one_line_naming_it(extra, match):
    with pytest.raises(ConnectorConfigError, match=match):
        split({"store_dir": "/x", **extra}, 128)


def test_options_without_a_knob_need_no_rig():
    assert not needs_rig({"store_dir": "/x", "io_threads": 4, "admission": "queue"})


def test_the_emulated_drive_holds_reads_to_its_rate(tmp_path):
    layout = Layout(layers=1, blocks=1, block_bytes=4 << 20)
    store = PacedChunkStore(tmp_path, "model=a", layout, read_bytes_per_s=100e6)
    key = f"{1:032x}"
    buf = store.new_buffer()
    buf[:] = 1
    store.write(key, buf)
    started = time.perf_counter()
    for _ in range(3):
        assert store.read(key, buf)
    assert time.perf_counter() - started >= 3 * layout.file_bytes / 100e6 * 0.99


def test_planted_kv_is_wrong_as_each_fault_says():
    src = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    assert not planted(src, "zero", 1).any()
    assert torch.equal(planted(src, "shift", 1)[:, 1], src[:, 0])
    assert not planted(src, "alternate", 1).any() and torch.equal(planted(src, "alternate", 2), planted(src, "shift", 1))
    earlier = torch.full((2, 1, 4), -1.0)
    stale = stale_block(src, 1, earlier)
    assert torch.equal(stale[:, 1:2], earlier)  # one block stale, every other one right
    assert torch.equal(stale[:, 0], src[:, 0]) and torch.equal(stale[:, 2], src[:, 2])
    assert torch.equal(stale_block(src, 2, None)[:, 2], src[:, 0])  # no earlier block yet: another position's


def test_planted_rules_are_the_product_rule_wrong_by_what_they_name():
    right = rule(TIER, 4096, Counters(), "static")
    assert type(right) is not PlantedAdmission
    load, recompute = right.predicted(2048, 0)
    scaled = rule(TIER, 4096, Counters(), "static:scale=1.3").predicted(2048, 0)
    assert scaled == pytest.approx((load * 1.3, recompute))
    blind = rule(TIER, 4096, Counters(), "static:no-fixed")
    assert blind.fixed_cost() == TIER["recompute"]["a"] and blind.predicted(2048, 0)[0] < load
    assert rule({**TIER, "queue_overlap": 0.2}, 4096, Counters(), "queue:full-credit").queue_credit() == 1.0


def settings(tmp_path):
    return Settings(backends=("kvoffload-disk",), model=load_model("tiny-llama"), lengths=(512,), fractions=(1.0,),
                    rounds=1, results_dir=tmp_path, block_size=128)


def connector_of(spec) -> dict:
    return json.loads(spec.args[spec.args.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("options,module", [
    ({}, "pytest_kvoffload.connector"), ({"io_threads": 4}, "pytest_kvoffload.connector"),
    ({"read_gbps": 0.05}, "pytest_kvoffload.rigged"), ({"fault": "alternate"}, "pytest_kvoffload.rigged"),
    ({"admission": "static:scale=0.75"}, "pytest_kvoffload.rigged")])
def test_the_harness_starts_the_rigged_connector_only_for_a_knob(tmp_path, options, module):
    ours = default_registry().get("kvoffload-disk")
    backend = with_connector_options(ours, "v", **options) if options else ours
    config = connector_of(backend.configure(LaunchContext(settings(tmp_path), Path(tmp_path))))
    assert config["kv_connector_module_path"] == module
    assert config["kv_connector"] == ("KVOffloadDiskConnector" if module.endswith("connector")
                                      else "RiggedKVOffloadConnector")

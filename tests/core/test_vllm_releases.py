"""The declared vLLM range and what differs between its releases (core/vllm_releases.py)."""

import pytest

from pytest_kvoffload.core.vllm_releases import DEFAULT, RELEASES, UnsupportedVllm, declared_range, release
from pytest_kvoffload.measure.cells import Expectation


@pytest.mark.parametrize("version,series", [("0.31.0", "0.31"), ("0.32.0", "0.32"), ("0.32.0+cpu", "0.32"),
                                            ("0.33.0", "0.33"), ("0.31", "0.31")])
def test_versions_inside_the_range_have_a_release(version, series):
    assert release(version).series == series


@pytest.mark.parametrize("version", ["0.30.0", "0.34.0", "1.0.0", None, "nightly"])
def test_a_version_outside_the_range_is_one_line_naming_it_and_the_range(version):
    with pytest.raises(UnsupportedVllm) as raised:
        release(version, "kvoffload-disk's server, /venv/bin/python")
    message = str(raised.value)
    assert "\n" not in message
    assert (f"vLLM {version}" if version else "no vLLM") in message
    assert "0.31 to 0.33" in message and "/venv/bin/python" in message
    assert declared_range() in message


def test_only_0_31_cannot_name_tiers():
    assert [r.series for r in RELEASES.values() if not r.by_tier] == ["0.31"]
    old = RELEASES["0.31"]
    assert old.source("local_cache_hit") == "device" and old.source("external_kv_transfer") == "external"
    assert old.source("local_compute") is None  # computed, not cached
    assert DEFAULT.source("disk") == "disk" and DEFAULT.series == "0.32"
    assert "not which tier" in old.verification and "by tier" in DEFAULT.verification


def test_an_expectation_is_counted_as_the_release_counts_it():
    old = RELEASES["0.31"]
    tier = Expectation("disk", 768, tail_source="device", tail_tokens=128)
    assert tier.as_counted_by(DEFAULT) == tier
    assert tier.as_counted_by(old) == Expectation("external", 768, "device", 128)
    # A hit served by two tiers is one external count on 0.31.
    assert Expectation("cpu", 512, "disk", 256).as_counted_by(old) == Expectation("external", 768)
    assert Expectation("device", 896).as_counted_by(old) == Expectation("device", 896)
    assert Expectation("external", 768).as_counted_by(old).check({"external": 768, "device": 0}) is None
    assert Expectation("disk", 768).as_counted_by(old).check({"device": 768}) is not None

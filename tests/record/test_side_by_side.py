"""The report's table of kvoffload-disk against each other tier on the same cells (no server)."""

from pytest_kvoffload.record.report import side_by_side_lines


def hit(backend, length, fraction, ms, tokens, source="disk"):
    return {"backend": backend, "length": length, "fraction": fraction, "state": "tier-hit",
            "ttft": {"p50": ms / 1e3}, "sources": {source: tokens}}


def test_ours_against_each_user_facing_tier_on_the_same_cells():
    run = {"options": {"model": {"kv_bytes_per_token": 4096}}, "environment": {"drive": {"read_gbps": 1.4}},
           "backends": {"kvoffload-disk[slow]": {"user_facing": False}},
           "cells": [hit("kvoffload-disk", 1280, 1.0, 84, 1152), hit("native-disk", 1280, 1.0, 26, 1280),
                     hit("native-cpu", 1280, 1.0, 35, 1280, "cpu"), hit("kvoffload-disk[slow]", 1280, 1.0, 300, 1152),
                     hit("native-disk", 384, 1.0, 23, 384)]}
    text = "\n".join(side_by_side_lines(run))
    assert "this run's drive reads 1,400 MB/s with O_DIRECT" in text
    native_disk = next(line for line in text.splitlines() if line.startswith("native-disk"))
    assert "3.23x" in native_disk and "1,152 vs 1,280" in native_disk and "56" in native_disk  # 4.7 MB / 84 ms
    assert any(line.startswith("native-cpu") for line in text.splitlines())
    assert "[slow]" not in text and "384" not in text  # not user-facing; a cell ours did not measure
    assert side_by_side_lines({"cells": [hit("native-disk", 384, 1.0, 23, 384)]}) == []

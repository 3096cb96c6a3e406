import json

import pytest

from pytest_kvoffload.record.run_record import RecordError, RunWriter, read_run, write_cells_csv
from pytest_kvoffload.record.report import render
from pytest_kvoffload.analysis.cell_stats import cell_table, summarize


def measurement(state, ttft, fraction=0.0, sources=None, purpose="measure", length=1024):
    return {"backend": "gpu-only", "length": length, "fraction": fraction, "state": state, "round": 1,
            "purpose": purpose, "prompt_tokens": length, "client_ttft_s": ttft, "server_ttft_s": ttft * 0.9,
            "cached_by_source": sources or {}, "verified": True}


def test_run_is_valid_json_and_partial_from_the_start(tmp_path):
    writer = RunWriter(tmp_path / "run", "r1", {"rounds": 1}, {"device": "cpu"})
    writer.add_measurement(measurement("cold", 0.2))
    run = read_run(tmp_path / "run")
    assert run["status"] == "partial" and len(run["measurements"]) == 1


def test_finish_marks_complete_with_cells(tmp_path):
    writer = RunWriter(tmp_path, "r1", {}, {})
    for ttft in (0.2, 0.3):
        writer.add_measurement(measurement("cold", ttft))
    writer.add_measurement(measurement("engine-hit", 0.05, 1.0, {"device": 896}))
    writer.add_measurement(measurement("engine-hit", 9.0, 1.0, purpose="prime"))
    writer.finish("complete", cell_table(writer.data["measurements"]))
    run = read_run(tmp_path / "run.json")
    assert run["status"] == "complete"
    cold = [c for c in run["cells"] if c["state"] == "cold"][0]
    assert cold["ttft"]["n"] == 2 and cold["ttft"]["p50"] == pytest.approx(0.25)
    hit = [c for c in run["cells"] if c["state"] == "engine-hit"][0]
    assert hit["ttft"]["n"] == 1 and hit["sources"] == {"device": 896}


def test_read_run_refuses_other_files(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(RecordError, match="not a pytest-kvoffload run record"):
        read_run(tmp_path)
    (tmp_path / "run.json").write_text("{")
    with pytest.raises(RecordError, match="not valid JSON"):
        read_run(tmp_path)
    with pytest.raises(RecordError, match="no run.json there"):
        read_run(tmp_path / "missing")
    (tmp_path / "run.json").write_text(json.dumps({"schema": "pytest-kvoffload/run", "schema_version": 9}))
    with pytest.raises(RecordError, match="schema version 9, this plugin reads versions 1 and 2"):
        read_run(tmp_path)


def test_version_1_record_reads_as_version_2(tmp_path):
    """Version 1 kept the tier's first-order figures under "seed"; the reader moves them."""
    figures = {"tflops": 0.04, "from_tokens": 4096, "gbps": {"512": 0.3}}
    (tmp_path / "run.json").write_text(json.dumps({
        "schema": "pytest-kvoffload/run", "schema_version": 1,
        "analysis": {"kvoffload-disk": {"tier": {"seed": figures}}, "gpu-only": {"tier": None}}}))
    run = read_run(tmp_path)
    assert run["schema_version"] == 2 and run["analysis"]["kvoffload-disk"]["tier"] == {"first_order": figures}


def test_summary_statistics():
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["p50"] == 2.5 and s["n"] == 4 and s["max"] == 4.0
    assert s["spread"] == pytest.approx((3.25 - 1.75) / 2 / 2.5)


def test_report_shows_cells_and_skipped_backends(tmp_path):
    writer = RunWriter(tmp_path, "r1", {}, {})
    writer.set_backend("gpu-only", "measured")
    writer.set_backend("native-cpu", "skipped", "native-cpu needs an NVIDIA GPU")
    writer.add_measurement(measurement("cold", 0.4))
    writer.add_measurement(measurement("engine-hit", 0.1, 1.0, {"device": 896}))
    writer.finish("complete", cell_table(writer.data["measurements"]))
    text = render(read_run(tmp_path))
    assert "native-cpu: skipped (native-cpu needs an NVIDIA GPU)" in text
    assert "4.00x" in text and "device 896" in text and "400" in text


def test_cells_csv(tmp_path):
    cells = cell_table([measurement("cold", 0.2), measurement("engine-hit", 0.05, 1.0, {"device": 896})])
    write_cells_csv(tmp_path / "cells.csv", cells)
    lines = (tmp_path / "cells.csv").read_text().splitlines()
    assert lines[0].startswith("backend,length,fraction,state,n,ttft_p50_s")
    assert "device=896" in lines[2] and len(lines) == 3


def test_report_counts_admission_decisions(tmp_path):
    writer = RunWriter(tmp_path, "r1", {}, {})
    writer.set_backend("kvoffload-disk", "measured")
    hit = measurement("tier-hit", 0.3, 1.0)
    hit.update(backend="kvoffload-disk", connector={"kvoffload:loads_declined_total": 1.0,
                                                      "kvoffload:tokens_declined_total": 896.0})
    cold = measurement("cold", 0.3)
    cold["backend"] = "kvoffload-disk"
    writer.add_measurement(cold)
    writer.add_measurement(hit)
    writer.finish("complete", cell_table(writer.data["measurements"]))
    assert "admission: 0 loads admitted, 1 declined (896 tokens recomputed instead)" in render(read_run(tmp_path))


def test_unverified_requests_feed_no_cell_and_are_listed():
    from pytest_kvoffload.record.report import render
    from pytest_kvoffload.analysis.cell_stats import cell_table

    def m(ttft, verified, problem=None):
        return {"backend": "kvoffload-disk", "length": 1024, "fraction": 1.0, "state": "tier-hit", "round": 1,
                "purpose": "measure", "client_ttft_s": ttft, "prompt_tokens": 1024, "cached_by_source": {"disk": 896},
                "verified": verified, "problem": problem}

    measurements = [m(0.05, True), m(0.06, True), m(9.0, False, "expected 896 cached tokens from 'disk', got 0")]
    (cell,) = cell_table(measurements)
    assert cell["ttft"]["n"] == 2 and cell["ttft"]["max"] == 0.06
    text = render({"run_id": "r", "status": "complete", "measurements": measurements, "cells": [cell], "backends": {}})
    assert "excluded from every cell, fit and calibration: 1 unverified requests" in text
    assert "kvoffload-disk 1024 tokens, 1 cached, tier-hit, round 1: expected 896 cached tokens" in text

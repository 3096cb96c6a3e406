"""The report's lines that are not tables: client minus server TTFT per backend (no server)."""

from pytest_kvoffload.record.report import client_server_lines, render


def cell(backend, state, client_ms, server_ms):
    return {"backend": backend, "state": state, "ttft": {"p50": client_ms / 1e3},
            "server_ttft": {"p50": server_ms / 1e3}}


def test_the_gap_is_given_per_backend_and_state_and_flagged_above_5_ms():
    cells = [cell("gpu-only", "cold", 64, 60), cell("gpu-only", "engine-hit", 20, 16),
             cell("native-disk", "cold", 68, 60), cell("native-disk", "tier-hit", 40, 23),
             cell("native-disk", "tier-hit", 42, 25)]
    lines = client_server_lines(cells)
    assert lines[0].startswith("client minus server TTFT, median over cells")
    assert "leaves out HTTP, the queue and an asynchronous KV load" in lines[0]
    gpu = next(line for line in lines if "gpu-only" in line)
    assert gpu == "  gpu-only: cold 4.0 ms, engine-hit 4.0 ms"
    disk = next(line for line in lines if "native-disk" in line)
    assert "cold 8.0 ms, tier-hit 17.0 ms  FLAG: above 5 ms" in disk
    assert "tier hits 9.0 ms more than cold: the tier's asynchronous load" in disk


def test_cells_without_a_server_figure_are_left_out_and_the_report_carries_the_lines():
    assert client_server_lines([{"backend": "x", "state": "cold", "ttft": {"p50": 0.1}, "server_ttft": None}]) == []
    assert "gpu-only: cold 4.0 ms" in "\n".join(client_server_lines([cell("gpu-only", "cold", 64, 60)]))
    text = render({"backends": {}, "cells": []})
    assert "client minus server" not in text

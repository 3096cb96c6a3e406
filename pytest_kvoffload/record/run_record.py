"""The run record: one versioned JSON file per pytest session, valid at every moment.

The file is rewritten whole (temporary name, then rename) after every change, so a run cut short by
Ctrl-C or a crashed server still leaves valid JSON, marked "partial" until the session finishes.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any, TypedDict

from pytest_kvoffload.core.whole_files import atomic_write_json

SCHEMA = "pytest-kvoffload/run"
# 2: analysis.<backend>.tier.first_order (was .seed in 1, which read_run still reads).
SCHEMA_VERSION = 2


class RecordError(ValueError):
    pass


class Measurement(TypedDict, total=False):
    """One request's record: its cell, round and purpose ("measure" rounds make the run's cells; "prime",
    "ab", "drive-probe", "burst" are kept beside them), the request's own figures (serve/client.py's
    RequestResult: TTFTs, cached tokens by source, connector counters), and its checks."""
    backend: str
    length: int
    fraction: float
    state: str
    round: int
    purpose: str
    client_ttft_s: float
    server_ttft_s: float | None
    cached_by_source: dict[str, float]
    connector: dict[str, float]
    expected_source: str | None
    expected_cached: int
    verified: bool
    problem: str | None
    output_checked: bool
    output_matches: bool
    output_difference: str
    tier_page_cache: dict


class BackendEntry(TypedDict, total=False):
    """A backend's state in the run (selected, running, measured, skipped, failed, external) and what its
    server was: command line, log, prefill speed, tier I/O mode, load and save histograms."""
    status: str
    reason: str
    description: str
    argv: list[str]
    log: str
    user_facing: bool
    prefill: dict
    tier_io: dict
    histograms: dict


class RunWriter:
    def __init__(self, run_dir: Path, run_id: str, options: dict, environment: dict) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "run.json"
        self.data: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id,
            "status": "partial",
            "started_at": time.time(),
            "finished_at": None,
            "options": options,
            "environment": environment,
            "backends": {},
            "measurements": [],
            "cells": [],
            "analysis": {},
        }
        self.flush()

    def set_backend(self, name: str, status: str, reason: str = "", **info: Any) -> None:
        entry = self.data["backends"].setdefault(name, {})
        entry.update({"status": status, "reason": reason, **info})
        self.flush()

    def started(self, name: str, info: dict, server_starts: list[dict], lengths: list[int]) -> None:
        """A started server, written once: its backend's entry running with what the start found, the
        run's start-ups so far and the grid's lengths."""
        self.data["backends"].setdefault(name, {}).update({"status": "running", "reason": "", **info})
        self.data["server_starts"] = server_starts
        self.data["lengths"] = lengths
        self.flush()

    def add_measurement(self, record: dict) -> None:
        self.data["measurements"].append(record)
        self.flush()

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    @property
    def environment(self) -> dict:
        return self.data["environment"]

    @property
    def measurements(self) -> list[Measurement]:
        return self.data["measurements"]

    def backend(self, name: str) -> BackendEntry:
        """A backend's entry ({} when the run has none for it)."""
        return self.data["backends"].get(name, {})

    def benchmark(self, name: str) -> dict:
        return dict(self.data.get("benchmarks", {}).get(name, {}))

    def set_benchmark(self, name: str, entry: dict) -> None:
        self.data.setdefault("benchmarks", {})[name] = entry
        self.flush()

    def replace(self, data: dict) -> None:
        """The whole record at once (the controller's merge of its workers' records)."""
        self.data = data
        self.flush()

    def finish(self, status: str, cells: list[dict], analysis: dict | None = None) -> None:
        """The run's status, cells and analysis; a backend still running when the run ends was measured."""
        for entry in self.data["backends"].values():
            if entry.get("status") == "running":
                entry["status"] = "measured"
        self.data["cells"] = cells
        if analysis is not None:
            self.data["analysis"] = analysis
        self.data["status"] = status
        self.data["finished_at"] = time.time()
        self.flush()

    def flush(self) -> None:
        atomic_write_json(self.path, self.data)


def read_run(path: str | Path) -> dict:
    """A saved run, from its folder or its run.json; schema checked."""
    p = Path(path)
    if p.is_dir():
        p = p / "run.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise RecordError(f"{path}: no run.json there; pass a folder under results/ or its run.json") from None
    except json.JSONDecodeError as exc:
        raise RecordError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise RecordError(f"{p}: not a pytest-kvoffload run record (schema {SCHEMA!r} expected)")
    if data.get("schema_version") == 1:
        return upgrade_v1(data)
    if data.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(
            f"{p}: schema version {data.get('schema_version')}, this plugin reads versions 1 and {SCHEMA_VERSION}"
        )
    return data


def upgrade_v1(data: dict) -> dict:
    """A version-1 record in version 2's shape: the tier's first-order figures were under "seed"."""
    for entry in (data.get("analysis") or {}).values():
        tier = entry.get("tier") if isinstance(entry, dict) else None
        if isinstance(tier, dict) and "seed" in tier:
            tier["first_order"] = tier.pop("seed")
    data["schema_version"] = SCHEMA_VERSION
    return data


CSV_COLUMNS = ["backend", "length", "fraction", "state", "n", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "spread",
               "prompt_tokens", "cached_tokens_mean", "sources", "verified"]


def write_cells_csv(path: Path, cells: list[dict]) -> None:
    """One row per cell, for spreadsheets; run.json stays the complete record."""
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(CSV_COLUMNS)
        for c in cells:
            t = c["ttft"]
            sources = ";".join(f"{k}={v:g}" for k, v in sorted(c["sources"].items()))
            out.writerow([c["backend"], c["length"], c["fraction"], c["state"], t["n"], t["p50"], t["p90"], t["p99"],
                          t["spread"], c["prompt_tokens"], c["cached_tokens_mean"], sources, c["verified"]])

"""The files drawn from a complete run record, beside its run.json: the calibration the connector's
admission rule reads, cells.csv, summary.txt (the terminal summary), report.html and the plots."""

from __future__ import annotations

from pathlib import Path

from pytest_kvoffload.core.calibration import build_calibration, write_calibration
from pytest_kvoffload.record.plots import write_all
from pytest_kvoffload.record.roles import ours
from pytest_kvoffload.core.progress import Say
from pytest_kvoffload.record.run_record import write_cells_csv
from pytest_kvoffload.record.html_report import write_run_page
from pytest_kvoffload.record.summary_text import summary_text
from pytest_kvoffload.core.settings import Settings


def write_run_files(run: dict, settings: Settings, run_dir: Path, progress: Say) -> None:
    calibration = build_calibration(run.get("analysis") or {}, settings, run["environment"], connector_tier=ours(run))
    if calibration["tiers"]:
        write_calibration(run_dir / "calibration.json", calibration)
    write_cells_csv(run_dir / "cells.csv", run.get("cells") or [])
    (run_dir / "summary.txt").write_text(summary_text(run) + "\n")
    try:
        write_run_page(run, run_dir)
    except Exception as exc:  # a page must never cost the run its record
        progress(f"report.html skipped: {exc}")
    try:
        write_all(run, run_dir)
    except Exception as exc:  # a plot must never cost the run its record
        progress(f"plot skipped: {exc}")

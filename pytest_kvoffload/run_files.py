"""The files drawn from a complete run record, beside its run.json: the calibration the connector's
admission rule reads, cells.csv, summary.txt (the terminal summary) and the plots."""

from __future__ import annotations

from pathlib import Path

from .calibration import build_calibration, write_calibration
from .plots import write_all
from .progress import Say
from .records import write_cells_csv
from .report import render
from .settings import Settings


def write_run_files(run: dict, settings: Settings, run_dir: Path, progress: Say) -> None:
    calibration = build_calibration(run.get("analysis") or {}, settings, run["environment"])
    if calibration["tiers"]:
        write_calibration(run_dir / "calibration.json", calibration)
    write_cells_csv(run_dir / "cells.csv", run.get("cells") or [])
    (run_dir / "summary.txt").write_text(render(run) + "\n")
    try:
        write_all(run, run_dir)
    except Exception as exc:  # a plot must never cost the run its record
        progress(f"plot skipped: {exc}")

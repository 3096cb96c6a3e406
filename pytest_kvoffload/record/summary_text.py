"""summary.txt and the terminal summary: the run's verdicts first (record/verdict_block.py), then the tables
and figures (record/report.py)."""

from __future__ import annotations

from pytest_kvoffload.record.report import render
from pytest_kvoffload.record.verdict_block import render_block


def summary_text(run: dict) -> str:
    block = render_block(run)
    return (block + "\n" if block else "") + render(run)

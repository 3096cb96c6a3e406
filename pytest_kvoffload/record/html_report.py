"""report.html: one self-contained page per run (verdicts first, plots inline, no network) and one per
comparison (`kvoffload compare A B --html OUT`, cells coloured by verdict), built with jinja2's templates
in record/templates/."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape

from pytest_kvoffload.core.tolerances import GATE_P90_ROUNDS
from pytest_kvoffload.record import page_plots
from pytest_kvoffload.analysis.run_gate import Comparison
from pytest_kvoffload.record.report import side_by_side_rows
from pytest_kvoffload.record.tier_limit_table import rows_of as limit_rows
from pytest_kvoffload.record.verdict_block import verdict_lines
from pytest_kvoffload.analysis.outcome import MET, MISSED, UNDECIDED

PAGE = "report.html"


def _templates() -> Environment:
    return Environment(loader=PackageLoader("pytest_kvoffload.record", "templates"),
                       autoescape=select_autoescape(["html", "j2"]))


def _css() -> str:
    return (Path(__file__).parent / "templates" / "page.css").read_text()


def _counts(outcomes: list[str]) -> dict:
    return {o: outcomes.count(o) for o in (MET, MISSED, UNDECIDED)}


def _plot(draw, run: dict) -> str | None:
    try:
        return draw(run)
    except Exception:  # a picture must never cost the run its page  # noqa: BLE001
        return None


def machine_rows(run: dict, run_dir: Path | None) -> list[tuple[str, str]]:
    env = run.get("environment") or {}
    rows = [(k, str(env[k])) for k in ("device", "cpu", "cpu_count", "host", "platform", "vllm", "torch", "lmcache",
                                       "pytest_kvoffload", "git_commit", "engine", "compile") if env.get(k)]
    drive = env.get("drive") or {}
    if drive.get("read_gbps"):
        rows.append(("drive", f"{drive.get('path')}: read {drive['read_gbps']:.2f} GB/s, write "
                              f"{drive.get('write_gbps') or 0:.2f} GB/s, O_DIRECT {drive.get('direct_io')}"))
    calibration = run_dir / "calibration.json" if run_dir else None
    if calibration is not None and calibration.is_file():
        try:
            fingerprint = json.loads(calibration.read_text()).get("fingerprint") or {}
            rows.append(("calibration fingerprint", ", ".join(f"{k} {v}" for k, v in fingerprint.items())))
        except ValueError:
            rows.append(("calibration fingerprint", "calibration.json unreadable"))
    return rows


def _when(stamp) -> str:
    """run.json's started_at (seconds since the epoch) as a UTC time."""
    import time
    try:
        return "started " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(stamp)))
    except (TypeError, ValueError):
        return ""


def render_run_page(run: dict, run_dir: Path | None = None) -> str:
    verdicts = verdict_lines(run)
    files = []
    if run_dir is not None:
        files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                       if p.is_file() and p.name != PAGE and p.suffix in (".log", ".json", ".csv", ".txt", ".png"))
    env = run.get("environment") or {}
    return _templates().get_template("run.html.j2").render(
        css=_css(), run_id=run.get("run_id"), status=run.get("status"), started=_when(run.get("started_at")),
        model=((run.get("options") or {}).get("model") or {}).get("name", "?"),
        machine=f"{env.get('cpu', '?')} ({env.get('cpu_count', '?')} CPUs, {env.get('device', '?')})",
        verdicts=verdicts, counts=_counts([v.outcome for v in verdicts]),
        plots={"ttft": _plot(page_plots.ttft_panels, run), "break_even": _plot(page_plots.break_even_panels, run),
               "admission": _plot(page_plots.admission_panels, run)},
        side=side_by_side_rows(run), limits=limit_rows(run), machine_rows=machine_rows(run, run_dir), files=files)


def write_run_page(run: dict, run_dir: Path) -> Path:
    path = run_dir / PAGE
    path.write_text(render_run_page(run, run_dir))
    return path


def render_compare_page(base: dict, new: dict, result: Comparison, limit: float, failures: list[str],
                        code: int) -> str:
    cells = [{"backend": k[0], "length": k[1], "cached": f"{k[2]:g}", "state": k[3], "base_ms": f"{b * 1e3:,.1f}",
              "new_ms": f"{n * 1e3:,.1f}", "ratio": f"{v.estimate:.3f}", "interval": v.interval_text(),
              "outcome": v.outcome} for k, v, b, n in result.cells]
    return _templates().get_template("compare.html.j2").render(
        css=_css(), base=base.get("run_id"), new=new.get("run_id"), limit=1 + limit, code=code,
        groups=result.groups, counts=_counts([g.outcome for g in result.groups]), failures=failures, cells=cells,
        p90_skipped=result.p90_skipped, p90_rounds=GATE_P90_ROUNDS)

"""The run's verdicts, one line each, first in summary.txt, the terminal summary and report.html: met, missed or
undecided (or a figure, where nothing is judged), the figure, and where the detail is. Drawn from run.json
alone, so a saved run renders the same block."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvoffload.record.disk_speed_summary import disk_speed_of
from pytest_kvoffload.record import roles
from pytest_kvoffload.record.report import CLOSE_CALLS, side_by_side_rows
from pytest_kvoffload.record import tier_limit_table
from pytest_kvoffload.analysis.outcome import MET, MISSED, UNDECIDED

FIGURE = "figure"  # a line that reports a figure nothing is judged against


@dataclass(frozen=True)
class VerdictLine:
    outcome: str  # met, missed, undecided or figure
    what: str
    figure: str
    where: str

    def text(self) -> str:
        mark = {MET: "met", MISSED: "MISSED", UNDECIDED: "UNDECIDED", FIGURE: "figure"}[self.outcome]
        return f"{mark:<9} {self.what}: {self.figure} [{self.where}]"


def _measured(run: dict) -> list[dict]:
    """Measured requests of user-facing backends: a planted-fault server's wrong outputs are its test's to
    judge (the oracle suite fails where they are not caught), not the run's verdict."""
    backends = run.get("backends") or {}
    return [m for m in run.get("measurements") or [] if m.get("purpose", "measure") == "measure"
            and (backends.get(m["backend"]) or {}).get("user_facing", True) is not False]


def source_checks(run: dict) -> list[VerdictLine]:
    checked = [m for m in _measured(run) if "verified" in m]
    if not checked:
        return []
    wrong = [m for m in checked if m["verified"] is False]
    return [VerdictLine(MISSED if wrong else MET, "sources", f"{len(checked) - len(wrong)} of {len(checked)} requests "
                        "cached where expected (tier hits proven by loads)", "excluded requests, below")]


def output_checks(run: dict) -> list[VerdictLine]:
    checked = [m for m in _measured(run) if m.get("output_checked")]
    if not checked:
        return []
    differ = [m for m in checked if not m.get("output_matches")]
    compared = sum(m.get("output_tokens_compared", 0) or 0 for m in checked)
    tokens = f", {compared:,} tokens compared" if compared else ""
    return [VerdictLine(MISSED if differ else MET, "outputs", f"{len(checked) - len(differ)} of {len(checked)} "
                        f"checked hits answered as a recompute{tokens}", "excluded requests, below")]


def tier_targets(run: dict) -> list[VerdictLine]:
    rows = side_by_side_rows(run)
    judged = [r for r in rows if r["target"] != "-"]
    if not judged:
        return []
    missed = [r for r in judged if r["target"].startswith("MISSED")]
    open_ = [r for r in judged if r["target"].startswith("UNDECIDED")]
    names = ", ".join(f"{r['other']} {r['length']} x {r['cached']}" for r in missed[:3])
    unsure = ", ".join(f"{r['other']} {r['length']} x {r['cached']}" for r in open_[:3])
    met = len(judged) - len(missed) - len(open_)
    return [VerdictLine(MISSED if missed else UNDECIDED if open_ else MET, "tier target (report-only)",
                        f"{met} of {len(judged)} cells within 1.05x of the other tier"
                        + (f"; missed {names}" if missed else "") + (f"; undecided {unsure}" if open_ else ""),
                        "side by side")]


def fits(run: dict) -> list[VerdictLine]:
    lines = []
    for backend, entry in sorted((run.get("analysis") or {}).items()):
        tier = entry.get("tier")
        if not tier or "[" in backend or "~" in backend:
            continue
        p_star = tier.get("break_even_prefix_tokens")
        low, high = (tier.get("bandwidth_interval_gbps") or [None, None])[:2]
        bandwidth = tier.get("bandwidth_gbps")
        figure = (f"loads pay from {p_star:,.0f} tokens" if p_star else "no prefix pays") + (
            f", {bandwidth:.2f} GB/s [{low:.2f}, {high:.2f}]" if bandwidth and low is not None and high is not None
            else ", bandwidth unresolved (transfer time below the noise)")
        lines.append(VerdictLine(FIGURE, f"break-even {backend}", figure, "break-even"))
    return lines


def admission(run: dict) -> list[VerdictLine]:
    data = (run.get("benchmarks") or {}).get("admission")
    if not data:
        return []
    cells = (data.get("frontier") or []) + (data.get("queue") or [])
    wrong = [c for c in cells if c["wrong"] > c["noise_allows"]]
    detect = [c["detectable_slowdown"] for c in data.get("frontier") or [] if c.get("detectable_slowdown") is not None]
    outcome = MISSED if wrong or data.get("too_noisy") else MET
    figure = (f"rule {data.get('mode')}: wrong beyond noise in {len(wrong)} of {len(cells)} cells"
              + (f"; detects from {max(detect):.0%} slower" if detect else "")
              + (f"; {data['too_noisy']}" if data.get("too_noisy") else ""))
    return [VerdictLine(outcome, "admission", figure, "admission")]


def ab(run: dict) -> list[VerdictLine]:
    """Every A/B benchmark (paired cells with a verdict each): B no slower than A."""
    lines = []
    for name, data in sorted((run.get("benchmarks") or {}).items()):
        cells = data.get("cells") or []
        if not cells or not all("verdict" in c and "ratios" in c for c in cells):
            continue
        verdicts = [c["verdict"] for c in cells]
        outcome = (MISSED if "B slower" in verdicts else UNDECIDED if any(v.startswith("undecided") for v in verdicts)
                   else MET)
        medians = [c["median_ratio"] for c in cells if c.get("median_ratio")]
        figure = (f"B/A {min(medians):.2f} to {max(medians):.2f} over {len(cells)} cell(s); "
                  f"{verdicts.count('B slower')} slower, {verdicts.count('B faster')} faster") if medians else "-"
        lines.append(VerdictLine(outcome, name, figure, name))
    return lines


def equal_engines(run: dict) -> list[VerdictLine]:
    data = (run.get("benchmarks") or {}).get("equal engines")
    if not data or "lengths" not in data:
        return []
    unequal = [x for x in data["lengths"] if not x["within_cap"]]
    figure = ", ".join(f"{x['length']} tokens {x['median_ratio']:.2f}" for x in data["lengths"])
    return [VerdictLine(MISSED if unequal else MET, f"equal engines {' / '.join(reversed(data['pair']))}",
                        f"median cold ratio {figure} (within 10%)", "equal engines")]


def disk_speed(run: dict) -> list[VerdictLine]:
    found = disk_speed_of(run)
    if not found or not found[1].get("delivered_read_gbps"):
        return []
    name, data = found
    probe = data.get("probe") or {}
    figure = (f"loads {data['delivered_read_gbps']:.2f} GB/s, saves {data.get('delivered_write_gbps') or 0:.2f} "
              f"GB/s; the drive {probe.get('read_gbps', 0):.2f} / {probe.get('write_gbps', 0):.2f} GB/s "
              "(probe, O_DIRECT)")
    return [VerdictLine(FIGURE, name, figure, f"{name}; run.json")]


def tier_limits(run: dict) -> list[VerdictLine]:
    return [VerdictLine(outcome, what, figure, tier_limit_table.SECTION)
            for outcome, what, figure in tier_limit_table.verdict_lines(run)]


def close_calls_left(run: dict) -> list[VerdictLine]:
    calls = (run.get("benchmarks") or {}).get(CLOSE_CALLS) or {}
    left = calls.get("left") or []
    if not left:
        return []
    return [VerdictLine(UNDECIDED, "close calls", f"{len(left)} left to the grid's p50s (past the run's cap)",
                        "side by side, close calls")]


def verdict_lines(run: dict) -> list[VerdictLine]:
    lines: list[VerdictLine] = []
    for part in (source_checks, output_checks, tier_targets, close_calls_left, tier_limits, admission, ab, equal_engines,
                 replay_lines, fits, disk_speed):
        lines.extend(part(run))
    return lines


def replay_lines(run: dict) -> list[VerdictLine]:
    """The replay's offload column per backend, as the suite judged it (its text is kept per backend)."""
    data = (run.get("benchmarks") or {}).get("trace replay") or {}
    lines = []
    for name, verdict in sorted((data.get("offload") or {}).items()):
        outcome = (FIGURE if verdict.startswith("offload played no part") else
                   UNDECIDED if verdict.startswith("undecided") or "too few" in verdict else
                   MISSED if ": cost you" in verdict else MET)  # a caveat may follow (suite_machinery/trace_replay.py)
        lines.append(VerdictLine(outcome, f"replay {name} against {roles.baseline(run) or 'recompute'}", verdict,
                                 "trace replay"))
    return lines


def render_block(run: dict) -> str:
    lines = verdict_lines(run)
    if not lines:
        return ""
    counts = {o: sum(1 for line in lines if line.outcome == o) for o in (MET, MISSED, UNDECIDED)}
    head = (f"verdicts of run {run.get('run_id')}: {counts[MISSED]} missed, {counts[UNDECIDED]} undecided, "
            f"{counts[MET]} met (detail in the sections named in brackets; every figure in run.json)")
    return "\n".join([head, *(line.text() for line in lines), ""])


__all__ = ["FIGURE", "VerdictLine", "render_block", "verdict_lines"]


"""The table of `kvoffload timeline FILE`: one row per request, its phases in milliseconds
(analysis/request_phases.py), and one row per kind of request (cold, engine hit, tier hit) with the median of
each phase."""

from __future__ import annotations

import statistics

from tabulate import tabulate

from pytest_kvoffload.analysis.request_phases import RequestPhases

PHASES = ("queued", "waiting for the worker", "reading", "reporting", "rescheduling", "gathering saves",
          "computing", "between its steps")


def kind_of(p: RequestPhases) -> str:
    """A tier hit loaded tokens; an engine hit computed fewer than its prompt (the engine had the rest)."""
    if p.loaded_tokens:
        return f"tier hit, {p.loaded_tokens / p.prompt:.0%} loaded"
    return "cold" if p.computed_tokens >= p.prompt else f"engine hit, {1 - p.computed_tokens / p.prompt:.0%} cached"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def _row(label: str, prompt, group: list[RequestPhases]) -> list:
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None
    rates = median(p.read_gbps for p in group)
    return [label, prompt, len(group), *(_ms(median(p.phases.get(name) for p in group)) for name in PHASES),
            _ms(median(p.total for p in group)), "" if rates is None else f"{rates:.2f}"]


HEADERS = ["request", "prompt", "n", *PHASES, "total", "read GB/s"]


def timeline_table(found: list[RequestPhases], per_request: bool = True) -> str:
    """Per request (when asked), then per kind and prompt length the medians; ms."""
    rows = [_row(p.req[-12:], p.prompt, [p]) for p in found] if per_request else []
    groups: dict[tuple[str, int], list[RequestPhases]] = {}
    for p in found:
        groups.setdefault((kind_of(p), p.prompt), []).append(p)
    order = sorted(groups.items(), key=lambda g: (g[0][1], g[0][0]))
    medians = [_row(kind, prompt, group) for (kind, prompt), group in order]
    parts = []
    if rows:
        parts.append(tabulate(rows, HEADERS, disable_numparse=True))
    parts.append(tabulate(medians, ["median of", *HEADERS[1:]], disable_numparse=True))
    return "\n\n".join(parts)

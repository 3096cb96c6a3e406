"""PNG plots of a run, drawn from its record alone (matplotlib, the [plots] extra)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pytest_kvoffload.core.cell_state import State

STATE_STYLE = {State.COLD.value: ("o-", "cold (recompute)"), State.ENGINE_HIT.value: ("s--", "engine-cache hit"),
               State.TIER_HIT.value: ("^:", "tier hit")}


def _figure():
    """A figure and its axes, or None without matplotlib (the [plots] extra). A Figure of its own, not
    pyplot: drawing must not switch the backend of the process that imports us."""
    try:
        from matplotlib import rcParams
        from matplotlib.figure import Figure
    except ImportError:
        return None
    figure = Figure(figsize=(8, 5), dpi=120)
    return figure, figure.subplots(), rcParams["axes.prop_cycle"].by_key()["color"]


def _finish(fig, ax, path: Path, ylabel: str, title: str, log_y: bool = True) -> Path:
    """Shared decoration: prompt length on a log2 axis, grid, legend, saved as PNG."""
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _model(run: dict) -> str:
    return (run.get("options") or {}).get("model", {}).get("name", "")


def plot_ttft_by_length(run: dict, path: Path) -> Path | None:
    """TTFT p50 against prompt length per backend: cold, and each hit state at the largest fraction."""
    cells = run.get("cells") or []
    drawing = _figure()
    if drawing is None or not cells:
        return None
    fig, ax, palette = drawing
    series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    top = max((c["fraction"] for c in cells if c["state"] != State.COLD.value), default=0.0)
    for c in cells:
        if c["state"] == State.COLD.value or c["fraction"] == top:
            series[(c["backend"], c["state"])].append((c["length"], c["ttft"]["p50"] * 1000))
    backends = sorted({b for b, _ in series})
    colors = dict(zip(backends, palette))
    for (backend, state), points in sorted(series.items()):
        points.sort()
        style, label = STATE_STYLE.get(state, ("x-", state))
        ax.plot([p[0] for p in points], [p[1] for p in points], style, color=colors[backend],
                label=f"{backend}: {label}")
    return _finish(fig, ax, path, "TTFT p50 (ms)",
                   f"TTFT by prompt length, {_model(run)}; hits with {top:.0%} of the prompt cached")


def plot_break_even_bandwidth(run: dict, path: Path) -> Path | None:
    """The break-even picture, from measured data: the bandwidth a tier needs at each length (falling
    with length), against the bandwidth each tier delivered (a horizontal line). Where the line is above
    the curve, loading beats recomputing."""
    tiers = {b: e["tier"] for b, e in (run.get("analysis") or {}).items() if e.get("tier")}
    drawing = _figure() if tiers else None
    if drawing is None:
        return None
    fig, ax, colors = drawing
    for color, (backend, tier) in zip(colors, sorted(tiers.items())):
        points = sorted((int(n), g) for n, g in tier["break_even_gbps"].items() if g is not None)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=color,
                    label=f"{backend}: break-even bandwidth (fully cached prompt)")
        interval = tier.get("bandwidth_interval_gbps")
        if tier.get("bandwidth_gbps") and tier.get("resolved", True):
            ax.axhline(tier["bandwidth_gbps"], color=color, linestyle="--",
                       label=f"{backend}: measured {tier['bandwidth_gbps']:.3g} GB/s effective"
                       + (f" (95%: {interval[0]:.3g} to {interval[1]:.3g})" if interval and interval[1] else ""))
            if interval and interval[1]:
                ax.axhspan(interval[0], interval[1], color=color, alpha=0.12)
        elif interval and interval[0]:
            # Unresolved: only a lower bound is known; a dotted line at it, not a measurement.
            ax.axhline(interval[0], color=color, linestyle=":",
                       label=f"{backend}: bandwidth unresolved, at least {interval[0]:.3g} GB/s")
    return _finish(fig, ax, path, "bandwidth (GB/s)",
                   f"Break-even bandwidth vs measured tier bandwidth, {_model(run)}")


def plot_frontier(run: dict, path: Path) -> Path | None:
    """Length x cached fraction: where a tier hit beat recompute (filled) or not (open), and the fitted
    frontier p*/L above which hits pay."""
    cells = run.get("cells") or []
    analysis = run.get("analysis") or {}
    tiers = sorted(b for b, e in analysis.items() if e.get("tier"))
    drawing = _figure() if tiers else None
    if drawing is None:
        return None
    fig, ax, colors = drawing
    for color, backend in zip(colors, tiers):
        cold = {c["length"]: c["ttft"]["p50"] for c in cells if c["backend"] == backend and c["state"] == State.COLD.value}
        hits = [c for c in cells if c["backend"] == backend and c["state"] == State.TIER_HIT.value and c["length"] in cold]
        won = [(c["length"], c["fraction"]) for c in hits if c["ttft"]["p50"] < cold[c["length"]]]
        lost = [(c["length"], c["fraction"]) for c in hits if c["ttft"]["p50"] >= cold[c["length"]]]
        if won:
            ax.scatter(*zip(*won), color=color, marker="o", s=60, label=f"{backend}: hit faster than recompute")
        if lost:
            ax.scatter(*zip(*lost), facecolors="none", edgecolors=color, marker="o", s=60,
                       label=f"{backend}: hit slower than recompute")
        p_star = analysis[backend]["tier"].get("break_even_prefix_tokens")
        lengths = sorted(cold)
        if p_star and lengths:
            xs = [n for n in lengths if p_star <= n]
            if xs:
                ax.plot(xs, [p_star / n for n in xs], "x-", color=color, markersize=9,
                        label=f"{backend}: fitted frontier, prefix >= {p_star:,.0f} tokens")
    ax.set_ylim(0, 1.05)
    return _finish(fig, ax, path, "cached fraction of the prompt", f"Where a tier hit pays, {_model(run)}",
                   log_y=False)


def write_all(run: dict, folder: Path) -> list[Path]:
    made = [plot_ttft_by_length(run, folder / "ttft_by_length.png"),
            plot_break_even_bandwidth(run, folder / "break_even_bandwidth.png"),
            plot_frontier(run, folder / "frontier.png")]
    return [p for p in made if p is not None]

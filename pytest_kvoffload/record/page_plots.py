"""The pictures of report.html, as inline PNG (base64): small multiples with shared axes and the legend below
the panels, one idea per figure. Drawn from run.json alone; None where the run has nothing to draw or
matplotlib (the [plots] extra) is missing."""

from __future__ import annotations

import base64
import io
from collections import defaultdict

from pytest_kvoffload.core.cell_state import State

STATES = [(State.COLD.value, "cold (recompute)", "o-"), (State.ENGINE_HIT.value, "engine-cache hit", "s--"),
          (State.TIER_HIT.value, "tier hit", "^-")]
DPI = 100


def _figure(panels: int, width: float = 11.0, height: float = 2.8):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    columns = min(panels, 3)
    rows = -(-panels // columns)
    figure = Figure(figsize=(width, height * rows + 0.6), dpi=DPI)
    axes = figure.subplots(rows, columns, sharex=True, sharey=True, squeeze=False)
    return figure, [ax for row in axes for ax in row]


def _png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _legend_below(figure, axes) -> None:
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    if handles:
        figure.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False, fontsize=9)


def _length_ticks(axes, lengths) -> None:
    """The grid's lengths on the x axis, plain numbers on the log y axis."""
    from matplotlib.ticker import LogFormatter, NullLocator
    for ax in axes:
        ax.set_xticks(sorted(lengths), [f"{n:,}" for n in sorted(lengths)])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 1)))


def ttft_panels(run: dict) -> str | None:
    """One panel per backend: TTFT p50 against prompt length, one line per state (hits at the largest
    cached fraction), shared log axes."""
    cells = [c for c in run.get("cells") or [] if "[" not in c["backend"] and "~" not in c["backend"]]
    backends = sorted({c["backend"] for c in cells})
    drawing = _figure(len(backends)) if backends else None
    if drawing is None:
        return None
    figure, axes = drawing
    top = max((c["fraction"] for c in cells if c["state"] != State.COLD.value), default=1.0)
    for ax, backend in zip(axes, backends):
        series = defaultdict(list)
        for c in cells:
            if c["backend"] == backend and (c["state"] == State.COLD.value or c["fraction"] == top):
                series[c["state"]].append((c["length"], c["ttft"]["p50"] * 1e3))
        for state, label, style in STATES:
            points = sorted(series.get(state, []))
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label, markersize=4)
        ax.set_title(backend, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[len(backends):]:
        ax.set_visible(False)
    _length_ticks(axes, {c["length"] for c in cells})
    for ax in axes[::3]:
        ax.set_ylabel("TTFT p50 (ms)")
    for ax in axes[-3:]:
        ax.set_xlabel("prompt length (tokens)")
    _legend_below(figure, axes)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    return _png(figure)


def break_even_panels(run: dict) -> str | None:
    """One panel per tier: the bandwidth a load needs to pay at each length (the break-even curve), the
    tier's measured bandwidth with its 95% interval (band), and the drive's probed read rate."""
    tiers = {b: e["tier"] for b, e in sorted((run.get("analysis") or {}).items())
             if e.get("tier") and "[" not in b and "~" not in b}
    drawing = _figure(len(tiers)) if tiers else None
    if drawing is None:
        return None
    figure, axes = drawing
    drive = ((run.get("environment") or {}).get("drive") or {}).get("read_gbps")
    for ax, (backend, tier) in zip(axes, tiers.items()):
        points = sorted((int(n), g) for n, g in tier["break_even_gbps"].items() if g is not None)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="break-even bandwidth")
        low, high = (tier.get("bandwidth_interval_gbps") or [None, None])[:2]
        if tier.get("bandwidth_gbps") and tier.get("resolved"):
            ax.axhline(tier["bandwidth_gbps"], color="tab:green", label="tier's measured bandwidth")
            if high:
                ax.axhspan(low, high, color="tab:green", alpha=0.15, label="its 95% interval")
        elif low:
            ax.axhline(low, color="tab:green", linestyle=":", label="tier's bandwidth, at least (unresolved)")
        if drive:
            ax.axhline(drive, color="tab:gray", linestyle="--", label="drive's probed read rate")
        ax.set_title(backend, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[len(tiers):]:
        ax.set_visible(False)
    _length_ticks(axes, {int(n) for t in tiers.values() for n in t["break_even_gbps"]})
    for ax in axes[::3]:
        ax.set_ylabel("GB/s")
    for ax in axes[-3:]:
        ax.set_xlabel("prompt length (tokens)")
    _legend_below(figure, axes)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    return _png(figure)


def admission_panels(run: dict) -> str | None:
    """The admission frontier: per round, the control's and the guarded server's hit/cold ratio against the
    prefix as a multiple of p*, one panel each; filled where the rule admitted the load."""
    data = (run.get("benchmarks") or {}).get("admission") or {}
    cells = data.get("frontier") or []
    drawing = _figure(2, height=3.2) if cells else None
    if drawing is None:
        return None
    figure, axes = drawing
    for ax, field, title in ((axes[0], "control_ratio", "control (every load taken)"),
                             (axes[1], "guarded_ratio", f"guarded (rule {data.get('mode')})")):
        for admitted, marker, label in ((True, "o", "the rule admitted the load"), (False, "x", "the rule declined it")):
            xs = [c["multiple"] for c in cells for d in c["decisions"] if d["admitted"] == admitted]
            ys = [d[field] for c in cells for d in c["decisions"] if d["admitted"] == admitted]
            if xs:
                ax.scatter(xs, ys, marker=marker, label=label, s=24)
        ax.axhline(1.0, color="tab:gray", linewidth=1, label="recompute (ratio 1)")
        ax.axvline(1.0, color="tab:red", linestyle=":", linewidth=1, label="p* (multiple 1)")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("prefix / p*")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("tier hit / cold TTFT")
    _legend_below(figure, axes)
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    return _png(figure)

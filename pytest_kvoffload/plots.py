"""PNG plots of a run, drawn from its record alone (matplotlib, the [plots] extra)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

STATE_STYLE = {"cold": ("o-", "cold (recompute)"), "engine-hit": ("s--", "engine-cache hit"),
               "tier-hit": ("^:", "tier hit")}


def ttft_by_length(run: dict, path: Path) -> Path | None:
    """TTFT p50 against prompt length per backend: cold, and each hit state at the largest fraction."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells = run.get("cells") or []
    if not cells:
        return None
    series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    top = max((c["fraction"] for c in cells if c["state"] != "cold"), default=0.0)
    for c in cells:
        if c["state"] == "cold" or c["fraction"] == top:
            series[(c["backend"], c["state"])].append((c["length"], c["ttft"]["p50"] * 1000))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    backends = sorted({b for b, _ in series})
    colors = dict(zip(backends, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (backend, state), points in sorted(series.items()):
        points.sort()
        style, label = STATE_STYLE.get(state, ("x-", state))
        ax.plot([p[0] for p in points], [p[1] for p in points], style, color=colors[backend],
                label=f"{backend}: {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT p50 (ms)")
    model = (run.get("options") or {}).get("model", {}).get("name", "")
    ax.set_title(f"TTFT by prompt length, {model}; hits with {top:g} of the prompt cached")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

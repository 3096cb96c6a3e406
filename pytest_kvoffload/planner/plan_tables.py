"""`kvoffload plan`'s output: the tables a person reads and the capacity-curve PNG (planner/simulate.py computes)."""

from __future__ import annotations

import math
from pathlib import Path

from tabulate import tabulate

from pytest_kvoffload.planner.simulate import TIERS, Profile, above_break_even, break_even_prefix_tokens, summarize
from pytest_kvoffload.planner.simulate import BASELINE


def _pct(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:.1f}%"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def config_table(result: dict) -> str:
    configs = result["configs"]
    baseline = configs[BASELINE]
    rows = []
    for name, served in configs.items():
        s = summarize(served, baseline)
        tier_req = ", ".join(f"{t} {_pct(s['tier_requests'][t])}" for t in TIERS if s["tier_requests"][t]) or "-"
        tier_tok = ", ".join(f"{t} {_pct(s['tier_tokens'][t])}" for t in TIERS if s["tier_tokens"][t]) or "-"
        rows.append([name, _pct(s["engine_requests"]), tier_req, _pct(s["engine_tokens"]), tier_tok,
                     _pct(s["paying_share"]) if name != BASELINE else "-",
                     _ms(s["ttft"][50]), _ms(s["ttft"][90]), _ms(s["ttft"][99]), _ms(s["mean_ttft"]),
                     f"{s['vs_gpu_only']:.3f}x"])
    return tabulate(rows, headers=["configuration", "engine hits (req)", "tier hits (req)", "engine tokens",
                                   "tier tokens", "tier finds that pay", "TTFT p50 ms", "p90 ms", "p99 ms",
                                   "mean ms", f"mean vs {BASELINE}"], disable_numparse=True)


def break_even_table(result: dict, profile: Profile) -> str:
    baseline = result["configs"][BASELINE]
    rows = []
    for tier in (t for t in TIERS if t in profile.tiers):
        p_star = break_even_prefix_tokens(profile, tier)
        share = above_break_even(baseline, p_star)
        rows.append([tier, "never pays" if math.isinf(p_star) else f"{p_star:,.0f}", _pct(share["requests"]),
                     _pct(share["tokens"])])
    return tabulate(rows, headers=["tier", "break-even prefix (tokens)", "requests whose reusable prefix is above",
                                   "their share of prompt tokens"], disable_numparse=True)


def curve_rows(result: dict, profile: Profile, block_size: int) -> list[list]:
    rows = []
    baseline = result["configs"][BASELINE]
    base_mean = sum(s.ttft_s for s in baseline) / len(baseline)
    prompt_tokens = sum(s.prompt for s in baseline)
    for tier, runs in result["curve"].items():
        for fraction, served in zip(result["curve_fractions"], runs):
            capacity = profile.tiers[tier].capacity_bytes * fraction
            tokens = sum(s.loaded.get(tier, 0) for s in served)
            mean = sum(s.ttft_s for s in served) / len(served)
            rows.append([tier, capacity, tokens / prompt_tokens, 1 - mean / base_mean])
    return rows


def curve_table(rows: list[list]) -> str:
    return tabulate([[t, f"{c / 1e9:,.3g} GB", _pct(share), _pct(gain)] for t, c, share, gain in rows],
                    headers=["tier", "capacity", "prompt tokens served by the tier", f"mean TTFT gain vs {BASELINE}"],
                    disable_numparse=True)


def write_curve_png(rows: list[list], path: Path, title: str) -> bool:
    """The capacity curve as a PNG; False when matplotlib is not installed (the `plots` extra)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    figure = Figure(figsize=(9, 3.6))
    served_axes, gain_axes = figure.subplots(1, 2)
    for tier in sorted({r[0] for r in rows}):
        points = [(c / 1e9, share * 100, gain * 100) for t, c, share, gain in rows if t == tier]
        served_axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=tier)
        gain_axes.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=tier)
    for axes, label in ((served_axes, "prompt tokens served by the tier, %"), (gain_axes, f"mean TTFT gain vs {BASELINE}, %")):
        axes.set_xscale("log")
        axes.set_xlabel("tier capacity, GB")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return True

"""Per-cell statistics of the raw measurements."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

CELL_KEYS = ("backend", "length", "fraction", "state")


def summarize(values: list[float]) -> dict:
    a = np.asarray(values, dtype=float)
    p50 = float(np.percentile(a, 50))
    q1, q3 = (float(x) for x in np.percentile(a, [25, 75]))
    return {
        "n": int(a.size),
        "p50": p50,
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
        # Relative spread: half the inter-quartile range over the median (0 for a single round).
        "spread": (q3 - q1) / 2 / p50 if p50 > 0 else 0.0,
    }


def excluded(measurements: list[dict]) -> list[dict]:
    """Measured requests that failed verification (wrong source, wrong output): kept out of every cell."""
    return [m for m in measurements if m.get("purpose", "measure") == "measure" and m.get("verified") is False]


def cell_table(measurements: list[dict]) -> list[dict]:
    """One row per (backend, length, fraction, state): TTFT statistics and where the hits came from.

    Only verified requests count: a hit that came from the wrong place, or answered differently from a
    recompute, must not feed a fit, a calibration or a comparison (see `excluded`)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for m in measurements:
        if m.get("purpose", "measure") != "measure" or m.get("verified") is False:
            continue
        groups[tuple(m[k] for k in CELL_KEYS)].append(m)
    rows = []
    for key, ms in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3])):
        sources: dict[str, int] = defaultdict(int)
        for m in ms:
            for s, n in (m.get("cached_by_source") or {}).items():
                sources[s] += n
        row = dict(zip(CELL_KEYS, key))
        row["ttft"] = summarize([m["client_ttft_s"] for m in ms])
        server = [m["server_ttft_s"] for m in ms if m.get("server_ttft_s") is not None]
        row["server_ttft"] = summarize(server) if server else None
        row["prompt_tokens"] = ms[0]["prompt_tokens"]
        row["cached_tokens_mean"] = sum(sum((m.get("cached_by_source") or {}).values()) for m in ms) / len(ms)
        row["sources"] = {s: n / len(ms) for s, n in sources.items()}
        row["verified"] = all(m.get("verified", True) for m in ms)
        checked = [m for m in ms if m.get("output_checked")]
        row["output_checked"] = bool(checked)
        row["output_matches"] = all(m.get("output_matches") for m in checked) if checked else None
        rows.append(row)
    return rows


def quantile(histogram: dict, q: float) -> float | None:
    """Prometheus's histogram_quantile: linear within the bucket holding the q-th observation; the
    largest finite bound when it falls in +Inf. None for an empty histogram."""
    total = histogram["count"]
    if not total:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    finite = [b for b, _ in histogram["buckets"] if b != float("inf")]
    for bound, cumulative in histogram["buckets"]:
        if cumulative >= rank:
            if bound == float("inf"):
                return finite[-1] if finite else None
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return finite[-1] if finite else None

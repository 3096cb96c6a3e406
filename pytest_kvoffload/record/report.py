"""Tables of a run for people: the terminal summary and `kvoffload report`."""

from __future__ import annotations

import math
from collections import defaultdict

from tabulate import tabulate

from pytest_kvoffload.record.disk_speed_summary import disk_speed_text, is_disk_speed
from pytest_kvoffload.record import roles, tier_limit_table
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.analysis.cell_stats import excluded, quantile
from pytest_kvoffload.analysis.tier_target import (TARGET_RATIO, allowance_s, bound_s, enough_tokens, of_bound_text,
                                               tier_tokens)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def _sources(sources: dict[str, float]) -> str:
    shown = {s: n for s, n in sources.items() if n}
    return ", ".join(f"{s} {n:,.0f}" for s, n in sorted(shown.items())) or "none"


def ttft_rows(cells: list[dict]) -> dict[str, list[list]]:
    """Per backend: one row per (length, fraction) with cold, engine-hit and tier-hit TTFT."""
    by_backend: dict[str, dict] = defaultdict(lambda: defaultdict(dict))
    for c in cells:
        by_backend[c["backend"]][c["length"]][(c["fraction"], c["state"])] = c
    tables = {}
    for backend, lengths in by_backend.items():
        rows = []
        for length in sorted(lengths):
            entries = lengths[length]
            cold = entries.get((0.0, State.COLD.value))
            cold_ms = cold["ttft"]["p50"] if cold else None
            fractions = sorted({f for f, s in entries if s != State.COLD.value}) or [None]
            for f in fractions:
                eng = entries.get((f, State.ENGINE_HIT.value))
                tier = entries.get((f, State.TIER_HIT.value))
                row = [length, "-" if f is None else f"{f:g}", _ms(cold_ms)]
                for hit in (eng, tier):
                    if hit is None:
                        row += ["-", "-", "-"]
                        continue
                    p50 = hit["ttft"]["p50"]
                    speedup = f"{cold_ms / p50:.2f}x" if cold_ms and p50 else "-"
                    flag = "" if hit.get("verified", True) else " !"
                    row += [f"{_ms(p50)} ±{hit['ttft']['spread'] * 100:.0f}%{flag}", speedup, _sources(hit["sources"])]
                rows.append(row)
        tables[backend] = rows
    return tables


HEADERS = ["length", "cached", "cold ms", "engine-hit ms", "speed-up", "engine source",
           "tier-hit ms", "speed-up", "tier source"]


def render(run: dict) -> str:
    lines = []
    checks = (run.get("options") or {}).get("output_checks") or ""
    if checks.startswith("blind"):
        lines += [f"output checks {checks}: every output_matches below is true whatever KV was loaded", ""]
    tables = ttft_rows(run.get("cells") or [])
    for name, entry in (run.get("backends") or {}).items():
        status = entry.get("status", "?")
        if status == "selected" and name not in tables:
            continue  # chosen but never reached by any test in this session
        if status == "skipped" or name not in tables:
            reason = entry.get("reason") or ("no cells measured" if status != "skipped" else "")
            lines.append(f"{name}: {status}" + (f" ({reason})" if reason else ""))
            continue
        lines.append(f"{name}: TTFT p50 ±spread, cached tokens by source (mean per request)")
        if entry.get("platform_note"):
            lines.append(f"({entry['platform_note']})")
        lines.append(tabulate(tables[name], headers=HEADERS, tablefmt="simple", disable_numparse=True))
        if any(m.get("backend") == name and m.get("verified_by") == "scheduler only"
               for m in run.get("measurements") or []):
            lines.append("(tier hits proven by vLLM's scheduler only: its per-source counter moves when the "
                         "scheduler accepts the tokens, even if the load fails; this connector reports no loads)")
        decisions = admission_decisions(run.get("measurements") or [], name)
        if decisions:
            lines.append(decisions)
        lines.append("")
    lines.extend(side_by_side_lines(run))
    lines.extend(tier_limit_table.table_lines(run))
    lines.extend(break_even_lines(run.get("analysis") or {},
                                  ((run.get("environment") or {}).get("drive") or {}).get("read_gbps")))
    lines.extend(transfer_lines(run.get("backends") or {}))
    lines.extend(client_server_lines(run.get("cells") or []))
    lines.extend(tier_io_lines(run.get("backends") or {}, run.get("measurements") or []))
    dropped = excluded(run.get("measurements") or [])
    if dropped:
        lines.append(f"excluded from every cell, fit and calibration: {len(dropped)} unverified requests")
        lines.extend(f"  {m['backend']} {m['length']} tokens, {m['fraction']:g} cached, {m['state']}, round {m['round']}: "
                     f"{m.get('problem')}" for m in dropped[:20])
        lines.append("")
    for name, bench in (run.get("benchmarks") or {}).items():
        lines.append(f"{name}:")
        lines.append(disk_speed_text(bench) if is_disk_speed(name) else bench.get("text", ""))
        lines.append("")
    status = run.get("status")
    lines.append(f"run {run.get('run_id')}: {status}")
    return "\n".join(lines)


# The connector's histograms (connector/counters.py) as the report shows them: (name, label, scale, unit).
TRANSFERS = (("kvoffload:load_duration_seconds", "load time", 1e3, "ms"),
             ("kvoffload:load_size_bytes", "load size", 1e-6, "MB"),
             ("kvoffload:save_duration_seconds", "save time (per step)", 1e3, "ms"),
             ("kvoffload:save_size_bytes", "save size (per step)", 1e-6, "MB"))


# Where the interleaved rounds that settle the table's close calls keep their figures (suite_machinery/ttft.py).
CLOSE_CALLS = "side by side, close calls"


def side_by_side_rows(run: dict, ours: str | None = None) -> list[dict]:
    """Our connector against every other user-facing tier backend of the run on the same tier-hit cells:
    the p50 ratio, the cached tokens of each, and each one's end-to-end rate in MB/s (bytes from the tier
    over the tier hit's TTFT), and the target's verdict. A cell whose target the grid's rounds could not tell
    (a close call) is judged by the interleaved rounds that settled it, where the run has them."""
    ours = ours or roles.ours(run)
    if ours is None:
        return []
    cells = run.get("cells") or []
    backends = run.get("backends") or {}
    key = {(c["backend"], c["length"], c["fraction"], c["state"]): c for c in cells}
    calls = (run.get("benchmarks") or {}).get(CLOSE_CALLS) or {}
    settled = {(s["other"], s["length"], s["fraction"]): s for s in calls.get("cells", [])}
    left = {(c["other"], c["length"], c["fraction"]) for c in calls.get("left", [])}
    kv = ((run.get("options") or {}).get("model") or {}).get("kv_bytes_per_token")
    drive = ((run.get("environment") or {}).get("drive") or {}).get("read_gbps")

    def rate(c):
        tokens = tier_tokens(c)
        seconds = c["ttft"]["p50"]
        return f"{tokens * kv / seconds / 1e6:,.0f}" if tokens and kv and seconds > 0 else "-"

    others = sorted({c["backend"] for c in cells if c["state"] == State.TIER_HIT.value and c["backend"] != ours
                     and backends.get(c["backend"], {}).get("user_facing", True) and "[" not in c["backend"]
                     and "~" not in c["backend"]})
    rows = []
    for other in others:
        for (b, length, fraction, state), c in sorted(key.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if b != ours or state != State.TIER_HIT.value or (other, length, fraction, state) not in key:
                continue
            theirs = key[(other, length, fraction, state)]
            ratio = c["ttft"]["p50"] / theirs["ttft"]["p50"] if theirs["ttft"]["p50"] else math.nan
            rows.append({"other": other, "length": length, "cached": f"{fraction:g}", "ours": _ms_rounds(c["ttft"]),
                         "theirs": _ms_rounds(theirs["ttft"]), "ratio": ratio,
                         "tokens": f"{tier_tokens(c):,.0f} vs {tier_tokens(theirs):,.0f}", "ours_rate": rate(c),
                         "theirs_rate": rate(theirs),
                         "target": _target(c, theirs, kv, drive, settled.get((other, length, fraction)),
                                           (other, length, fraction) in left)})
    return rows


def side_by_side_lines(run: dict, ours: str | None = None) -> list[str]:
    """side_by_side_rows as the summary's table."""
    ours = ours or roles.ours(run)
    rows = [[r["other"], r["length"], r["cached"], r["ours"], r["theirs"], f"{r['ratio']:.2f}x", r["tokens"],
             r["ours_rate"], r["theirs_rate"], r["target"]] for r in side_by_side_rows(run, ours)]
    if not rows:
        return []
    drive = ((run.get("environment") or {}).get("drive") or {}).get("read_gbps")
    return [f"{ours} against the other tiers, tier hits on the same cells (ms = p50 and the rounds' fastest to "
            f"slowest; ratio = {ours} / other, p50; MB/s = "
            "tier bytes over the tier hit's TTFT"
            + (f"; this run's drive reads {drive * 1e3:,.0f} MB/s with O_DIRECT from huge-page buffers, as the "
               "connector's (from 4 KiB pages, fio's default, a virtio disk reads several times less: "
               "kvoffload probe disk DIR --fio shows both)" if drive else "")
            + f"; target: at most {TARGET_RATIO:g}x another disk tier, and at most {TARGET_RATIO:g}x a DRAM tier "
            "plus the prefix's bytes at the drive's read rate, with at least their cached tokens; "
            "paired: a close call the grid's rounds could not decide, judged by interleaved rounds, the median over "
            "rounds of ours over that round's bound)",
            tabulate(rows, headers=["other", "length", "cached", f"{ours} ms", "other ms", "ratio",
                                    "tier tokens, ours vs theirs", f"{ours} MB/s", "other MB/s", "target"],
                     disable_numparse=True), ""]


def _ms_rounds(ttft: dict) -> str:
    """A cell's p50 in ms and, where the cell kept them, its fastest and slowest rounds: a miss by less than
    the rounds' spread reads differently from one by more."""
    if ttft.get("min") is None or ttft.get("max") is None:
        return _ms(ttft["p50"])
    return f"{_ms(ttft['p50'])} ({_ms(ttft['min'])} to {_ms(ttft['max'])})"


def _target(ours: dict, theirs: dict, kv_bytes_per_token: float | None, drive_gbps: float | None,
            settled: dict | None = None, unsettled: bool = False) -> str:
    """"met (<= X ms)" or "MISSED (<= X ms)" for one cell against another tier, from the grid's p50s or, for a
    close call the run settled, from its interleaved rounds ("met (paired 0.980 of the bound, 5 rounds)"); a
    close call the run left to the grid's p50s says so ("MISSED (<= X ms; a close call, not settled)");
    "-" where no bound applies."""
    allowance = allowance_s(ours, theirs, kv_bytes_per_token, drive_gbps)
    if allowance is None:
        return "-"
    tokens = enough_tokens(ours, theirs)
    if settled is not None:
        # A record from before outcomes has "met" only; too few tokens is a miss whatever the rounds said.
        outcome = settled.get("outcome") or ("met" if settled["met"] else "missed")
        outcome = outcome if tokens else "missed"
        low, high = (settled.get("interval") or [None, None])[:2]
        interval = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
        return (f"{'met' if outcome == 'met' else outcome.upper()} (paired {of_bound_text(settled['median_of_bound'])}"
                f"{interval} of the bound, {len(settled['ratios'])} rounds; grid p50s "
                f"{'met' if _grid_met(ours, theirs, allowance) else 'missed'})")
    bound = bound_s(theirs["ttft"]["p50"], allowance)
    met = tokens and _grid_met(ours, theirs, allowance)
    return f"{'met' if met else 'MISSED'} (<= {_ms(bound)} ms{'; a close call, not settled' if unsettled else ''})"


def _grid_met(ours: dict, theirs: dict, allowance: float) -> bool:
    return ours["ttft"]["p50"] <= bound_s(theirs["ttft"]["p50"], allowance)


# Client minus server TTFT above this is flagged: it is time the engine's own TTFT does not see.
CLIENT_GAP_FLAG_S = 0.005


def client_server_lines(cells: list[dict]) -> list[str]:
    """Per backend: the median over cells of client p50 minus server p50 TTFT, cold and tier hits apart.

    vLLM's server TTFT (per-request metrics, vllm/entrypoints/generate/base/serving.py) runs from the
    request's SCHEDULED event to its first token. It leaves out the HTTP path and tokenising, the queue,
    and, for a connector that loads asynchronously (kvoffload-disk, vLLM's OffloadingConnector), the wait
    for the KV: such a request is marked scheduled only once its load finished (v1/core/sched/scheduler.py).
    So a tier hit's gap beyond the cold one is the tier's load, not the client.
    """
    gaps: dict[str, dict[str, list[float]]] = {}
    for c in cells:
        server = c.get("server_ttft") or {}
        if server.get("p50") is None or not c.get("ttft"):
            continue
        gaps.setdefault(c["backend"], {}).setdefault(c["state"], []).append(c["ttft"]["p50"] - server["p50"])
    if not gaps:
        return []
    lines = ["client minus server TTFT, median over cells (server TTFT starts when vLLM schedules the request: "
             "it leaves out HTTP, the queue and an asynchronous KV load)"]
    for backend, by_state in gaps.items():
        median = {state: sorted(v)[len(v) // 2] for state, v in by_state.items()}
        parts = [f"{state} {ms * 1e3:.1f} ms" for state, ms in median.items()]
        overall = sorted(g for v in by_state.values() for g in v)
        flag = f"  FLAG: above {CLIENT_GAP_FLAG_S * 1e3:.0f} ms" if overall[len(overall) // 2] > CLIENT_GAP_FLAG_S else ""
        line = f"  {backend}: {', '.join(parts)}{flag}"
        if "tier-hit" in median and "cold" in median and median["tier-hit"] - median["cold"] > CLIENT_GAP_FLAG_S:
            line += (f"; tier hits {(median['tier-hit'] - median['cold']) * 1e3:.1f} ms more than cold: the tier's "
                     "asynchronous load, in the client's TTFT and not the server's")
        lines.append(line)
    return lines + [""]


def tier_io_lines(backends: dict, measurements: list[dict]) -> list[str]:
    """Per disk backend: whether its tier reads with O_DIRECT, and for a buffered one what the page cache
    held when its tier-only rounds began (Recorder.before_tier_read, from the session)."""
    lines = []
    for name, entry in backends.items():
        io = entry.get("tier_io")
        if not io:
            continue
        if io["mode"] == "O_DIRECT":
            lines.append(f"{name}: disk tier reads with O_DIRECT ({', '.join(io['folders'])}): no page cache in front")
            continue
        rounds = [m["tier_page_cache"] for m in measurements if m.get("backend") == name and m.get("tier_page_cache")]
        after = sorted(r["after"]["resident_bytes"] for r in rounds)
        held = f"{after[len(after) // 2] / 1e6:.1f} MB resident (median of {len(after)} rounds)" if after else "no rounds"
        if io.get("page_cache") == "warm":
            lines.append(f"{name}: FLAG: buffered disk tier with --kv-page-cache=warm: tier hits served from memory "
                         f"({held} when they began)")
        else:
            lines.append(f"{name}: buffered disk tier: its files dropped from the page cache before every tier-only "
                         f"round; {held} when the hit began")
    return lines + ([""] if lines else [])


def transfer_lines(backends: dict) -> list[str]:
    """Per backend with connector histograms: count, p50/p90/p99 (interpolated within buckets, as
    Prometheus's histogram_quantile does) and the mean of each load and save figure."""
    lines = []
    for name, entry in backends.items():
        found = entry.get("histograms") or {}
        rows = []
        for metric, label, scale, unit in TRANSFERS:
            h = found.get(metric)
            if not h or not h["count"]:
                continue
            rows.append([f"{label}, {unit}", f"{h['count']:,.0f}"]
                        + [f"{quantile(h, q) * scale:,.2f}" for q in (0.5, 0.9, 0.99)]
                        + [f"{h['sum'] / h['count'] * scale:,.2f}"])
        if rows:
            lines.append(f"{name}: loads and saves over the run (connector histograms on /metrics)")
            lines.append(tabulate(rows, headers=["figure", "count", "p50", "p90", "p99", "mean"],
                                  disable_numparse=True))
            lines.append("")
    return lines


def _gbps(value) -> str:
    return "never pays" if value is None else f"{value:.3f}"


# A disk tier read faster than this times the O_DIRECT probe of its folder's drive is flagged: a page
# cache in front of it, or a slope fitted from noise (native-disk once printed 71 GB/s beside a 1.4 GB/s drive).
DRIVE_FLAG_RATIO = 1.5


def _pays(p_star, at_most: bool = False) -> str:
    if p_star is None:
        return "never pays within 4M tokens"
    if p_star <= 1:
        return "pays at any prefix length"
    return f"pays from {'at most ' if at_most else ''}a {p_star:,.0f}-token prefix"


def _enforced(tier: dict) -> str:
    """The prefix the connector's rule takes loads from (margin included), where the analysis has it."""
    if "enforced_break_even_prefix_tokens" not in tier:
        return ""
    p = tier["enforced_break_even_prefix_tokens"]
    at = "no prefix within 4M tokens" if p is None else "any prefix" if p <= 1 else f"a {p:,.0f}-token prefix"
    return f"; the admission rule takes loads from {at} (its {tier.get('margin', 0):.0%} margin)"


def tier_line(backend: str, tier: dict, drive_read_gbps: float | None = None) -> str:
    """One tier's fitted figures with their interval, or 'unresolved' and the break-even as a bound."""
    bw = tier["bandwidth_gbps"]
    fixed = f"fixed {tier['fixed_s'] * 1e3:.1f} ms"
    fixed_iv = tier.get("fixed_interval_s")
    if fixed_iv and fixed_iv[0] is not None and fixed_iv[1] is not None:
        fixed += f" (95%: {max(0.0, fixed_iv[0]) * 1e3:.1f} to {fixed_iv[1] * 1e3:.1f})"
    head = f"{backend} break-even ({tier['source']} tier): "
    if "resolved" not in tier:  # a record from before intervals were kept
        return (head + f"measured {'>' if bw is None else ''}{'resolution' if bw is None else f'{bw:.3f} GB/s'} "
                f"effective, {fixed}; " + _pays(tier["break_even_prefix_tokens"]))
    low, high = tier["bandwidth_interval_gbps"]
    loads = tier.get("load_mb")
    sizes = f"loads of {loads[0]:.2g} to {loads[1]:.2g} MB" if loads else "its loads"
    if tier["resolved"]:
        line = (head + f"measured {bw:.3f} GB/s effective (95%: {low:.3g} to {high:.3g}), {fixed}; "
                + _pays(tier["break_even_prefix_tokens"]) + _enforced(tier))
    else:
        fitted = f"{bw:.3g} GB/s fitted, but " if bw is not None else ""
        bound = f"at least {low:.3g} GB/s" if low else "no bound"
        line = (head + f"bandwidth unresolved ({fitted}{sizes} take too little time to tell from the rounds' "
                f"noise: {bound}), {fixed}; " + _pays(tier.get("break_even_prefix_at_most_tokens"), at_most=True)
                + _enforced(tier))
    figure = bw if bw is not None else low
    if tier["source"] == "disk" and drive_read_gbps and figure and figure > DRIVE_FLAG_RATIO * drive_read_gbps:
        line += (f"; FLAG: {figure / drive_read_gbps:.1f}x the O_DIRECT read of this run's drive "
                 f"({drive_read_gbps:.2f} GB/s): a page cache in front of the tier, or a fit of noise")
    return line


def break_even_lines(analysis: dict, drive_read_gbps: float | None = None) -> list[str]:
    """Per tier: measured bandwidth and fixed cost with their intervals, break-even prefix, break-even
    bandwidth by length; a disk tier faster than the run's drive is flagged."""
    lines = []
    for backend, entry in analysis.items():
        tier = entry.get("tier")
        if not tier:
            continue
        bw = tier["bandwidth_gbps"]
        lines.append(tier_line(backend, tier, drive_read_gbps))
        first_order = tier.get("first_order") or {}
        rows = [[length, _gbps(need), _gbps(first_order["gbps"][length]) if length in first_order.get("gbps", {}) else "-",
                 "yes" if (bw is None or (need is not None and bw >= need)) else "no",
                 "-" if tier["frontier"].get(length) is None else f"{tier['frontier'][length]:.2f}"]
                for length, need in tier["break_even_gbps"].items()]
        lines.append(tabulate(rows, headers=["length", "break-even GB/s", "first-order GB/s", "tier pays",
                                             "smallest paying fraction"], disable_numparse=True))
        if first_order:
            lines.append(f"(first-order: prefill FLOPs over peak times MFU, no fixed costs, at the {first_order['tflops']:.3g} TFLOP/s "
                         f"this run's cold {first_order['from_tokens']:,}-token prefill achieved)")
        lines.append("")
    return lines


def admission_decisions(measurements: list[dict], backend: str) -> str | None:
    """One line on the connector's admission rule for a backend, when it made any decisions."""
    totals = {"admitted": 0.0, "declined": 0.0, "tokens": 0.0, "queued": 0.0}
    for m in measurements:
        if m.get("backend") != backend:
            continue
        c = m.get("connector") or {}
        totals["admitted"] += c.get("kvoffload:loads_admitted_total", 0.0)
        totals["declined"] += c.get("kvoffload:loads_declined_total", 0.0)
        totals["tokens"] += c.get("kvoffload:tokens_declined_total", 0.0)
        totals["queued"] += c.get("kvoffload:loads_admitted_queued_total", 0.0)
    if not totals["admitted"] and not totals["declined"]:
        return None
    queued = f" ({totals['queued']:.0f} of them only because the request queued anyway)" if totals["queued"] else ""
    return (f"admission: {totals['admitted']:.0f} loads admitted{queued}, {totals['declined']:.0f} declined "
            f"({totals['tokens']:,.0f} tokens recomputed instead)")

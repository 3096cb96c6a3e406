"""`kvoffload plan TRACE`: arguments checked first (a bad one is one line and nothing is written), then
planner/simulate.py simulates and planner/plan_tables.py prints the tables and draws the capacity curve."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pytest_kvoffload.core.calibration import CalibrationError, read_calibration
from pytest_kvoffload.core.models import ModelError, load_model
from pytest_kvoffload.planner.simulate import PlanError, Profile, calibration_profile, first_order_profile, parse_engine, parse_tier, simulate, summarize
from pytest_kvoffload.traces.prefix_trees import SLICE_DRAWS, reuse_share, slice_by_tree, slice_gap
from pytest_kvoffload.planner.plan_tables import (break_even_table, config_table, curve_rows, curve_table, write_curve_png)
from pytest_kvoffload.core.whole_files import atomic_write_json
from pytest_kvoffload.traces.read import FORMATS, Scaling, TraceError, read_trace, select
from pytest_kvoffload.planner.simulate import BASELINE

H100_PEAK_TFLOPS = 989.0


def build_profile(args, model) -> Profile:
    kv_bytes = model.kv_bytes_per_token(args.kv_dtype_bytes)
    tiers = [parse_tier(text) for text in args.tier]
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise PlanError(f"--tier: {', '.join(names)}: each tier at most once")
    if args.calibration:
        if args.peak_tflops is not None:
            raise PlanError("--peak-tflops and --calibration: choose one profile")
        calibration = read_calibration(args.calibration)
        if args.engine_kv is None:
            raise PlanError("--engine-kv: required with --calibration (the file does not record the engine's capacity)")
        engine = parse_engine(args.engine_kv, int(calibration["fingerprint"]["kv_bytes_per_token"]))
        return calibration_profile(calibration, tiers, engine)
    if args.engine_kv is not None:
        engine = parse_engine(args.engine_kv, kv_bytes)
    else:
        weights = model.parameter_count() * 2
        engine = args.gpu_memory_gib * 2**30 * 0.9 - weights
        if engine <= 0:
            raise PlanError(f"--gpu-memory-gib {args.gpu_memory_gib:g}: the weights ({weights / 2**30:.1f} GiB) "
                            "leave no room for KV; give --engine-kv or more memory")
    return first_order_profile(model, args.peak_tflops or H100_PEAK_TFLOPS, args.mfu, tiers, engine, kv_bytes)


def run_plan(args) -> int:
    started = time.monotonic()
    try:
        model = load_model(args.model)
        trace = read_trace(args.trace, args.format)
        scaling = Scaling(tokens_per_block=args.tokens_per_block, limit=args.limit)
        whole = select(trace, Scaling(tokens_per_block=args.tokens_per_block))
        requests = select(trace, scaling)
        if args.slice:
            requests = slice_by_tree(requests, args.slice, args.slice_seed)
        profile = build_profile(args, model)
        block = args.block_size or scaling.tokens_per_block or FORMATS[trace.format]["block_tokens"]
        if args.curve_points < 0 or args.curve_points > 12:
            raise PlanError(f"--curve-points {args.curve_points}: expected 0 to 12")
        result = simulate(requests, trace.format, scaling, profile, block, admission=not args.no_admission,
                          curve_points=args.curve_points if profile.tiers else 0)
    except (ModelError, TraceError, PlanError, CalibrationError) as exc:
        print(f"kvoffload plan: {str(exc).replace('--kv-model', '--model')}", file=sys.stderr)
        return 2
    print(f"trace {trace.path} ({trace.format}): {len(requests):,} of {len(whole):,} requests; "
          f"{scaling.describe(trace.format)}; {block} tokens a block")
    reuse = {"reuse_share": reuse_share(requests), "trace_reuse_share": reuse_share(whole)}
    print(f"reuse: {reuse['reuse_share']:.1%} of this selection's trace blocks were seen before in it; "
          f"{reuse['trace_reuse_share']:.1%} in the whole trace"
          + (f"; the slice: the closest to that of {SLICE_DRAWS} seeded draws of whole prefix trees" if args.slice else ""))
    gap = slice_gap(requests, whole) if args.slice else None
    if gap:
        print(f"slice: {gap}")
    print(f"model {model.name}: {profile.kv_bytes_per_token:,} KV bytes/token; profile {profile.source}; engine KV "
          f"{profile.engine_bytes / 2**30:,.1f} GiB ({result['sizes'].engine:,} blocks)")
    for tier in profile.tiers.values():
        print(f"tier {tier.describe()}")
    print("TTFT is service time (no queueing); a tier load is taken only where it beats recompute"
          if not args.no_admission else "TTFT is service time (no queueing); every tier hit is loaded (--no-admission)")
    print()
    print(config_table(result))
    if profile.tiers:
        print()
        print(break_even_table(result, profile))
    rows = curve_rows(result, profile, block) if result["curve"] else []
    out = Path(args.out) if args.out else Path("results") / f"plan-{trace.path.stem}-{model.name}"
    if rows:
        print()
        print(curve_table(rows))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plan.json", plan_record(args, trace, requests, whole, reuse, profile, result, rows))
    drawn = rows and write_curve_png(rows, out / "capacity.png",
                                     f"{model.name}, {trace.path.name}: {profile.source}")
    print(f"\nwrote {out / 'plan.json'}" + (f" and {out / 'capacity.png'}" if drawn else
                                             " (no PNG: no tier, or matplotlib missing)")
          + f" in {time.monotonic() - started:.1f} s")
    return 0


def plan_record(args, trace, requests, whole, reuse: dict, profile: Profile, result: dict, rows: list) -> dict:
    baseline = result["configs"][BASELINE]
    return {
        "schema": "pytest-kvoffload/plan", "schema_version": 1,
        "trace": str(trace.path), "format": trace.format, "requests": len(requests), "trace_requests": len(whole),
        **reuse,
        "model": args.model, "profile": profile.source, "engine_bytes": profile.engine_bytes,
        "tiers": {name: {"bandwidth_bps": None if t.bandwidth_bps == float("inf") else t.bandwidth_bps,
                         "capacity_bytes": t.capacity_bytes, "fixed_s": t.fixed_s} for name, t in profile.tiers.items()},
        "configurations": {name: summarize(served, baseline) for name, served in result["configs"].items()},
        "capacity_curve": [{"tier": t, "capacity_bytes": c, "tier_token_share": s, "mean_ttft_gain": g}
                           for t, c, s, g in rows],
        "requests_detail": {name: [{"engine": s.engine, "loaded": s.loaded, "ttft_s": s.ttft_s} for s in served]
                            for name, served in result["configs"].items()},
    }

"""`kvoffload`: estimate, probe, report, timeline and compare as thin wrappers over the package's modules."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tabulate import tabulate


def _estimate(args) -> int:
    from pytest_kvoffload.core.first_order import estimate
    from pytest_kvoffload.core.models import ModelError, load_model

    try:
        model = load_model(args.model)
    except ModelError as exc:
        print(f"kvoffload estimate: {str(exc).replace('--kv-model', '--model')}", file=sys.stderr)
        return 2
    rows = []
    for tokens in args.tokens:
        e = estimate(model, tokens, args.peak_tflops, args.mfu, args.kv_dtype_bytes, args.params)
        rows.append([f"{tokens:,}", f"{e.prefill_s * 1000:,.1f}", f"{e.kv_bytes / 1e9:.3f}", f"{e.required_gbps:.2f}"])
    print(f"{model.name}: {model.kv_bytes_per_token(args.kv_dtype_bytes):,} KV bytes/token, "
          f"{(args.params or model.parameter_count()) / 1e9:.2f} B parameters, "
          f"{args.peak_tflops:g} TFLOP/s x {args.mfu:g} MFU (first-order, no fixed overhead)")
    print(tabulate(rows, headers=["tokens", "prefill ms", "KV GB", "break-even GB/s"], disable_numparse=True))
    return 0


def _probe(args) -> int:
    from pytest_kvoffload.drive.fio import FioError
    from pytest_kvoffload.drive.probe import probe_disk, probe_disk_bursts, probe_store

    try:
        result = probe_disk(args.path, args.request_mib << 20, args.size_mib << 20, args.repeats, args.threads)
        store = (probe_store(args.path, result.request_bytes, result.total_bytes, args.repeats, result.threads)
                 if args.store else None)
        bursts = (probe_disk_bursts(args.path, result.request_bytes, args.bursts, args.gap_ms / 1e3,
                                    min(result.total_bytes, 32 << 20), args.repeats, result.threads,
                                    read_burst=args.bursts) if args.bursts else None)
    except (NotADirectoryError, OSError) as exc:
        print(f"kvoffload probe disk: {exc}", file=sys.stderr)
        return 2
    fio = None
    if args.fio:
        try:
            fio = _fio_pairs(args, result)
        except (FioError, OSError) as exc:
            print(f"kvoffload probe disk --fio: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({**result.to_dict(), **({"fio": {k: v.to_dict() if hasattr(v, "to_dict") else v
                                                          for k, v in fio.items()}} if fio else {}),
                          **({"store": store.to_dict()} if store else {}),
                          **({"bursts": bursts.to_dict()} if bursts else {})}))
        return 0
    print(f"{result.path}: {result.describe()}; {result.total_bytes >> 20} MiB fresh file per pass, "
          f"median (min to max) of {args.repeats} passes")
    if fio:
        _print_fio_pairs(result, fio)
    if store:
        print(f"the connector's store alone (a chunk file per request, header, checksum, rename): "
              f"read {store.read_gbps:.2f} GB/s, write {store.write_gbps:.2f} GB/s; store / probe: "
              f"read {store.read_gbps / result.read_gbps:.2f}, write {store.write_gbps / result.write_gbps:.2f}")
    if bursts:
        print(f"in bursts (as the connector saves a step's chunks and loads a prompt's): {bursts.describe()}; "
              f"bursts / continuous: read {bursts.read_gbps / result.read_gbps:.2f}, write "
              f"{bursts.write_gbps / result.write_gbps:.2f}, over it {bursts.overwrite_gbps / result.overwrite_gbps:.2f}")
    return 0


def _read_run(path: str) -> dict:
    """A recorded run, each backend with its role (a run recorded before roles gets the built-in backends')."""
    from pytest_kvoffload.record.roles import with_roles
    from pytest_kvoffload.record.run_record import read_run
    from pytest_kvoffload.serve.builtin import builtin_backends

    return with_roles(read_run(path), {b.name: b.role for b in builtin_backends()})


def _report(args) -> int:
    from pytest_kvoffload.record.run_record import RecordError
    from pytest_kvoffload.record.summary_text import summary_text

    try:
        run = _read_run(args.run)
    except RecordError as exc:
        print(f"kvoffload report: {exc}", file=sys.stderr)
        return 2
    print(summary_text(run))
    return 0


def _timeline(args) -> int:
    from pytest_kvoffload.analysis.request_phases import TimelineError, events_from_lines, request_phases
    from pytest_kvoffload.record.timeline_table import timeline_table

    try:
        with open(args.file, encoding="utf-8") as f:
            found = request_phases(events_from_lines(f, args.file))
    except OSError as exc:
        print(f"kvoffload timeline: {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except TimelineError as exc:
        print(f"kvoffload timeline: {exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError:
        print(f"kvoffload timeline: {args.file} is not text (a timeline is JSON lines)", file=sys.stderr)
        return 2
    if not found:
        print(f"kvoffload timeline: {args.file}: no request computed its prompt in it (was the connector's "
              f"timeline option on while requests ran?)", file=sys.stderr)
        return 2
    print(timeline_table(found, per_request=args.requests))
    return 0


def _fio_pairs(args, result) -> dict:
    """fio beside the probe for each buffer kind: 4 KiB pages always (fio's default, the probe run again so),
    huge pages (the probe's own figure) where a hugetlbfs mount has room, else the reason."""
    from pytest_kvoffload.drive.fio import run_fio
    from pytest_kvoffload.drive.page_segments import hugetlbfs_with_room, why_no_huge_fio
    from pytest_kvoffload.drive.probe import probe_disk

    pairs = {"small_pages_probe": probe_disk(args.path, result.request_bytes, result.total_bytes, args.repeats,
                                             result.threads, huge_pages=False),
             "small_pages": run_fio(args.path, result.request_bytes, result.total_bytes, args.repeats, result.threads)}
    mount = hugetlbfs_with_room(result.request_bytes * result.threads)
    if mount:
        pairs["huge_pages"] = run_fio(args.path, result.request_bytes, result.total_bytes, args.repeats,
                                      result.threads, huge_dir=mount)
    else:
        pairs["huge_pages_unchecked"] = why_no_huge_fio(args.path, result.request_bytes)
    return pairs


def _print_fio_pairs(result, fio: dict) -> None:
    def pair(label, probe, ref):
        print(f"{label}: fio read {ref.read.describe()}, write {ref.write.describe()}; probe read "
              f"{probe.read.describe()}, write {probe.write.describe()}; probe / fio: read "
              f"{probe.read_gbps / ref.read_gbps:.2f}, write {probe.write_gbps / ref.write_gbps:.2f}")
    pair("4 KiB-page buffers (fio's default)", fio["small_pages_probe"], fio["small_pages"])
    if "huge_pages" in fio:
        pair("huge-page buffers (the connector's)", result, fio["huge_pages"])
        print(f"fio's read pass: {fio['huge_pages'].command}")
    else:
        print(f"huge-page buffers (the connector's, the figure above): {fio['huge_pages_unchecked']}")
        print(f"fio's read pass: {fio['small_pages'].command}")


def _compare_pair(label: str, base: dict, new: dict, limits: dict, allow_missing: bool) -> tuple[list[str], int, object]:
    """Print one comparison's verdicts; return what fails the gate, one line each, how many are undecided, and
    the comparison (analysis/run_gate.Comparison)."""
    from pytest_kvoffload.analysis.run_gate import compare, missing_backends, same_rounds
    from pytest_kvoffload.core.tolerances import GATE_P90_ROUNDS

    result = compare(base, new, limits["p50"], limits["p90"])
    print(f"{label}: base {base.get('run_id')}  new {new.get('run_id')}")
    print(f"per backend and state, median TTFT new/base, bounds each one-sided at 95% on the noise pooled over "
          f"its cells (at most {1 + limits['p50']:.2f}):")
    if same_rounds(base, new):
        print("  the same run on both sides: its rounds are the same, so every ratio is exactly 1")
    for group in result.groups:
        print(f"  {group.text()}")
    rows = [["/".join(map(str, key[:1])), key[1], f"{key[2]:g}", key[3], f"{b * 1e3:,.1f}", f"{n * 1e3:,.1f}",
             f"{v.estimate:.3f}", v.interval_text(), v.outcome if v.decided or v.estimate > v.limit
             else "undecided (its group decides)"] for key, v, b, n in result.cells]
    print(f"{len(result.cells)} cell(s):")
    print(tabulate(rows, headers=["backend", "length", "cached", "state", "base ms", "new ms", "new/base",
                                  "interval", "verdict"], disable_numparse=True))
    for key, verdict in result.p90:
        print(f"  p90 {verdict.text()}")
    if result.p90_skipped:
        print(f"p90 not compared for {result.p90_skipped} cell(s): fewer than {GATE_P90_ROUNDS} rounds in a run "
              "(its interval would be the run's slowest round alone)")
    for what, keys in (("only in base", result.only_base), ("only in new", result.only_new)):
        if keys:
            print(f"{what}: " + ", ".join("/".join(str(k) for k in key) for key in keys))
    open_verdicts = result.open()
    if open_verdicts:
        print(f"undecided: {len(open_verdicts)} verdict(s) the noise cannot decide against the limit; rerun with "
              "more rounds to decide them")
    failures = []
    missed = result.failures()
    if missed:
        worst = max(missed, key=lambda v: v.estimate)
        failures.append(f"{label}: {len(missed)} verdict(s) missed (slower than {limits['p50']:.0%}, shown at 95%); "
                        f"worst {worst.what} {worst.estimate:.2f}x {worst.interval_text()}")
    if result.only_base and not allow_missing:
        gone = missing_backends(base, new)
        failures.append(f"{label}: {len(result.only_base)} cell(s) of the base not measured"
                        + (f" (backends {', '.join(gone)} missing)" if gone else "") + "; --allow-missing to accept")
    return failures, len(open_verdicts), result


def _compare(args) -> int:
    from pytest_kvoffload.analysis.run_gate import UNDECIDED_EXIT, CompareError, check_comparable, parse_percent
    from pytest_kvoffload.record.run_record import RecordError

    try:
        limits = {"p50": parse_percent(args.fail_above),
                  "p90": parse_percent(args.fail_above_p90, "--fail-above-p90")}
        base, new = _read_run(args.base), _read_run(args.new)
        check_comparable(base, new, args.force)
        pinned = _read_run(args.baseline) if args.baseline else None
        if pinned is not None:
            check_comparable(pinned, new, args.force)
    except (RecordError, CompareError) as exc:
        print(f"kvoffload compare: {exc}", file=sys.stderr)
        return 2
    failures, open_count, result = _compare_pair("against the previous run", base, new, limits, args.allow_missing)
    if pinned is not None:
        print()
        more, more_open, _ = _compare_pair("against the pinned baseline", pinned, new, limits, args.allow_missing)
        failures, open_count = failures + more, open_count + more_open
    code = 1 if failures else UNDECIDED_EXIT if open_count else 0
    if args.html:
        from pytest_kvoffload.record.html_report import render_compare_page
        try:
            Path(args.html).write_text(render_compare_page(base, new, result, limits["p50"], failures, code))
        except OSError as exc:
            print(f"kvoffload compare: --html {args.html}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"comparison page: {args.html}")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if failures:
        return 1
    if open_count:
        print(f"UNDECIDED: {open_count} verdict(s) could be past the limit within their noise; not a pass: rerun "
              f"with more rounds (exit {UNDECIDED_EXIT})", file=sys.stderr)
        return UNDECIDED_EXIT
    print(f"ok: every backend and state within {limits['p50']:.0%} at 95%, no cell shown slower than it"
          + (", nothing missing" if not args.allow_missing else ""))
    return 0


def _plan(args) -> int:
    from pytest_kvoffload.planner.plan_command import run_plan

    return run_plan(args)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return value


def _compare_arguments(cmp: argparse.ArgumentParser) -> None:
    cmp.add_argument("base")
    cmp.add_argument("new")
    cmp.add_argument("--fail-above", default="10%",
                     help="the slowdown a verdict must be within at 95%% (default 10%%)")
    cmp.add_argument("--fail-above-p90", default="10%",
                     help="the same limit for each cell's p90 (default 10%%)")
    cmp.add_argument("--baseline", default=None,
                     help="a pinned run (e.g. the last release's) checked as well, so slow drift adds up against it")
    cmp.add_argument("--allow-missing", action="store_true",
                     help="pass when cells or backends of the base (or baseline) were not measured")
    cmp.add_argument("--force", action="store_true", help="compare runs of different models or schemas")
    cmp.add_argument("--html", default=None, metavar="OUT",
                     help="also write the comparison as one self-contained page (cells coloured by verdict)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description="KV offload break-even tools")
    sub = parser.add_subparsers(dest="command", required=True)

    est = sub.add_parser("estimate", help="the first-order break-even bandwidth (prefill FLOPs over peak times MFU, no fixed costs)")
    est.add_argument("--model", required=True, help="a shipped model name or a folder with an HF config.json")
    est.add_argument("--tokens", type=_positive_int, nargs="+", required=True, help="prompt lengths")
    est.add_argument("--peak-tflops", type=float, default=989.0, help="dense BF16 peak (default: H100 SXM, 989)")
    est.add_argument("--mfu", type=float, default=0.5, help="achieved share of the peak (default 0.5)")
    est.add_argument("--kv-dtype-bytes", type=int, default=None, help="bytes per KV element (default: the model's dtype)")
    est.add_argument("--params", type=float, default=None, help="parameter count (default: from the config)")
    est.set_defaults(handler=_estimate)

    probe = sub.add_parser("probe", help="raw drive bandwidth")
    probe_sub = probe.add_subparsers(dest="what", required=True)
    disk = probe_sub.add_parser("disk", help="O_DIRECT sequential read and write under PATH")
    disk.add_argument("path")
    disk.add_argument("--request-mib", type=_positive_int, default=4, help="bytes per request, MiB (default 4)")
    disk.add_argument("--size-mib", type=_positive_int, default=256, help="file size, MiB (default 256)")
    disk.add_argument("--repeats", type=_positive_int, default=3, help="passes, each over a fresh file (default 3)")
    disk.add_argument("--threads", type=_positive_int, default=2,
                      help="I/O threads, as the connector's io_threads (default 2)")
    disk.add_argument("--fio", action="store_true",
                      help="also run fio with the same pattern and print the two side by side (needs fio)")
    disk.add_argument("--store", action="store_true",
                      help="also write and read the same bytes as the connector's chunk files (no engine)")
    disk.add_argument("--bursts", type=_positive_int, default=None, metavar="N",
                      help="also move N requests at once, then nothing for --gap-ms, as the connector's steps do")
    disk.add_argument("--gap-ms", type=_positive_int, default=100, help="idle time between bursts, ms (default 100)")
    disk.add_argument("--json", action="store_true")
    disk.set_defaults(handler=_probe)

    report = sub.add_parser("report", help="the tables of a saved run")
    report.add_argument("run", help="a run folder under results/ or its run.json")
    report.set_defaults(handler=_report)

    timeline = sub.add_parser("timeline", help="where each request's time went, from the connector's timeline "
                                               "option's file (docs/connector.md)")
    timeline.add_argument("file", help="the file the connector's timeline option named")
    timeline.add_argument("--requests", action="store_true", help="a row per request too, not only the medians")
    timeline.set_defaults(handler=_timeline)

    cmp = sub.add_parser("compare", help="two runs cell by cell (user-facing backends); exit 1 on a miss, 3 when "
                                         "only undecided verdicts stand in the way")
    _compare_arguments(cmp)
    cmp.set_defaults(handler=_compare)
    plan = sub.add_parser("plan", help="will offload pay on a trace? an offline simulation, no server")
    plan.add_argument("trace", help="a Mooncake or Bailian JSONL trace")
    plan.add_argument("--model", required=True, help="a shipped model name or a folder with an HF config.json")
    plan.add_argument("--format", choices=["mooncake", "bailian"], default=None, help="trace format (default: detected)")
    plan.add_argument("--peak-tflops", type=float, default=None,
                      help="first-order profile: dense BF16 peak (default 989, H100 SXM, without --calibration)")
    plan.add_argument("--mfu", type=float, default=0.5, help="first-order profile: achieved share of the peak")
    plan.add_argument("--calibration", default=None, help="measured profile: a run's calibration.json")
    plan.add_argument("--tier", action="append", default=[],
                      help="NAME=BANDWIDTH:CAPACITY[:LATENCY], NAME host or disk, e.g. disk=6GB/s:1TB; "
                           "BANDWIDTH `cal` takes it from --calibration")
    plan.add_argument("--engine-kv", default=None,
                      help="the engine's KV capacity, a size (40GiB) or tokens (200000); default: 90%% of "
                           "--gpu-memory-gib less the weights (first-order only)")
    plan.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU memory for the default --engine-kv")
    plan.add_argument("--kv-dtype-bytes", type=int, default=None, help="bytes per KV element (default: the model's)")
    plan.add_argument("--block-size", type=_positive_int, default=None,
                      help="tokens per cached block (default: one trace block)")
    plan.add_argument("--tokens-per-block", type=_positive_int, default=None,
                      help="tokens per trace block, scaling lengths as the replay does (default: the format's)")
    plan.add_argument("--limit", type=_positive_int, default=None, help="the first N requests")
    plan.add_argument("--slice", type=_positive_int, default=None,
                      help="about N requests taken as whole prefix trees (keeps the trace's reuse)")
    plan.add_argument("--slice-seed", type=int, default=0)
    plan.add_argument("--no-admission", action="store_true", help="load every tier hit, paying or not")
    plan.add_argument("--curve-points", type=int, default=5, help="capacity-curve sizes per tier (0: none)")
    plan.add_argument("--out", default=None, help="folder for plan.json and capacity.png "
                                                  "(default results/plan-<trace>-<model>)")
    plan.set_defaults(handler=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

"""Where a run's chunk reads spend their time, seen from the kernel (block-layer tracepoints; needs root).

Runs a command with tracefs recording every read the block layer queues, issues and completes, then splits
the large reads by who submitted them: the connector's load threads in a server (`kvoffload-load`), the
store's code in the pytest process (a file opened per read: the disk-speed suite's code-alone pass) and raw
requests (no open per read: the drive probes and the reference beside the rounds). For each it prints the
device time (issued to completed) of requests alone and of those beside another read, and the time from the
file's open to its read's submission (a load thread waiting for one of the reads in flight it is allowed).

    sudo .venv/bin/python scripts/trace_reads.py -- .venv/bin/python -m pytest suites/test_disk_speed.py \\
        --kv-backend=kvoffload-disk --kv-cpu-gib=1 -q -p no:cacheprovider

What it found on the 2-core VM is in docs/notes/2026-12-02-close-calls.md ("The reads, seen from the kernel").
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = ("block/block_bio_queue", "block/block_rq_issue", "block/block_rq_complete", "syscalls/sys_exit_openat")
LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[\d+\]\s+\S+\s+([\d.]+):\s+(\w+)[:(\s]\s*(.*)$")
SECTOR = re.compile(r"\(\)\s+(\d+)\s+\+\s+(\d+)")
# A read at least this many 512-byte sectors is a chunk's (metadata and readahead are smaller).
MIN_SECTORS = 1024
# A pytest thread's read this soon after its own open is the store's code (it opens a file per read).
OPEN_TO_READ_S = 0.003


def parse(lines) -> list[dict]:
    """The completed large reads of a trace (tracefs text), each: kind, pid, opened (its thread's last open,
    or None), queued, issued, completed (seconds, the trace clock)."""
    opened: dict[int, float] = {}
    pending: dict[int, dict] = {}
    done = []
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        comm, pid, ts, event, rest = m.group(1).strip(), int(m.group(2)), float(m.group(3)), m.group(4), m.group(5)
        if event == "sys_openat" and rest.startswith("->"):
            opened[pid] = ts
        elif event == "block_bio_queue":
            fields = rest.split()
            if "R" not in fields[1] or "A" in fields[1] or int(fields[4]) < MIN_SECTORS:
                continue
            last_open = opened.get(pid)
            recent = last_open is not None and ts - last_open < OPEN_TO_READ_S
            kind = comm if comm.startswith("kvoffload") else ("store" if recent else "raw")
            pending[int(fields[2])] = {"kind": kind, "pid": pid, "opened": last_open if recent or kind != "raw"
                                       else None, "queued": ts}
        elif event in ("block_rq_issue", "block_rq_complete"):
            s = SECTOR.search(rest)
            read = pending.get(int(s.group(1))) if s else None
            if read is None:
                continue
            if event == "block_rq_issue":
                read["issued"] = ts
            elif "issued" in read:
                read["completed"] = ts
                done.append(pending.pop(int(s.group(1))))
    return done


def beside(reads: list[dict]) -> None:
    """Mark each read with the share of its device time another read was also in flight."""
    ordered = sorted(reads, key=lambda r: r["issued"])
    for i, r in enumerate(ordered):
        overlap = 0.0
        for o in ordered[max(0, i - 8):i + 8]:
            if o is not r:
                overlap += max(0.0, min(r["completed"], o["completed"]) - max(r["issued"], o["issued"]))
        r["beside"] = overlap / max(r["completed"] - r["issued"], 1e-9)


def summary(reads: list[dict]) -> list[str]:
    beside(reads)
    by_kind = defaultdict(list)
    for r in reads:
        by_kind[r["kind"]].append(r)

    def p50(values):
        return f"{statistics.median(values) * 1e3:.3f}" if values else "-"

    lines = ["reads by submitter: count; device ms (p50) alone, beside another read; open to submission ms (p50, p90)"]
    for kind, rows in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        alone = [r["completed"] - r["issued"] for r in rows if r["beside"] < 0.05]
        paired = [r["completed"] - r["issued"] for r in rows if r["beside"] > 0.8]
        waits = sorted(r["queued"] - r["opened"] for r in rows if r["opened"] is not None)
        p90 = f"{waits[int(0.9 * (len(waits) - 1))] * 1e3:.3f}" if waits else "-"
        lines.append(f"  {kind:15s} {len(rows):6d}  alone {p50(alone)} ({len(alone)}), beside {p50(paired)} "
                     f"({len(paired)}); open to submission {p50(waits)}, {p90}")
    return lines


def _write(name: str, value: str) -> None:
    (TRACEFS / name).write_text(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-out", type=Path, help="also keep the raw trace here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to trace after --")
    if not (TRACEFS / "events").is_dir():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False)
    if not (TRACEFS / "events").is_dir():
        print(f"trace_reads: no tracefs at {TRACEFS} (root and a kernel with tracepoints are needed)", file=sys.stderr)
        return 2
    _write("tracing_on", "0")
    _write("trace", "")
    _write("buffer_size_kb", "65536")
    for event in EVENTS:
        _write(f"events/{event}/enable", "1")
    _write("tracing_on", "1")
    try:
        rc = subprocess.run(command).returncode
    finally:
        _write("tracing_on", "0")
        text = (TRACEFS / "trace").read_text()
        for event in EVENTS:
            _write(f"events/{event}/enable", "0")
        _write("trace", "")
    if args.trace_out:
        args.trace_out.write_text(text)
    print("\n".join(summary(parse(text.splitlines()))))
    return rc


if __name__ == "__main__":
    sys.exit(main())

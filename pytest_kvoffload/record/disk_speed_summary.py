"""The disk-speed suite's part of the summary: three lines; its diagnostics stay in run.json."""

from __future__ import annotations

# The disk-speed suite's benchmark name (suites/test_disk_speed.py).
DISK_SPEED = "disk speed"


def is_disk_speed(name: str) -> bool:
    """Whether a benchmark is the disk-speed suite's (runs before 2026-12-06 named it after the backend)."""
    return name == DISK_SPEED or name.endswith("-disk speed")


def disk_speed_of(run: dict) -> tuple[str, dict] | None:
    """The run's disk-speed benchmark, with its name, or None."""
    return next(((n, b) for n, b in (run.get("benchmarks") or {}).items() if is_disk_speed(n)), None)


def disk_speed_text(bench: dict) -> str:
    """The disk-speed suite in three lines: what the connector delivered against the drive, and where the rest is."""
    text = bench.get("text", "").splitlines()
    against = [line for line in text if line.startswith("connector / the drive in the connector's own pattern")]
    probe = bench.get("probe") or {}
    head = (f"the connector loaded {bench['delivered_read_gbps']:.2f} GB/s and saved "
            f"{bench.get('delivered_write_gbps') or 0:.2f} GB/s; the drive (probe, O_DIRECT) reads "
            f"{probe.get('read_gbps', 0):.2f}, writes {probe.get('write_gbps', 0):.2f} GB/s"
            if bench.get("delivered_read_gbps") else (text[0] if text else "-"))
    return "\n".join([head, *against[:1], "(per-chunk waits, scheduler delays, the store alone and the drive in "
                                           f"bursts: run.json, benchmarks[\"{DISK_SPEED}\"])"])

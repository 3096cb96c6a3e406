"""The disk-speed suite's part of the summary: three lines; its diagnostics stay in run.json."""

from __future__ import annotations

# The disk-speed suite's benchmark name (suites/test_disk_speed.py).
DISK_SPEED = "kvoffload-disk speed"


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
                                           "bursts: run.json, benchmarks[\"kvoffload-disk speed\"])"])

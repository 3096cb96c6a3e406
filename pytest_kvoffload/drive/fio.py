"""fio, the reference for drive speed, run with the drive probe's pattern (drive/probe.py) so the two can be put
side by side: synchronous requests of the same size from the same number of threads, O_DIRECT, a fresh
file per pass written (with a final fsync) and then read once, from buffers of the same page size."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pytest_kvoffload.drive.rate import Rate, Rates


class FioError(RuntimeError):
    """fio is missing, failed, or printed something that is not its JSON report."""


@dataclass
class FioResult(Rates):
    write: Rate
    read: Rate
    command: str  # one pass's read command, to rerun by hand


def fio_command(path: Path, request_bytes: int, total_bytes: int, threads: int, write: bool,
                huge_dir: str | None = None) -> list[str]:
    """One fio job group: `threads` jobs, each over its own 1/threads of the file, synchronous requests; with
    `huge_dir` (a hugetlbfs mount) its buffers in huge pages, as the connector's (drive/page_segments.py)."""
    share = max(request_bytes, total_bytes // threads // request_bytes * request_bytes)
    argv = ["fio", "--name=kvoffload-probe", f"--filename={path}", f"--rw={'write' if write else 'read'}",
            f"--bs={request_bytes}", f"--size={share}", f"--numjobs={threads}", f"--offset_increment={share}",
            "--ioengine=psync", "--direct=1", "--group_reporting", "--output-format=json"]
    if huge_dir:
        argv.append(f"--mem=mmaphuge:{Path(huge_dir) / '.kvoffload-fio-buffer'}")
    return argv + (["--end_fsync=1"] if write else [])


def bandwidth_gbps(report: str, write: bool) -> float:
    """GB/s of a --group_reporting JSON report (fio's bw_bytes: bytes per second)."""
    try:
        job = json.loads(report[report.index("{"):])["jobs"][0]
        return float(job["write" if write else "read"]["bw_bytes"]) / 1e9
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise FioError(f"fio printed no JSON report with a bandwidth ({exc.__class__.__name__}: {exc})") from None


def run_fio(folder: str | Path, request_bytes: int, total_bytes: int, repeats: int = 3, threads: int = 1,
            huge_dir: str | None = None) -> FioResult:
    if shutil.which("fio") is None:
        raise FioError("fio is not installed; install it (e.g. apt install fio) to compare the probe with it")
    folder = Path(folder)
    writes, reads, command = [], [], ""
    for n in range(repeats):
        path = folder / f".kvoffload-fio-{n}"
        try:
            for write, out in ((True, writes), (False, reads)):
                argv = fio_command(path, request_bytes, total_bytes, threads, write, huge_dir)
                done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise FioError(f"fio exited with {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}")
                out.append(bandwidth_gbps(done.stdout, write))
                command = " ".join(argv)
        finally:
            path.unlink(missing_ok=True)
    return FioResult(Rate.of(writes), Rate.of(reads), command)

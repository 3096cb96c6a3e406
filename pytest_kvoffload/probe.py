"""Raw sequential bandwidth of the drive under a folder, with the I/O pattern the connector uses.

O_DIRECT, one request per chunk-sized piece, a fresh file: the figure the connector's delivered
bandwidth is compared against (connector / probe, side by side in one run).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .connector.store import aligned_buffer, padded


@dataclass
class ProbeResult:
    path: str
    request_bytes: int
    total_bytes: int
    direct_io: bool
    write_gbps: float
    read_gbps: float

    def to_dict(self) -> dict:
        return asdict(self)


def probe_disk(folder: str | Path, request_bytes: int = 4 << 20, total_bytes: int = 256 << 20,
               repeats: int = 3) -> ProbeResult:
    """Median of `repeats` sequential write and read passes over a temporary file in `folder`.

    The median, not the best: on virtual disks a repeat can be served by the host's cache.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"probe disk: {folder} is not a folder; pass the folder on the drive to measure")
    request_bytes = padded(request_bytes)
    count = max(1, total_bytes // request_bytes)
    buffer = aligned_buffer(request_bytes)
    buffer[:] = 0xA5
    path = folder / f".kvoffload-probe-{os.getpid()}"
    direct = hasattr(os, "O_DIRECT")
    writes: list[float] = []
    reads: list[float] = []
    try:
        for _ in range(repeats):
            flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
            try:
                fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
            except OSError:
                direct = False
                fd = os.open(path, flags, 0o600)
            started = time.perf_counter()
            try:
                for i in range(count):
                    os.pwrite(fd, memoryview(buffer), i * request_bytes)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            writes.append(count * request_bytes / (time.perf_counter() - started) / 1e9)
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            started = time.perf_counter()
            try:
                view = memoryview(buffer)
                for i in range(count):
                    os.preadv(fd, [view], i * request_bytes)
            finally:
                os.close(fd)
            reads.append(count * request_bytes / (time.perf_counter() - started) / 1e9)
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    return ProbeResult(str(folder), request_bytes, count * request_bytes, direct, statistics.median(writes),
                       statistics.median(reads))

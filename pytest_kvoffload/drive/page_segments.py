"""How a request's buffer pages become the drive's requests, and where fio can be given huge pages.

An O_DIRECT request is handed to the device as one segment per physically contiguous run of its buffer; the
block layer splits a request past the queue's max_segments. With 4 KiB pages a 4 MiB request is 1,024
segments; on a virtio disk of 254 segments that is 5 device requests, where a buffer in huge pages (the
connector's, connector/io_memory.py) makes it 1 or 2. On the 2-core VM the drive read 0.8 to 1.5 GB/s from
4 KiB pages and 3.5 to 6 GB/s from huge pages, by the probe and by fio alike (docs/notes/2026-12-06-drive-pages.md):
the drive's figure depends on the buffer, so each figure says which, and fio is the reference for each.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

SMALL_PAGE = 4096
HUGE_PAGE = 2 << 20


@dataclass(frozen=True)
class QueueLimits:
    device: str
    max_segments: int
    max_request_bytes: int  # max_sectors_kb
    max_segment_bytes: int

    def device_requests(self, request_bytes: int, page_bytes: int) -> int:
        """How many device requests one request of `request_bytes` becomes from a buffer of `page_bytes`
        pages (each page its own segment at worst)."""
        segment = min(page_bytes, self.max_segment_bytes)
        per_request = min(self.max_request_bytes, self.max_segments * segment)
        return max(1, math.ceil(request_bytes / per_request))


def queue_limits(folder: str | Path) -> QueueLimits | None:
    """The block queue under `folder` (a partition's disk), or None where there is none (tmpfs, overlay)."""
    try:
        dev = os.stat(folder).st_dev
        base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        queue = base / "queue" if (base / "queue").is_dir() else base.parent / "queue"

        def read(name: str) -> int:
            return int((queue / name).read_text().split()[0])
        return QueueLimits(base.name if (base / "queue").is_dir() else base.parent.name, read("max_segments"),
                           read("max_sectors_kb") * 1024, read("max_segment_size"))
    except (OSError, ValueError):
        return None


def hugetlbfs_with_room(need_bytes: int, mounts: str = "/proc/mounts", meminfo: str = "/proc/meminfo") -> str | None:
    """A hugetlbfs mount whose free huge pages hold `need_bytes`, for fio's --mem=mmaphuge; None otherwise."""
    try:
        found = [line.split()[1] for line in Path(mounts).read_text().splitlines() if line.split()[2:3] == ["hugetlbfs"]]
        info = {k.strip(): v.split()[0] for k, v in (line.split(":", 1) for line in Path(meminfo).read_text().splitlines())}
        free = int(info.get("HugePages_Free", 0)) * int(info.get("Hugepagesize", 0)) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return found[0] if found and free >= need_bytes else None


def why_no_huge_fio(folder: str | Path, request_bytes: int) -> str:
    """The line printed beside a huge-page figure that fio could not check."""
    limits = queue_limits(folder)
    split = (f"; on {limits.device} (at most {limits.max_segments} segments a request) a "
             f"{request_bytes / 2**20:g} MiB request is {limits.device_requests(request_bytes, SMALL_PAGE)} device "
             f"request(s) from 4 KiB pages and {limits.device_requests(request_bytes, HUGE_PAGE)} from huge pages"
             if limits else "")
    return ("fio takes huge-page buffers only from a hugetlbfs mount with free huge pages, and there is none here "
            "(as root: sysctl vm.nr_hugepages=8; mount -t hugetlbfs none DIR), so the huge-page figure is checked "
            "against fio only through the probe's own 4 KiB-page pass" + split)

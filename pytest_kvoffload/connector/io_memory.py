"""Memory that chunks are read into and written from with O_DIRECT: aligned, and on huge pages where the
kernel allows.

O_DIRECT moves bytes straight between the drive and the buffer, and the block layer hands the drive one
segment per physically contiguous run of the buffer's memory, at most `max_segments` of them a request
(254 on the 2-core VM's virtio disk). A 1 MiB chunk in ordinary 4 KiB pages is 257 pages: two requests,
one of 254 segments and one of 3, and the drive's time per request grows with its segments. On that VM's
drive (docs/notes/2026-12-02-huge-pages.md, tracefs): a 1,016 KiB request of 254 segments took 0.82 ms at
the device; raw loads of 16 one-MiB chunk files into buffers on 2 MiB pages ran at 2.4 to 2.6 GB/s against
1.5 to 1.6 into 4 KiB pages, and 2-chunk loads in 1.15 ms against 1.79. A transparent huge page is one
physically contiguous 2 MiB run, so a buffer that fits in one is one segment.

Linux lends huge pages to private anonymous memory marked MADV_HUGEPAGE when transparent huge pages are
"always" or "madvise"; where they are "never", or on another system, the same buffer is ordinary pages
and only the speed differs. `on_huge_pages` says which a buffer got.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

ALIGN = 4096
HUGE_PAGE = 2 << 20
# Smaller buffers stay in ordinary pages: a huge page would hold 8 times their size or more, for a request
# of at most 64 segments.
MIN_HUGE = HUGE_PAGE // 8


def padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def aligned_buffer(nbytes: int, huge: bool = True) -> np.ndarray:
    """A zeroed uint8 array whose data pointer and length are multiples of 4 KiB (O_DIRECT's rule); with
    `huge`, from MIN_HUGE bytes up, it starts at a huge page's boundary in memory marked for huge pages, so
    that a buffer of up to 2 MiB is one physically contiguous run where the kernel grants them."""
    size = padded(nbytes)
    if not huge and size >= MIN_HUGE and hasattr(mmap, "MADV_NOHUGEPAGE"):
        # Ordinary pages for sure: numpy marks its own allocations of 4 MiB and more for huge pages.
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_NOHUGEPAGE)
        buffer = np.frombuffer(region, dtype=np.uint8)
        buffer.fill(0)
        return buffer
    if not huge or size < MIN_HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        raw = np.zeros(size + ALIGN, dtype=np.uint8)
        offset = (-raw.ctypes.data) % ALIGN
        return raw[offset:offset + size]
    span = (size + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    # Private: shared anonymous memory is shmem, which follows shmem_enabled ("never" by default) instead.
    # A length Linux 6.7 and later do not align to 2 MiB themselves (they align multiples of it): the start
    # is found below on every kernel alike, where the tests see it.
    region = mmap.mmap(-1, span + HUGE_PAGE + ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, dtype=np.uint8)  # holds `region` for as long as the buffer lives
    offset = (-whole.ctypes.data) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError:
        pass  # a kernel without transparent huge pages: ordinary pages, as above
    buffer = whole[offset:offset + size]
    buffer.fill(0)  # fault the pages in now, not during the first timed read
    return buffer


def on_huge_pages(buffer: np.ndarray) -> bool:
    """Whether the kernel backs the start of `buffer` with a huge page (Linux: /proc/self/smaps)."""
    start = buffer.ctypes.data
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return False
    inside = False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) > 0
    return False


__all__ = ["ALIGN", "HUGE_PAGE", "MIN_HUGE", "aligned_buffer", "on_huge_pages", "padded"]

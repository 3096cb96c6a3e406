"""Raw sequential bandwidth of the drive under a folder, with the I/O pattern the connector uses.

O_DIRECT, chunk-sized requests, the connector's number of I/O threads, a fresh file for every pass: the
figure the connector's delivered bandwidth is compared against (connector / probe, side by side in one run).
"""

from __future__ import annotations

import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pytest_kvoffload.connector.io_memory import ALIGN, aligned_buffer, padded
from pytest_kvoffload.drive.rate import Rate, Rates


@dataclass
class ProbeResult(Rates):
    path: str
    request_bytes: int
    total_bytes: int
    direct_io: bool
    write: Rate
    read: Rate
    threads: int = 1
    # probe_store only: per request and thread, what the scheduler gave the threads (cpu_use.own_thread_times)
    write_on_cpu_ms: float | None = None
    write_waiting_for_cpu_ms: float | None = None
    # probe_disk only: writing again over the file a pass just wrote (blocks already allocated), as the
    # connector does when it recycles a removed chunk's file (store.py); 0 where not measured
    overwrite: Rate = Rate()
    huge_pages: bool = True  # the requests' buffers in huge pages (the connector's) or 4 KiB pages

    def describe(self) -> str:
        over = f"write over it {self.overwrite.describe()}, " if self.overwrite else ""
        return (f"read {self.read.describe()}, write {self.write.describe()}, "
                f"{over}{self.request_bytes / 2**20:.2f} MiB requests, {self.threads} thread(s), "
                f"{'O_DIRECT' if self.direct_io else 'buffered'}, "
                f"{'huge-page' if self.huge_pages else '4 KiB-page'} buffers")


def _open(path: Path, flags: int, direct: bool) -> tuple[int, bool]:
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError:
            pass
    return os.open(path, flags, 0o600), False


def _pass(path: Path, count: int, request_bytes: int, threads: int, direct: bool, write: bool,
          over: bool = False, huge_pages: bool = True) -> tuple[float, bool]:
    """One sequential pass over `path` by `threads` threads, each taking every threads-th request; `over`:
    write over the file as it is (no truncation: its blocks stay allocated); `huge_pages`: the requests'
    buffers in huge pages, as the connector's (drive/page_segments.py says what that changes)."""
    flags = (os.O_WRONLY if over else os.O_CREAT | os.O_WRONLY | os.O_TRUNC) if write else os.O_RDONLY
    fd, direct = _open(path, flags, direct)
    if not write and not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def work(first: int) -> None:
        buffer = aligned_buffer(request_bytes, huge=huge_pages)
        buffer[:] = 0xA5
        view = memoryview(buffer)
        for i in range(first, count, threads):
            if write:
                os.pwrite(fd, view, i * request_bytes)
            else:
                os.preadv(fd, [view], i * request_bytes)

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(work, range(threads)))
        if write:
            os.fdatasync(fd)
    finally:
        os.close(fd)
    return count * request_bytes / (time.perf_counter() - started) / 1e9, direct


def probe_disk(folder: str | Path, request_bytes: int = 4 << 20, total_bytes: int = 256 << 20,
               repeats: int = 3, threads: int = 1, huge_pages: bool = True) -> ProbeResult:
    """Write then read a fresh file per pass, then write over it, `repeats` passes; median, min and max of
    each.

    Never the same file read twice: on virtual disks a file read again is served by the host's cache (a
    probe that re-read one file reported 2.06 GB/s where fio on fresh files measured 0.77 to 0.95).
    Writes are measured both ways because the connector does both: a new chunk file allocates blocks, a
    recycled one (store.py) is written over; on the 2-core VM the second is twice as fast (3.5 against
    1.8 GB/s), so each is the reference for its own share of the connector's writes.
    The connector's pattern: chunk-sized requests, its number of I/O threads, O_DIRECT where allowed, its
    buffers in huge pages (`huge_pages=False`: 4 KiB pages, as fio's and most programs' buffers are).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"probe disk: {folder} is not a folder; pass the folder on the drive to measure")
    request_bytes = padded(request_bytes)
    count = max(1, total_bytes // request_bytes)
    threads = max(1, min(threads, count))
    direct = hasattr(os, "O_DIRECT")
    writes: list[float] = []
    reads: list[float] = []
    overwrites: list[float] = []
    for n in range(repeats):
        path = folder / f".kvoffload-probe-{os.getpid()}-{n}"
        try:
            gbps, direct = _pass(path, count, request_bytes, threads, direct, True, huge_pages=huge_pages)
            writes.append(gbps)
            gbps, direct = _pass(path, count, request_bytes, threads, direct, False, huge_pages=huge_pages)
            reads.append(gbps)
            gbps, direct = _pass(path, count, request_bytes, threads, direct, True, True, huge_pages)
            overwrites.append(gbps)
        finally:
            try:
                path.unlink()
            except OSError:
                pass
    return ProbeResult(str(folder), request_bytes, count * request_bytes, direct, Rate.of(writes), Rate.of(reads),
                       threads, overwrite=Rate.of(overwrites), huge_pages=huge_pages)


def write_reference(probe: ProbeResult | BurstResult, over_share: float) -> float:
    """The drive's write bandwidth for a mix of writes: `over_share` of the bytes written over existing
    files (probe.overwrite_gbps), the rest into new ones (probe.write_gbps); time adds, so the harmonic mix."""
    if not probe.overwrite_gbps or over_share <= 0:
        return probe.write_gbps
    return 1.0 / (over_share / probe.overwrite_gbps + (1.0 - over_share) / probe.write_gbps)


def remove_store(store) -> None:
    """A probe's store gone: its chunk files, the free files it kept, its folder."""
    store.clear()
    store.drop_free()
    try:
        store.root.rmdir()
    except OSError:
        pass


def leave_free(store, count: int) -> None:
    """Write `count` chunk files and remove them: the store keeps them as free files, written over by the
    next saves, as the connector's store does with chunks it removed."""
    import uuid

    buffer = store.new_buffer()
    keys = [uuid.uuid4().hex for _ in range(count)]
    for key in keys:  # all written before any is removed, or each write would take the last one's file
        if not store.write(key, buffer):
            raise OSError(f"probe store: chunk write failed under {store.root}")
    for key in keys:
        store.delete(key)


def probe_store(folder: str | Path, file_bytes: int, total_bytes: int = 256 << 20, repeats: int = 3,
                threads: int = 1, cpus: set[int] | None = None, slice_us: int = 0,
                over_share: float = 0.0) -> ProbeResult:
    """The connector's store alone, no engine: `threads` threads write fresh chunk files of `file_bytes`
    through ChunkStore (header, checksum, temporary name, rename), then read each back once.

    Between the raw probe (probe_disk) and the connector in a running server, it splits the gap in two:
    what one file per chunk costs (store / probe) and what sharing the machine with the engine costs
    (connector / store). `cpus` and `slice_us` place its threads as the connector's run: bound to the
    engine worker's CPUs, with its scheduler slice (connector/sched.py). `over_share`: that share of the
    writes goes over free files (removed chunks' files, as the connector recycles them), the rest into new.
    """
    import uuid

    from pytest_kvoffload.connector.io_threads import request_slice
    from pytest_kvoffload.drive.cpu_use import own_thread_times
    from pytest_kvoffload.connector.chunk_format import HEADER_SIZE, Layout
    from pytest_kvoffload.connector.store import ChunkStore

    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"probe store: {folder} is not a folder; pass the folder on the drive to measure")
    layout = Layout(layers=1, blocks=1, block_bytes=max(ALIGN, padded(file_bytes) - HEADER_SIZE))
    count = max(threads, total_bytes // layout.file_bytes)
    writes: list[float] = []
    reads: list[float] = []
    write_times: list[tuple[float, float]] = []  # per write pass and thread: (on a CPU, waiting for one), s
    direct = True
    for n in range(repeats):
        root = folder / f".kvoffload-store-probe-{os.getpid()}-{n}"
        store = ChunkStore(root, "probe", layout, keep_free=count)
        direct = store.direct_io
        leave_free(store, round(over_share * count))
        keys = [uuid.uuid4().hex for _ in range(count)]

        def run(write: bool) -> float:
            def work(first: int) -> None:
                if cpus:
                    os.sched_setaffinity(0, cpus)  # this thread only
                if slice_us:
                    request_slice(slice_us)
                buffer = store.new_buffer()
                store.payload_view(buffer)[:] = 0xA5
                begun = own_thread_times()
                for key in keys[first::threads]:
                    ok = store.write(key, buffer) if write else store.read(key, buffer)
                    if not ok:
                        raise OSError(f"probe store: chunk {'write' if write else 'read'} failed under {root}")
                ended = own_thread_times()
                if write and begun and ended:
                    write_times.append((ended[0] - begun[0], ended[1] - begun[1]))

            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=threads) as pool:
                list(pool.map(work, range(threads)))
            return count * layout.file_bytes / (time.perf_counter() - started) / 1e9

        try:
            writes.append(run(write=True))
            reads.append(run(write=False))
        finally:
            remove_store(store)
    timed = repeats * count if len(write_times) == repeats * threads else 0
    return ProbeResult(str(folder), layout.file_bytes, count * layout.file_bytes, direct, Rate.of(writes),
                       Rate.of(reads), threads,
                       1e3 * sum(t[0] for t in write_times) / timed if timed else None,
                       1e3 * sum(t[1] for t in write_times) / timed if timed else None)


@dataclass
class BurstResult(Rates):
    """The drive alone in bursts: `burst` chunk-sized requests handed to `threads` threads at once, then
    `gap_s` of nothing, timed as the connector times its saves (bytes over the union of the bursts' walls)."""
    path: str
    request_bytes: int
    burst: int
    gap_s: float
    threads: int
    write: Rate
    # The same bursts written over the file just written (old blocks), and the fresh file read once in
    # bursts of read_burst requests (a load's chunks), or in the loads read_loads lists; read figures 0 where
    # neither is given
    overwrite: Rate = Rate()
    read_burst: int = 0
    read: Rate = Rate()
    read_loads: tuple[int, ...] = ()

    def describe(self) -> str:
        over = f", over it {self.overwrite.describe()}" if self.overwrite else ""
        read = ""
        if self.read_loads:
            read = f"; read {self.read.describe()} in loads of {' and '.join(map(str, self.read_loads))} chunks"
        elif self.read_burst:
            read = f"; read {self.read.describe()} in bursts of {self.read_burst}"
        return (f"write {self.write.describe()}{over} in "
                f"bursts of {self.burst} chunks{read}, {self.gap_s * 1e3:.0f} ms apart, {self.threads} thread(s)")


def in_bursts(items: list, burst: int) -> list[list]:
    return [items[first:first + burst] for first in range(0, len(items), max(1, burst))]


def timed_groups(pool: ThreadPoolExecutor, move, groups: list[list], gap_s: float) -> tuple[float, int]:
    """Hand each group of items to `pool` at once with `gap_s` of nothing after each, as the connector's saves
    arrive a step at a time and its loads a prompt at a time; (the busy seconds, the items moved), timed as
    the connector times its I/O: per group from its hand-over to the end of its last request (`move` returns
    time.perf_counter() at its end)."""
    busy, moved = 0.0, 0
    for group in groups:
        started = time.perf_counter()
        ends = list(pool.map(move, group))
        busy += max(ends) - started
        moved += len(group)
        time.sleep(gap_s)
    return busy, moved


def probe_disk_bursts(folder: str | Path, request_bytes: int, burst: int, gap_s: float, total_bytes: int = 32 << 20,
                      repeats: int = 3, threads: int = 1, read_burst: int = 0,
                      read_loads: tuple[int, ...] = ()) -> BurstResult:
    """The drive alone in the connector's save pattern, none of the store's code: raw requests of a chunk's
    size at consecutive offsets of one file, O_DIRECT where allowed, handed `burst` at a time to `threads`
    threads with `gap_s` of nothing after each, timed as the connector times its saves (timed_groups). Each
    pass writes a fresh file so (new blocks: write_gbps), then, where `read_burst`, reads it once in bursts of
    that many requests (as a load reads a prompt's chunks; read_gbps), or, where `read_loads`, in those loads
    in turn, each the file's last that many requests (a round's loads as the connector made them: the last
    chunk beside an engine hit, then the whole prompt), then writes over it the same way (old blocks:
    overwrite_gbps); write_reference mixes the two writes as it does the continuous probe's. Against the
    continuous probe (probe_disk) this is what the pattern itself costs on the drive; against it the
    connector's figure is what its code and the engine cost."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"probe disk: {folder} is not a folder; pass the folder on the drive to measure")
    request_bytes = padded(request_bytes)
    burst = max(1, burst)
    offsets = [i * request_bytes for i in range(max(1, total_bytes // (burst * request_bytes)) * burst)]
    read_loads = tuple(n for n in read_loads if n > 0)
    reading = ([offsets[-min(n, len(offsets)):] for n in read_loads] if read_loads
               else in_bursts(offsets, read_burst) if read_burst else [])
    direct = hasattr(os, "O_DIRECT")
    # One buffer per thread, made and touched before any timing: the connector's threads reuse theirs.
    buffers: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(threads):
        buffer = aligned_buffer(request_bytes)
        buffer[:] = 0xA5
        buffers.put(buffer)
    fresh: list[float] = []
    over: list[float] = []
    reads: list[float] = []
    ways = [(os.O_CREAT | os.O_WRONLY | os.O_TRUNC, in_bursts(offsets, burst), fresh), (os.O_RDONLY, reading, reads),
            (os.O_WRONLY, in_bursts(offsets, burst), over)]
    for n in range(repeats):
        path = folder / f".kvoffload-burst-disk-{os.getpid()}-{n}"
        try:
            for flags, groups, out in ways:
                if not groups:
                    continue
                fd, direct = _open(path, flags, direct)
                if flags == os.O_RDONLY and not direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

                def move(offset: int) -> float:
                    buffer = buffers.get()
                    try:
                        if flags == os.O_RDONLY:
                            os.preadv(fd, [memoryview(buffer)], offset)
                        else:
                            os.pwrite(fd, memoryview(buffer), offset)
                        return time.perf_counter()
                    finally:
                        buffers.put(buffer)

                try:
                    with ThreadPoolExecutor(max_workers=threads) as pool:
                        busy, moved = timed_groups(pool, move, groups, gap_s)
                finally:
                    os.close(fd)
                out.append(moved * request_bytes / busy / 1e9)
        finally:
            try:
                path.unlink()
            except OSError:
                pass
    return BurstResult(str(folder), request_bytes, burst, gap_s, threads, Rate.of(fresh), Rate.of(over), read_burst,
                       Rate.of(reads), read_loads)

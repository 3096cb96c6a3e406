"""Loads on Linux native AIO (the connector's option load_io=aio, the CPU build's default): one thread keeps
io_threads whole-file reads queued at the drive and checks and scatters each chunk as its read completes.

With threads (load_io=threads, worker.py) a read is issued by a thread that must first get the core and
the GIL, which on the CPU build's one worker core another load thread holds while it scatters a chunk: the
drive sat a read short for that long. Here the next read is queued the moment a completion is seen, before
the chunk that completed is touched. Paired against the threads on the 2-core VM (8-chunk loads bound to
one CPU, 1 MiB chunks): raw drive / ours 0.76 and 0.77 against 0.66 and 0.70 (two runs of 10 passes,
docs/notes/2026-12-03-aio.md). What is left is the drive itself: the host copies each read into the
guest's memory, and a core copying memory beside it (the scatter) slowed raw reads by a fifth.

A load's last read goes alone: it is queued only once the drive has reported every read before it. A drive may
report reads queued together at once (the 2-core VM's virtio disk reports them when its queue empties: two 2
MiB reads queued together, or the second 0.5 ms after the first, were both reported 2.0 ms after the first was
queued, one alone at 1.08 ms; docs/notes/2026-12-04-last-read.md), and then the chunks of the last reads were
all checked and scattered after the drive was done. Alone, the last read is in flight while the chunks before
it are handled, and only its own chunk's work follows the drive.

Reads queued together go to the kernel in one io_submit, and the files of the next reads are opened while the
drive reads those queued, so that once it reports them the next reads reach it in one call, with no open
between them. Paired against the raw drive in the same loads on that VM (medians of six passes, 2 MiB chunks):
loads of two chunks read 0.64 of the drive before these two changes, 0.73 with the last read alone and 0.77
with both; loads of eight 0.75, 0.75 and 0.81. With the tiny model's 1 MiB chunks, whose check and scatter
take half as long, no difference showed (eight passes: 0.68, 0.70 and 0.69 for two
chunks; 0.74, 0.76 and 0.75 for eight).

Linux AIO reads asynchronously only with O_DIRECT (buffered, io_submit reads before it returns: still
correct). `available()` says whether this kernel and machine have it; the worker falls back to threads
where not.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import time
from concurrent.futures import Future

# io_setup, io_destroy, io_getevents, io_submit.
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_PREAD = 0  # IOCB_CMD_PREAD


class _Iocb(ctypes.Structure):
    # struct iocb (linux/aio_abi.h), little-endian: aio_key before aio_rw_flags.
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class ReadRing:
    """A kernel AIO context for up to `depth` reads at once; ctypes releases the GIL in each call."""

    def __init__(self, depth: int) -> None:
        numbers = _SYSCALLS.get(platform.machine()) if platform.system() == "Linux" else None
        if numbers is None:
            raise OSError(0, f"no native AIO on {platform.system()} {platform.machine()}")
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._context = ctypes.c_ulong(0)
        if self._libc.syscall(self._setup, depth, ctypes.byref(self._context)) < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_setup: {os.strerror(code)}")
        self._iocbs = [_Iocb() for _ in range(depth)]
        # io_submit takes an array of iocb pointers: the pointers and the array made once, not on every read.
        self._pointers = [ctypes.pointer(iocb) for iocb in self._iocbs]
        self._queue = (ctypes.POINTER(_Iocb) * depth)()
        self._events = (_Event * depth)()
        self.depth = depth

    def submit(self, reads: list[tuple[int, int, int, int]]) -> int:
        """Queue `reads`, each (tag, fd, address, nbytes): `nbytes` from the start of `fd` into memory at
        `address`, in one io_submit (one call into the kernel, one notice to the drive); a tag (below depth)
        names its read in wait's results and must not be in flight. Returns how many were queued, the
        first that many (the kernel stops at the first it cannot queue); OSError where none was."""
        for n, (tag, fd, address, nbytes) in enumerate(reads):
            iocb = self._iocbs[tag]
            ctypes.memset(ctypes.addressof(iocb), 0, ctypes.sizeof(iocb))
            iocb.data, iocb.opcode, iocb.fildes, iocb.buf, iocb.nbytes = tag, _PREAD, fd, address, nbytes
            self._queue[n] = self._pointers[tag]
        queued = self._libc.syscall(self._submit, self._context, len(reads), self._queue)
        if queued < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return queued

    def wait(self, least: int) -> list[tuple[int, int]]:
        """At least `least` completed reads (0: those already done): (tag, bytes read or -errno)."""
        while True:
            n = self._libc.syscall(self._getevents, self._context, least, self.depth, self._events, None)
            if n >= 0:
                return [(self._events[i].data, self._events[i].res) for i in range(n)]
            if ctypes.get_errno() != 4:  # EINTR: a signal arrived; wait again
                code = ctypes.get_errno()
                raise OSError(code, f"io_getevents: {os.strerror(code)}")

    def close(self) -> None:
        if self._context.value:
            self._libc.syscall(self._destroy, self._context)
            self._context = ctypes.c_ulong(0)


def available() -> bool:
    try:
        ReadRing(1).close()
        return True
    except OSError:
        return False


class AioLoads:
    """Loads, one at a time, with `io_threads` reads queued (a load's last read alone), each chunk checked and
    scattered as it completes. Only one thread may call `load` (worker.py gives it a pool of one thread)."""

    def __init__(self, store, io_threads: int) -> None:
        self.store = store
        self.in_flight = io_threads
        # A buffer per queued read, as many for reads completed together, and the one being scattered.
        self.buffers = [store.new_buffer() for _ in range(2 * io_threads + 1)]
        self.ring = ReadRing(len(self.buffers))

    def load(self, chunks: list, futures: list[Future], use_for, not_before: float = 0.0) -> None:
        """Read `chunks` (ChunkBlocks) and set each one's future to (ok, when it finished), as the worker's
        threads would; `use_for(chunk, buffer, blocks)` is the scatter store.finish_read runs before the
        checksum. Reads of this load start no earlier than `not_before` (read_latency_ms)."""
        delay = not_before - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        waiting = list(enumerate(chunks))  # files not yet opened
        opened: list[tuple[int, object, int, float]] = []  # (index, chunk, fd, seconds the open took): not queued
        free = list(range(len(self.buffers)))
        reading: dict[int, tuple[int, object, int, float]] = {}  # buffer -> (index, chunk, fd, started)
        done: list[tuple[int, int]] = []  # (buffer, bytes read or -errno), in order of completion

        def open_ahead(n: int) -> None:  # the next reads' files open, up to n of them
            while waiting and len(opened) < n:
                index, chunk = waiting.pop(0)
                started = time.perf_counter()
                fd = self.store.open_chunk(chunk.key, self._blocks(chunk))
                if fd is None:
                    futures[index].set_result((False, time.perf_counter()))
                else:
                    opened.append((index, chunk, fd, time.perf_counter() - started))

        def fill() -> None:  # io_threads reads at the drive (read but not yet taken from `done`: not there)
            batch = []
            while free and (at_drive := len(reading) - len(done) + len(batch)) < self.in_flight:
                open_ahead(1)
                if not opened or (len(opened) == 1 and not waiting and at_drive):
                    break  # none left, or the last read, which goes alone (above) once those queued are reported
                index, chunk, fd, open_s = opened.pop(0)
                # A chunk's read time (load_seconds) runs from its open, as if opened when queued: a file opened
                # ahead was opened while the drive read others.
                batch.append((free.pop(), (index, chunk, fd, time.perf_counter() - open_s)))
            if batch:
                self._submit(batch, free, reading, futures)

        try:
            while waiting or opened or reading:
                fill()
                if len(done) < len(reading):
                    if not done:
                        open_ahead(self.in_flight)  # while the drive reads: the next files ready when it reports
                    done.extend(self.ring.wait(0 if done else 1))
                    fill()  # the next reads queued before the chunk that completed is touched
                if not done:
                    continue
                tag, result = done.pop(0)
                index, chunk, fd, started = reading.pop(tag)
                os.close(fd)
                futures[index].set_result(self._finish(chunk, tag, result, started, use_for))
                free.append(tag)
        except BaseException as exc:
            for _, _, fd, _ in [*reading.values(), *opened]:
                os.close(fd)
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, OSError):
                self.close()
                self.ring = ReadRing(len(self.buffers))  # its reads' state is unknown: a fresh context

    def _submit(self, batch: list[tuple[int, tuple]], free: list[int], reading: dict,
                futures: list[Future]) -> None:
        """Queue `batch`, (buffer, (index, chunk, fd, started)) each, in one call; a read the kernel did not
        queue is a counted failure (its blocks are recomputed)."""
        reads = [(tag, fd, self.buffers[tag].ctypes.data,
                  self.store.layout.file_bytes_for(self._blocks(chunk)))
                 for tag, (_, chunk, fd, _) in batch]
        try:
            queued, error = self.ring.submit(reads), None
        except OSError as exc:
            queued, error = 0, exc
        for n, (tag, entry) in enumerate(batch):
            if n < queued:
                reading[tag] = entry
                continue
            index, chunk, fd, _ = entry
            os.close(fd)
            free.append(tag)
            error = error or OSError(errno.EAGAIN, "the kernel queued fewer reads")
            futures[index].set_result((self.store.read_failed(chunk.key, error), time.perf_counter()))

    def _finish(self, chunk, tag: int, result: int, started: float, use_for) -> tuple[bool, float]:
        if result < 0:
            return self.store.read_failed(chunk.key, OSError(-result, os.strerror(-result))), time.perf_counter()
        blocks = self._blocks(chunk)
        buffer = self.buffers[tag]
        ok = self.store.finish_read(chunk.key, buffer, blocks, result, started, used=len(chunk.blocks),
                                    use=use_for(chunk, buffer, blocks))
        return ok, time.perf_counter()

    def _blocks(self, chunk) -> int:
        """The blocks in `chunk`'s file: a whole chunk's unless the file ends in a partial one."""
        return chunk.count or self.store.layout.blocks

    def close(self) -> None:
        self.ring.close()


__all__ = ["AioLoads", "ReadRing", "available"]

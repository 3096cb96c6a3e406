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
it are handled, and only its own chunk's work follows the drive. On that VM, paired against the raw drive in
the same loads (medians of six to eight passes): loads of two 2 MiB chunks went from 0.65 to 0.78 of the
drive, of eight stayed at 0.84 and 0.83; with the tiny model's 1 MiB chunks, whose check and scatter take
about as long as the alone read's wait, no difference showed (two chunks 0.66 and 0.63, eight 0.77 and 0.79).

Linux AIO reads asynchronously only with O_DIRECT (buffered, io_submit reads before it returns: still
correct). `available()` says whether this kernel and machine have it; the worker falls back to threads
where not.
"""

from __future__ import annotations

import ctypes
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
            errno = ctypes.get_errno()
            raise OSError(errno, f"io_setup: {os.strerror(errno)}")
        self._iocbs = [_Iocb() for _ in range(depth)]
        # io_submit takes an array of iocb pointers: one array per tag, made once, not on every read.
        self._pointers = [(ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(iocb)) for iocb in self._iocbs]
        self._events = (_Event * depth)()
        self.depth = depth

    def submit(self, tag: int, fd: int, address: int, nbytes: int) -> None:
        """Queue a read of `nbytes` from the start of `fd` into memory at `address`; `tag` (below depth)
        names it in wait's results and must not be in flight."""
        iocb = self._iocbs[tag]
        ctypes.memset(ctypes.addressof(iocb), 0, ctypes.sizeof(iocb))
        iocb.data, iocb.opcode, iocb.fildes, iocb.buf, iocb.nbytes = tag, _PREAD, fd, address, nbytes
        if self._libc.syscall(self._submit, self._context, 1, self._pointers[tag]) != 1:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))

    def wait(self, least: int) -> list[tuple[int, int]]:
        """At least `least` completed reads (0: those already done): (tag, bytes read or -errno)."""
        while True:
            n = self._libc.syscall(self._getevents, self._context, least, self.depth, self._events, None)
            if n >= 0:
                return [(self._events[i].data, self._events[i].res) for i in range(n)]
            if ctypes.get_errno() != 4:  # EINTR: a signal arrived; wait again
                errno = ctypes.get_errno()
                raise OSError(errno, f"io_getevents: {os.strerror(errno)}")

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
        waiting = list(enumerate(chunks))
        free = list(range(len(self.buffers)))
        reading: dict[int, tuple[int, object, int, float]] = {}  # buffer -> (index, chunk, fd, started)
        done: list[tuple[int, int]] = []  # (buffer, bytes read or -errno), in order of completion
        def fill() -> None:  # io_threads reads at the drive (read but not yet taken from `done`: not there)
            while waiting and free and len(reading) - len(done) < self.in_flight:
                if len(waiting) == 1 and len(reading) > len(done):
                    return  # the last read goes alone (above), once those at the drive are reported
                index, chunk = waiting.pop(0)
                self._submit(index, chunk, free, reading, futures)

        try:
            while waiting or reading:
                fill()
                if len(done) < len(reading):
                    done.extend(self.ring.wait(0 if done else 1))
                    fill()  # the next read queued before the chunk that completed is touched
                if not done:
                    continue
                tag, result = done.pop(0)
                index, chunk, fd, started = reading.pop(tag)
                os.close(fd)
                futures[index].set_result(self._finish(chunk, tag, result, started, use_for))
                free.append(tag)
        except BaseException as exc:
            for tag, (_, _, fd, _) in reading.items():
                os.close(fd)
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, OSError):
                self.close()
                self.ring = ReadRing(len(self.buffers))  # its reads' state is unknown: a fresh context

    def _submit(self, index: int, chunk, free: list[int], reading: dict, futures: list[Future]) -> None:
        blocks = chunk.count or self.store.layout.blocks
        started = time.perf_counter()
        fd = self.store.open_chunk(chunk.key, blocks)
        if fd is None:
            futures[index].set_result((False, time.perf_counter()))
            return
        tag = free.pop()
        try:
            self.ring.submit(tag, fd, self.buffers[tag].ctypes.data, self.store.layout.file_bytes_for(blocks))
        except OSError as exc:
            os.close(fd)
            free.append(tag)
            futures[index].set_result((self.store.read_failed(chunk.key, exc), time.perf_counter()))
            return
        reading[tag] = (index, chunk, fd, started)

    def _finish(self, chunk, tag: int, result: int, started: float, use_for) -> tuple[bool, float]:
        if result < 0:
            return self.store.read_failed(chunk.key, OSError(-result, os.strerror(-result))), time.perf_counter()
        blocks = chunk.count or self.store.layout.blocks
        buffer = self.buffers[tag]
        ok = self.store.finish_read(chunk.key, buffer, blocks, result, started, used=len(chunk.blocks),
                                    use=use_for(chunk, buffer, blocks))
        return ok, time.perf_counter()

    def close(self) -> None:
        self.ring.close()


__all__ = ["AioLoads", "ReadRing", "available"]

"""A short scheduler slice for the connector's I/O threads, and the load threads' read slots (ReadSlots).

An I/O thread runs for microseconds at a time: it starts a read or write, sleeps until the drive is done,
and wakes to hand the chunk on. On vLLM's CPU build it shares its core with the forward (the worker's
threads inherit its OpenMP binding), and Linux's EEVDF scheduler lets a running task finish its slice
(1.4 ms on our 2-core VM) before a woken one gets the core, so each chunk waited up to that long after
its I/O completed. Since Linux 6.12 a thread may ask for a shorter slice (sched_setattr's sched_runtime
for a normal task), and a shorter slice preempts a longer one on wake-up. No privilege is needed and the
thread's share of the CPU does not change: it runs sooner, not more. Where the kernel or platform lacks
this, the call is refused or ignored and nothing else changes.

Measured (docs/notes/2026-11-30-late.md): moving the I/O threads to the core vLLM keeps for its scheduler
instead made every figure worse (that core is held by the engine core's busy-wait).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading

from pytest_kvoffload.connector.counters import Counters

# struct sched_attr, first version (48 bytes): size, policy, flags, nice, priority, runtime, deadline, period.
_ATTR = struct.Struct("<IIQiIQQQ")
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}  # sched_setattr, sched_getattr
SCHED_OTHER = 0
_PR_SET_NAME = 15
# The kernel clamps a normal task's slice to 0.1 to 100 ms.
MIN_SLICE_US, MAX_SLICE_US = 100, 100_000


def _syscalls() -> tuple[int, int] | None:
    if platform.system() != "Linux":
        return None
    return _SYSCALLS.get(platform.machine())


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def current_slice_ns() -> int | None:
    """The calling thread's scheduler slice in ns (sched_getattr), or None where it cannot be read."""
    numbers = _syscalls()
    if numbers is None:
        return None
    buffer = ctypes.create_string_buffer(_ATTR.size)
    if _libc().syscall(numbers[1], 0, buffer, _ATTR.size, 0) != 0:
        return None
    return _ATTR.unpack(buffer.raw)[5]


def name_thread(name: str) -> bool:
    """Give the calling thread a name the kernel shows (top -H, /proc/<pid>/task/<tid>/comm; 15 bytes at most),
    so that an operator, and the suites, can tell the connector's I/O threads from the engine's."""
    if platform.system() != "Linux":
        return False
    return _libc().prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0


def request_slice(us: int) -> bool:
    """Ask for a `us`-microsecond slice for the calling thread only; True if the kernel took it.

    Only for a thread with the normal policy: the call would otherwise replace its policy."""
    numbers = _syscalls()
    if numbers is None or os.sched_getscheduler(0) != SCHED_OTHER:
        return False
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # 0: this thread; the call sets nice too, so keep it
    attr = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, SCHED_OTHER, 0, nice, 0, us * 1000, 0, 0), _ATTR.size)
    if _libc().syscall(numbers[0], 0, attr, 0) != 0:
        return False
    return current_slice_ns() == us * 1000


def on_every_cpu() -> bool:
    """The calling thread alone (its own id) off its inherited binding, onto every CPU the system lets it use;
    False where the system refuses."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        return False
    return True


def start_io_thread(name: str, way: str, cpus: str, slice_us: int, counters: Counters) -> None:
    """Each I/O thread of the connector's worker, as it starts: its name where the kernel shows it (the suites find
    the threads by it), a short slice (its core back as soon as its I/O is done), and its CPUs (`way` "load" or
    "save"; config: load_cpus, save_cpus, io_slice_us)."""
    name_thread(name)
    if slice_us and request_slice(slice_us):
        counters.add("io_threads_short_slice")
    if cpus == "all" and on_every_cpu():
        counters.add(f"{way}_threads_on_all_cpus")


__all__ = ["MIN_SLICE_US", "MAX_SLICE_US", "current_slice_ns", "name_thread", "on_every_cpu", "request_slice",
           "start_io_thread"]


class ReadSlots(threading.Semaphore):
    """At most `value` reads in flight (worker.py: io_threads), and a freed slot handed on at once.

    A Python semaphore is not fair, and the core is the reader's: a load thread leaving its slot went on to
    check and scatter its chunk, then took the slot back for its next read, while the threads waiting for it
    ran only once the leaver blocked in that read. So the leaver yields the core as it leaves: a waiter
    issues its read first. 8-chunk loads by 4 threads on one CPU: 4.4 to 6.4 ms against 5.1 to 7.3 without,
    paired pass by pass (docs/notes/2026-12-02-scatter-first.md)."""

    def __exit__(self, *exc) -> None:
        self.release()
        os.sched_yield()

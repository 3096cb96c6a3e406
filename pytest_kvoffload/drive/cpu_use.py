"""Where the machine's CPU time goes while a suite measures: the server's processes, the whole machine.

A connector's I/O threads live in the engine's worker process; when the engine's own processes keep
every core busy, the drive cannot be the limit of what the connector delivers. On vLLM's CPU build the
worker's threads (the connector's included) are bound to the cores the forward runs on, so the suites
also measure the store alone on those cores (narrowest_affinity).
Linux /proc only; elsewhere sample() returns None and the suites leave these figures out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class CpuSample:
    at: float  # time.monotonic()
    busy_s: float  # CPU seconds the machine spent busy, all cores
    total_s: float  # busy and idle
    processes: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (name, CPU seconds)


def _stat_fields(pid: str) -> tuple[str, list[str]] | None:
    try:
        text = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    # The name sits in parentheses and may hold spaces: split after its closing parenthesis.
    close = text.rfind(")")
    return text[text.find("(") + 1:close], text[close + 2:].split()


def group_members(pgid: int) -> list[int]:
    """The live processes of a process group (a server started in its own group owns all its processes)."""
    members = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parsed = _stat_fields(entry.name)
            if parsed and len(parsed[1]) > 2 and parsed[1][2] == str(pgid):
                members.append(int(entry.name))
    return members


def sample(pgid: int | None) -> CpuSample | None:
    if pgid is None or not (PROC / "stat").exists():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    first = (PROC / "stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in first[:8]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    processes = {}
    for pid in group_members(pgid):
        parsed = _stat_fields(str(pid))
        if parsed:
            name, rest = parsed
            processes[pid] = (name, (int(rest[11]) + int(rest[12])) / tick)  # utime + stime, all threads
    return CpuSample(time.monotonic(), (sum(values) - idle) / tick, sum(values) / tick, processes)


def usage(before: CpuSample, after: CpuSample) -> dict:
    """Cores in use between two samples: the machine's busy share, and each of the group's processes in
    cores (1.0 = one core the whole time), largest first."""
    wall = after.at - before.at
    total = after.total_s - before.total_s
    by_process: dict[str, float] = {}
    for pid, (name, seconds) in after.processes.items():
        if pid in before.processes and wall > 0:
            by_process[name] = by_process.get(name, 0.0) + (seconds - before.processes[pid][1]) / wall
    return {
        "cores": os.cpu_count(),
        "wall_s": wall,
        "machine_busy": (after.busy_s - before.busy_s) / total if total > 0 else None,
        "server_cores": sum(by_process.values()),
        "by_process": dict(sorted(by_process.items(), key=lambda item: -item[1])),
    }


def describe(use: dict) -> str:
    parts = ", ".join(f"{name} {cores:.2f}" for name, cores in list(use["by_process"].items())[:3])
    busy = f"{use['machine_busy']:.0%}" if use["machine_busy"] is not None else "-"
    return (f"the machine's {use['cores']} cores were {busy} busy; the server's processes used "
            f"{use['server_cores']:.2f} cores ({parts})")


@dataclass(frozen=True)
class ThreadTimes:
    """What the scheduler gave a set of threads (/proc/<pid>/task/<tid>/schedstat, summed): time on a CPU,
    and time runnable but waiting for one (run_delay: the core was another task's)."""
    threads: int
    on_cpu_s: float
    waiting_s: float

    def since(self, earlier: "ThreadTimes") -> "ThreadTimes":
        return ThreadTimes(self.threads, self.on_cpu_s - earlier.on_cpu_s, self.waiting_s - earlier.waiting_s)


def thread_times(pgid: int | None, name: str) -> ThreadTimes | None:
    """Scheduler times of the group's threads named `name` (as the kernel shows it), or None where there
    are none or /proc cannot tell. A thread that exits between two samples takes its times with it: the
    connector's I/O threads live as long as the server."""
    if pgid is None:
        return None
    threads, on_cpu, waiting = 0, 0, 0
    for pid in group_members(pgid):
        try:
            tasks = list((PROC / str(pid) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                if (task / "comm").read_text().strip() != name:
                    continue
                ran_ns, waited_ns, _ = (int(v) for v in (task / "schedstat").read_text().split())
            except (OSError, ValueError):
                continue
            threads += 1
            on_cpu += ran_ns
            waiting += waited_ns
    return ThreadTimes(threads, on_cpu / 1e9, waiting / 1e9) if threads else None


def own_thread_times() -> tuple[float, float] | None:
    """The calling thread's (seconds on a CPU, seconds runnable but waiting for one), or None off Linux."""
    try:
        ran_ns, waited_ns, _ = (int(v) for v in (PROC / "thread-self" / "schedstat").read_text().split())
    except (OSError, ValueError):
        return None
    return ran_ns / 1e9, waited_ns / 1e9


def narrowest_affinity(pgid: int | None) -> set[int] | None:
    """The smallest CPU set any of the group's processes is bound to (the CPU build's worker), or None
    where that is every CPU this process may use (nothing bound: a GPU server)."""
    if pgid is None or not hasattr(os, "sched_getaffinity"):
        return None
    mine = os.sched_getaffinity(0)
    narrowest = None
    for pid in group_members(pgid):
        try:
            cpus = os.sched_getaffinity(pid)
        except OSError:
            continue
        if narrowest is None or len(cpus) < len(narrowest):
            narrowest = cpus
    return set(narrowest) if narrowest and narrowest < mine else None


__all__ = ["CpuSample", "ThreadTimes", "group_members", "sample", "usage", "describe", "narrowest_affinity",
           "own_thread_times", "thread_times"]

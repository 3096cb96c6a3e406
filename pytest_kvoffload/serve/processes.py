"""Processes the harness starts: each in its own process group, stopped as a group, and what a stopped
group leaves in /dev/shm removed. vLLM's servers (serve/server.py) and the processes a backend runs beside
them (serve/companion.py, LMCache's multiprocess server) share these."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except OSError:
        return "(no log)"


def die_with_parent() -> None:
    # If pytest itself is killed with SIGKILL no handler runs; the kernel then stops the group's leader.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def unlink_all(paths) -> list[str]:
    """Remove each of `paths`; returns those removed (one already gone is no error)."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _stat(pid) -> list[str]:
    """The fields of /proc/PID/stat after the process's name (state first); [] for a process gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return []
    # The name sits in parentheses and may hold spaces: split after its closing parenthesis.
    return stat[stat.rfind(")") + 2:].split()


def group_members(pgid: int | None = None) -> list[int]:
    """The live (non-zombie) processes of the group, or of the machine where `pgid` is None (from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if len(fields) > 2 and (pgid is None or int(fields[2]) == pgid) and fields[0] != "Z":
                members.append(int(entry))
    return members


def group_has_live_members(pgid: int) -> bool:
    """Whether any non-zombie process still belongs to the group (read from /proc)."""
    return bool(group_members(pgid))


SHM = "/dev/shm/"


def shared_memory_files(pgid: int | None = None) -> set[str]:
    """The /dev/shm files the group's processes (every process where `pgid` is None) have mapped or open.

    vLLM's message queues between its processes are Python SharedMemory segments there (psm_*, 160 MiB
    each seen); a server stopped with SIGKILL, its resource tracker with it, leaves them behind, in RAM."""
    files = set()
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/maps") as fh:
                files.update(line.split(None, 5)[5].strip() for line in fh if SHM in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM):
                    files.add(target)
        except OSError:
            continue
    return {f.removesuffix(" (deleted)") for f in files if f.startswith(SHM) and not f.endswith(" (deleted)")}


def remove_left_shared_memory(files: set[str]) -> list[str]:
    """Remove those of `files` (a stopped server's, shared_memory_files) that still exist and that no live
    process maps or holds open; returns their paths."""
    left = {f for f in files if os.path.exists(f)}
    if not left:
        return []
    return unlink_all(sorted(left - shared_memory_files()))


def start_in_group(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """`argv` as the leader of a new process group (its pgid is its pid), output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent)


def stop_group(proc: subprocess.Popen, grace: float) -> set[str]:
    """SIGTERM the group `proc` leads, SIGKILL what is left after `grace` seconds, then remove the /dev/shm
    files its members held that no live process still holds; returns those the group held."""
    pgid = proc.pid
    shared = shared_memory_files(pgid)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if not group_has_live_members(pgid):
                break
        if not group_has_live_members(pgid):
            break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    remove_left_shared_memory(shared)
    return shared


def groups_cpu_s(pgids: list[int]) -> float:
    """CPU seconds (user and system) the groups' live processes have used together: one pass over /proc,
    each process's stat read once."""
    wanted, total = {str(pgid) for pgid in pgids}, 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if len(fields) > 12 and fields[2] in wanted and fields[0] != "Z":
                total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(pgids: list[int], limit_s: float, window_s: float = 0.1, quiet_cores: float = 0.25) -> float:
    """Wait until the groups together use under `quiet_cores` of a core over two windows in a row (a vLLM
    worker busy-polls a whole core for a second after its last message); returns the seconds waited,
    `limit_s` at most."""
    started = time.monotonic()
    quiet = 0
    last = groups_cpu_s(pgids)
    while time.monotonic() - started < limit_s and quiet < 2:
        time.sleep(window_s)
        now = groups_cpu_s(pgids)
        quiet = quiet + 1 if now - last < quiet_cores * window_s else 0
        last = now
    return time.monotonic() - started

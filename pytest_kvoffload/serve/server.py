"""Start, watch and stop vLLM servers (their HTTP surface, Endpoint, is in serve/client.py).

Each server runs in its own process group so that teardown reaches the engine-core and worker
processes vLLM forks, not just the API process. Teardown runs on normal exit, on test failure,
on Ctrl-C and on SIGTERM (see harness/plugin.py), and `ServerPool.stop_all` is idempotent.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Callable

from pytest_kvoffload.serve.client import Endpoint
from pytest_kvoffload.core.progress import Say


class ServerStartError(RuntimeError):
    """The server exited or missed its health deadline; the message carries the log's last lines."""


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


def _die_with_parent() -> None:
    # If pytest itself is killed with SIGKILL no handler runs; the kernel then stops the API server.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class VllmServer(Endpoint):
    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log_path: Path,
                 model_name: str) -> None:
        super().__init__(f"http://127.0.0.1:{port}", model_name)
        self.name = name
        self.argv = argv
        self.env = env
        self.port = port
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def wait_healthy(self, timeout: float, progress: Say = lambda message, update=False: None,
                     every: float = 5.0, expected_s: float | None = None) -> float:
        """Block until /health answers 200; returns the seconds it took. `expected_s` (the session's last
        start-up) lets the progress line say about how long is left."""
        assert self.proc is not None, "start() first"
        started = time.monotonic()
        next_note = started + every
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"{self.name}: vLLM exited with code {code} during start-up; log {self.log_path}, last lines:\n"
                    + log_tail(self.log_path)
                )
            if self.healthy():
                return time.monotonic() - started
            now = time.monotonic()
            if now - started > timeout:
                self.stop()
                raise ServerStartError(
                    f"{self.name}: not healthy after {timeout:.0f} s (--kv-server-timeout); log {self.log_path}, "
                    "last lines:\n" + log_tail(self.log_path)
                )
            if now >= next_note:
                waited = now - started
                left = (f", about {expected_s - waited:.0f} s left (the last start-up took {expected_s:.0f} s)"
                        if expected_s and expected_s > waited else "")
                progress(f"waiting for the {self.name} server on port {self.port}: {waited:.0f} s{left}", update=True)
                next_note = now + every
            time.sleep(0.5)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the whole group, then SIGKILL what is left after `grace` seconds."""
        if self.proc is None:
            return
        self.http.close()
        shared = shared_memory_files(self.pgid)
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    self.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
                if not group_has_live_members(self.pgid):
                    break
            if not group_has_live_members(self.pgid):
                break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        remove_shared_regions(self.log_path)
        remove_left_shared_memory(shared)


# An idle vLLM worker busy-polls for about 1 s after each message, on a core another server's worker may
# need: two servers measured side by side wait this long before each request (equal engines, A/B).
IDLE_S = 1.5


# vLLM's offloading keeps its CPU tier in a /dev/shm file (SharedOffloadRegion, logged when created) that a
# stopped server leaves behind: each native-disk server left 6 GB there, and the third start was OOM-killed.
_SHARED_REGION = re.compile(rb"Created mmap file (/dev/shm/vllm_offload_[\w.-]+\.mmap)")


def remove_shared_regions(log_path: Path) -> list[str]:
    """Remove the shared-memory files a stopped server's log says it created; returns their paths."""
    try:
        text = log_path.read_bytes()
    except OSError:
        return []
    return unlink_all(match.group(1).decode() for match in _SHARED_REGION.finditer(text))


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


def group_members(pgid: int | None = None) -> list[int]:
    """The live (non-zombie) processes of the group, or of the machine where `pgid` is None (from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
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


class ServerPool:
    """One server per backend for the whole session, started on first use."""

    def __init__(self, max_running: int = 1,
                 before_stop: Callable[[str, VllmServer], None] = lambda key, server: None) -> None:
        # One GPU cannot hold two servers' KV caches; on a CPU two small servers fit side by side.
        self.max_running = max_running
        # Called with each healthy server about to be stopped: the last chance to read its /metrics.
        self.before_stop = before_stop
        self._servers: dict[str, VllmServer] = {}
        self._failed: dict[str, str] = {}

    def get(self, key: str, factory: Callable[[], VllmServer], timeout: float,
            progress: Say = lambda message, update=False: None, expected_s: float | None = None) -> VllmServer:
        if key in self._failed:
            raise ServerStartError(self._failed[key])
        if key in self._servers:
            server = self._servers.pop(key)
            self._servers[key] = server  # most recently used last
            code = server.proc.poll() if server.proc else None
            if code is not None:
                self.release(key)
                self._failed[key] = (f"{key}: vLLM exited with code {code} during the session; log "
                                     f"{server.log_path}, last lines:\n{log_tail(server.log_path)}")
                raise ServerStartError(self._failed[key])
            return server
        while len(self._servers) >= self.max_running:
            self.release(next(iter(self._servers)))
        server = factory()
        self._servers[key] = server
        try:
            server.start()
            seconds = server.wait_healthy(timeout, progress, expected_s=expected_s)
            progress(f"{key} server healthy after {seconds:.0f} s")
        except BaseException as exc:
            server.stop()
            del self._servers[key]
            if isinstance(exc, ServerStartError):
                self._failed[key] = str(exc)
            raise
        return server

    def release(self, key: str) -> None:
        server = self._servers.pop(key, None)
        if server:
            self._stop(key, server)

    def stop_all(self) -> None:
        while self._servers:
            self._stop(*self._servers.popitem())

    def _stop(self, key: str, server: VllmServer) -> None:
        try:
            if server.proc is not None and server.proc.poll() is None:
                self.before_stop(key, server)
        finally:
            server.stop()

    def has(self, key: str) -> bool:
        return key in self._servers


"""Start, watch and stop vLLM servers (their HTTP surface, Endpoint, is in serve/client.py).

Each server runs in its own process group so that teardown reaches the engine-core and worker
processes vLLM forks, not just the API process. Teardown runs on normal exit, on test failure,
on Ctrl-C and on SIGTERM (see harness/plugin.py), and `ServerPool.stop_all` is idempotent.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from pytest_kvoffload.core.progress import Say
from pytest_kvoffload.serve.client import Endpoint
from pytest_kvoffload.serve.companion import Companion
from pytest_kvoffload.serve.metrics import Snapshot
from pytest_kvoffload.serve.processes import (log_tail, remove_left_shared_memory, shared_memory_files, start_in_group,
                                              stop_group, unlink_all, wait_until_quiet)


def inductor_folder_name() -> str:
    """The name torch gives its default inductor cache folder inside TMPDIR (torch's default_cache_dir)."""
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return "torchinductor_" + user


def own_temp_env(env: dict[str, str], folder: str) -> dict[str, str]:
    """The variables that keep a server's temporary files in `folder`, its own, removed with it (TMPDIR is
    set beside them; `folder` itself is made in the user's TMPDIR). vLLM leaves there its ZMQ socket files
    (7 a server on the CPU build: 2,900 in /tmp after some weeks of runs) and torch's file rendezvous,
    vllm_dist_<uuid> (one a server: 638). Inductor's cache, which lives there by default, stays where it
    was, so that servers still share what they compiled (the CPU build's servers get it under vLLM's cache
    root: compile_cache.py). A user's own VLLM_RPC_BASE_PATH and TORCHINDUCTOR_CACHE_DIR win."""
    inductor = os.path.join(tempfile.gettempdir(), inductor_folder_name())  # torch's default_cache_dir
    return {key: value for key, value in (("VLLM_RPC_BASE_PATH", folder), ("TORCHINDUCTOR_CACHE_DIR", inductor))
            if key not in env}


def share_precompiled_headers(folder: str, env: dict[str, str]) -> None:
    """Link the server's own TMPDIR/torchinductor_<user> to the inductor cache it shares. Torch keeps its
    precompiled C++ headers in the default folder whatever TORCHINDUCTOR_CACHE_DIR says
    (torch/_inductor/codecache.py, _HEADER_DIR): in a TMPDIR of its own every server compiled them again,
    g++ busy for 4 to 8 s of its warm-up (2-core EPYC, 2026-12-03; docs/servers.md)."""
    shared = env.get("TORCHINDUCTOR_CACHE_DIR")
    if shared:
        os.makedirs(shared, exist_ok=True)
        os.symlink(shared, os.path.join(folder, inductor_folder_name()))


class ServerStartError(RuntimeError):
    """The server exited or missed its health deadline; the message carries the log's last lines."""


class VllmServer(Endpoint):
    """One vLLM server's process group, and the companion process its backend runs beside it, if any."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log_path: Path,
                 model_name: str, companion: Companion | None = None) -> None:
        super().__init__(f"http://127.0.0.1:{port}", model_name)
        self.name = name
        self.argv = argv
        self.env = env
        self.port = port
        self.log_path = log_path
        self.companion = companion
        self.proc: subprocess.Popen | None = None
        self.temp_dir: str | None = None  # the server's own temporary folder (own_temp_env), removed in stop()

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        # The companion starts first but is not waited for: vLLM connects to it only once its worker is
        # up, 15 s or more into its start-up, while LMCache's server is ready after 3 to 5 s.
        if self.companion is not None:
            self.companion.start()
        self.temp_dir = tempfile.mkdtemp(prefix="kvoffload-server-")
        self.env = {**own_temp_env(self.env, self.temp_dir), **self.env, "TMPDIR": self.temp_dir}
        share_precompiled_headers(self.temp_dir, self.env)
        self.proc = start_in_group(self.argv, self.env, self.log_path)

    def failure(self, during: str) -> str | None:
        """Why this server cannot serve (vLLM or its companion exited), with the log's tail; else None."""
        code = self.proc.poll() if self.proc else None
        if code is not None:
            return (f"{self.name}: vLLM exited with code {code} {during}; log {self.log_path}, last lines:\n"
                    + log_tail(self.log_path))
        problem = self.companion.failure(during) if self.companion is not None else None
        return f"{self.name}: {problem}" if problem else None

    def wait_healthy(self, timeout: float, progress: Say = lambda message, update=False: None,
                     every: float = 5.0, expected_s: float | None = None) -> float:
        """Block until /health answers 200; returns the seconds it took. `expected_s` (the session's last
        start-up) lets the progress line say about how long is left."""
        assert self.proc is not None, "start() first"
        started = time.monotonic()
        next_note = started + every
        while True:
            problem = self.failure("during start-up")
            if problem:
                raise ServerStartError(problem)
            if self.healthy() and (self.companion is None or self.companion.ready()):
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

    def metrics(self) -> Snapshot:
        """vLLM's counters, with the companion's (its tier's reads) among the extra ones."""
        own = super().metrics()
        if self.companion is None or self.companion.exit_code() is not None:
            return own
        return own.with_extra(self.companion.metrics().extra)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the whole group, then SIGKILL what is left after `grace` seconds; the companion after it
        (vLLM's worker holds the companion's shared memory until it exits)."""
        companion = self.companion
        # What the companion holds in /dev/shm, read before it goes: the region it shares with vLLM's
        # worker can only be removed once both have exited.
        shared = shared_memory_files(companion.proc.pid) if companion is not None and companion.proc else set()
        if self.proc is not None:
            self.http.close()
            if companion is not None:
                companion.terminate()  # both wind down at once: LMCache's server takes 3 to 4 s
            shared |= stop_group(self.proc, grace)
            remove_shared_regions(self.log_path)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
        if companion is not None:
            companion.stop()
        remove_left_shared_memory(shared)


# An idle vLLM worker busy-polls for about 1 s after each message (shm_broadcast.py, busy_loop_s), on a
# core another server's worker may need: two servers measured side by side wait until neither computes
# before each request (equal engines, A/B, the admission frontier); a server not started here (no
# process group to watch) gets this long.
IDLE_S = 1.5


def settle(endpoints) -> float:
    """Wait until none of the servers computes: their process groups (and their companions') quiet, or
    IDLE_S for one we did not start. Returns the seconds waited."""
    groups = []
    for endpoint in endpoints:
        if not isinstance(endpoint, VllmServer) or endpoint.proc is None:
            time.sleep(IDLE_S)
            return IDLE_S
        groups.append(endpoint.pgid)
        if endpoint.companion is not None and endpoint.companion.proc is not None:
            groups.append(endpoint.companion.proc.pid)
    return wait_until_quiet(groups, limit_s=3 * IDLE_S)


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
        # Servers stopped only when nothing else can make room: the one every other backend is compared
        # with, so that the comparison runs while the other's server is still up (suite_machinery/ttft.py).
        self.keep: frozenset[str] = frozenset()

    def get(self, key: str, factory: Callable[[], VllmServer], timeout: float,
            progress: Say = lambda message, update=False: None, expected_s: float | None = None) -> VllmServer:
        if key in self._failed:
            raise ServerStartError(self._failed[key])
        if key in self._servers:
            server = self._servers.pop(key)
            self._servers[key] = server  # most recently used last
            problem = server.failure("during the session")
            if problem:
                self.release(key)
                self._failed[key] = problem
                raise ServerStartError(problem)
            return server
        while len(self._servers) >= self.max_running:
            self.release(self._least_needed())
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

    def _least_needed(self) -> str:
        """The server to stop for room: the least recently used one not kept, else the least recently used."""
        return next((key for key in self._servers if key not in self.keep), next(iter(self._servers)))

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


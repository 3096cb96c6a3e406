"""A process a backend's vLLM server needs beside it (LMCache's multiprocess server holds lmcache-disk's
tiers): started before vLLM in a process group of its own, watched while vLLM runs, stopped after it.

A backend describes it (CompanionSpec, in its ServerSpec); serve/server.py starts and stops it with the
server; its /metrics counters join the server's (Snapshot.extra), so a tier hit can be proved from the
process that did the reading.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from pytest_kvoffload.serve.metrics import Snapshot, snapshot
from pytest_kvoffload.serve.processes import log_tail, start_in_group, stop_group


@dataclass(frozen=True)
class CompanionSpec:
    """`metrics_url` answers 200 once the process serves, and its counters whose names start with one of
    `metric_prefixes` are kept. `ready_line` (bytes in its log) is what it logs once it takes requests."""

    name: str
    argv: list[str]
    env: dict[str, str]
    metrics_url: str
    metric_prefixes: tuple[str, ...]
    ready_line: bytes
    # How long it may take from its start to `ready_line` (LMCache's server: 3 to 5 s on 2 cores).
    start_timeout_s: float = 120.0


class CompanionError(RuntimeError):
    """The companion exited or never became ready; the message carries its log's last lines."""


class Companion:
    def __init__(self, spec: CompanionSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.http = requests.Session()
        self._ready = False
        self._started = time.monotonic()

    def start(self) -> None:
        self.proc = start_in_group(self.spec.argv, self.spec.env, self.log_path)
        self._started = time.monotonic()

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def failure(self, during: str) -> str | None:
        """Why it cannot serve (it exited, or it missed its start deadline), with its log tail; else None."""
        code = self.exit_code()
        if code is not None:
            return (f"{self.spec.name} exited with code {code} {during}; log {self.log_path}, last lines:\n"
                    + log_tail(self.log_path))
        if not self.ready() and time.monotonic() - self._started > self.spec.start_timeout_s:
            return (f"{self.spec.name} not ready after {self.spec.start_timeout_s:.0f} s; log {self.log_path}, "
                    "last lines:\n" + log_tail(self.log_path))
        return None

    def ready(self) -> bool:
        """Whether it logged `ready_line` (vLLM can connect to it from then on)."""
        if not self._ready:
            try:
                self._ready = self.spec.ready_line in self.log_path.read_bytes()
            except OSError:
                return False
        return self._ready

    def metrics(self) -> Snapshot:
        response = self.http.get(self.spec.metrics_url, timeout=10)
        response.raise_for_status()
        return snapshot(response.text, extra_prefixes=self.spec.metric_prefixes)

    def terminate(self) -> None:
        """SIGTERM its group without waiting (stop() waits, and kills what is left)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None:
            return
        self.http.close()
        stop_group(self.proc, grace)

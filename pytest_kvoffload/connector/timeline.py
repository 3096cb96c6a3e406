"""A step timeline of each request's load (option `timeline`, a file): where a tier hit's time goes between
its arrival and the forward that computes what it did not load (docs/connector.md, "A load's timeline").

Off by default. Both halves of the connector append JSON lines to one file: {"t": seconds on the machine's
monotonic clock (time.perf_counter, one clock for every process on a Linux machine), "event": ..., "side":
"scheduler" or "worker", "server": its store folder (servers sharing a file), ...}. Lines are held until the
end of the half's step and written with one O_APPEND write, so the halves' lines interleave whole.
analysis/request_phases.py reads the file (`kvoffload timeline FILE`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("pytest_kvoffload.connector")


class Timeline:
    on = True

    def __init__(self, path: Path, side: str, server: str = "") -> None:
        self.path, self.side, self.server = path, side, server
        self._lines: list[str] = []
        self._lock = threading.Lock()  # the worker's I/O threads mark too (a load's reads)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def mark(self, event: str, req: str | None = None, t: float | None = None, **fields) -> None:
        """One event, at `t` (time.perf_counter(); now when None)."""
        record = {"t": time.perf_counter() if t is None else t, "event": event, "side": self.side,
                  "server": self.server}
        if req is not None:
            record["req"] = req
        record.update(fields)
        with self._lock:
            self._lines.append(json.dumps(record, separators=(",", ":")))

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        if not lines or self._fd is None:
            return
        try:
            os.write(self._fd, ("\n".join(lines) + "\n").encode())
        except OSError as exc:  # a timeline is a diagnostic: it never stops the server
            log.warning("kvoffload: timeline %s: %s; no more events written", self.path, exc)
            self._let_go()

    def close(self) -> None:
        self.flush()
        self._let_go()

    def _let_go(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:  # already gone (the failed write's cause)
                pass


class NoTimeline:
    """The timeline off: every mark a no-op."""

    on = False

    def mark(self, event: str, req: str | None = None, t: float | None = None, **fields) -> None:
        return

    def flush(self) -> None:
        return

    def close(self) -> None:
        return


def timeline_for(path: Path | None, side: str, server: str = "") -> Timeline | NoTimeline:
    """`server` tells apart the servers writing one file (their steps' numbers collide): the store folder."""
    return Timeline(path, side, server) if path is not None else NoTimeline()

"""Progress of long phases (server start-ups, grids, replays): what is being done, how far along and about
how long is left. `ProgressLine` writes it through pytest's terminal reporter: one updating line on a
terminal, plain lines at most every PLAIN_EVERY_S seconds in a log, nothing under -q."""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

# In a log (no terminal) an updating line is written at most this often; a phase's last line always is.
PLAIN_EVERY_S = 10.0


class Say(Protocol):
    def __call__(self, message: str, update: bool = False) -> None: ...


def eta(elapsed_s: float, done: float, total: float) -> str:
    """ "12 s, about 30 s left" from the pace so far (nothing left to say before the first step)."""
    if done <= 0 or done >= total - 1e-9:
        return f"{elapsed_s:.0f} s"
    return f"{elapsed_s:.0f} s, about {elapsed_s / done * (total - done):.0f} s left"


class Tracker:
    """One phase of `total` steps; call step() after each (from any thread). A phase of one step says
    nothing: whatever runs it says what it is doing."""

    def __init__(self, say: Say, what: str, total: int, unit: str = "", clock: Callable[[], float] = time.monotonic,
                 total_work: float | None = None):
        self.say = say
        self.what = what
        self.total = max(1, total)
        self.unit = f" {unit}" if unit else ""
        self.clock = clock
        self.started = clock()
        self.done = 0
        # Steps of unequal cost (a 4,096-token cell takes far longer than a 512 one): the time left is
        # estimated from the work done, when the caller says how much each step is.
        self.total_work = total_work
        self.work_done = 0.0
        self.lock = threading.Lock()

    def step(self, note: str = "", work: float = 1.0) -> None:
        """Call after a step is done; `work`, its share of `total_work`."""
        with self.lock:
            self.done += 1
            self.work_done += work
            if self.total == 1:
                return
            elapsed = self.clock() - self.started
            note = f" ({note})" if note else ""
            pace = eta(elapsed, self.work_done, self.total_work) if self.total_work else \
                eta(elapsed, self.done, self.total)
            self.say(f"{self.what}: {self.done}/{self.total}{self.unit}{note}, {pace}", update=self.done < self.total)


def print_line(message: str, update: bool = False) -> None:
    """A Say for use outside pytest (scripts, the command line)."""
    print(f"[kvoffload] {message}", flush=True)


class ProgressLine:
    """The session's Say: pytest's terminal reporter, past output capture."""

    def __init__(self, reporter, capture=None, quiet: bool = False, clock: Callable[[], float] = time.monotonic):
        self.reporter = reporter
        self.capture = capture
        self.quiet = quiet or reporter is None
        self.clock = clock
        self.terminal = bool(reporter is not None and reporter.isatty())
        self.updating = False  # an updating line is on screen, not yet ended
        self.last_plain = float("-inf")

    def __call__(self, message: str, update: bool = False) -> None:
        if self.quiet:
            return
        line = f"[kvoffload] {message}"
        if self.capture is not None:
            with self.capture.global_and_fixture_disabled():
                self.write(line, update)
        else:
            self.write(line, update)

    def write(self, line: str, update: bool) -> None:
        if self.terminal and update:
            if not self.updating:
                self.reporter.ensure_newline()  # below pytest's own line of results, not over it
            self.reporter.rewrite(line, erase=True)
            self.updating = True
            return
        if update:
            now = self.clock()
            if now - self.last_plain < PLAIN_EVERY_S:
                return
            self.last_plain = now
        if self.updating:
            self.reporter.rewrite(line, erase=True)
            self.reporter.write("\n")
            self.updating = False
        else:
            self.reporter.write_line(line)

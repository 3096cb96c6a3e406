"""How long a step with nothing to compute waits for a load in flight (worker.py, get_finished; idle_wait_ms).

vLLM runs such steps back to back only to poll get_finished, and each poll that finds the load unfinished
costs a whole empty step before the request can be scheduled (docs/notes/2026-12-04-last-read.md).
So a step waits until the load nearest its end is expected to be done, and idle_wait_ms beyond (a load
running at the rate it was expected to would otherwise end a hair after the wait): its bytes at the slowest
rate this worker's recent loads ran, after the emulated drive's access latency. A request arriving meanwhile
waits that long for the engine; the engine would otherwise have shared the cores the load needs between the
load and that request's prefill.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import wait

# The loads whose rates are remembered: the slowest of them bounds the next wait. Recent ones only, so that
# one slow minute of the drive stops lengthening waits once it is over.
RECENT_LOADS = 16


class IdleWait:
    def __init__(self, margin_s: float, latency_s: float = 0.0) -> None:
        # idle_wait_ms: how long past a load's expected end a step waits (the whole wait before any load has
        # been timed); 0: never.
        self.margin_s = margin_s
        self.latency_s = latency_s  # read_latency_ms: the emulated drive's access latency, before any byte
        self._rates: deque[float] = deque(maxlen=RECENT_LOADS)  # bytes per second after the latency

    def observe(self, moved_bytes: float, seconds: float) -> None:
        """A finished load: `moved_bytes` read and scattered in `seconds` (submission to its last chunk)."""
        transfer = seconds - self.latency_s
        if moved_bytes > 0 and transfer > 0:
            self._rates.append(moved_bytes / transfer)

    def timeout(self, load_bytes: float, elapsed: float) -> float:
        """Seconds an idle step waits for a load of `load_bytes` that started `elapsed` seconds ago: 0 when
        the option is off, else the option beyond the load's expected end at the slowest recent rate."""
        if not self.margin_s:
            return 0.0
        if not self._rates:
            return self.margin_s
        expected = self.latency_s + load_bytes / min(self._rates)
        return max(0.0, expected - elapsed) + self.margin_s

    def wait_for_a_load(self, loads, chunk_bytes) -> float | None:
        """Wait for the load nearest its end (fewest chunks in flight: the first the scheduler can use) among
        `loads`, (job, futures, started) each, unless the option is off or one has finished already (it is
        reported at once). The seconds waited, or None where it did not wait."""
        if not self.margin_s or not loads:
            return None
        remaining = [(job, [f for f in futures if not f.done()], began) for job, futures, began in loads]
        if not all(pending for _, pending, _ in remaining):
            return None
        job, pending, began = min(remaining, key=lambda load: len(load[1]))
        started = time.perf_counter()
        wait(pending, timeout=self.timeout(sum(chunk_bytes(chunk) for chunk in job.chunks), started - began))
        return time.perf_counter() - started

"""The emulated slow drive: a chunk store whose reads take as long as a drive of read_gbps would, shared by
all the load threads, for the admission suite's slow tier (a drive slower than the one under test)."""

from __future__ import annotations

import threading
import time

from pytest_kvoffload.connector.store import ChunkStore


class PacedChunkStore(ChunkStore):
    def __init__(self, *args, read_bytes_per_s: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_bytes_per_s = read_bytes_per_s
        self._pace_lock = threading.Lock()
        self._throttle_until = 0.0

    def after_read(self, nbytes: int) -> None:
        """Hold a read until a drive of read_bytes_per_s could have delivered it (shared by all threads)."""
        if not self.read_bytes_per_s:
            return
        with self._pace_lock:
            start = max(time.perf_counter(), self._throttle_until)
            self._throttle_until = start + nbytes / self.read_bytes_per_s
            until = self._throttle_until
        delay = until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

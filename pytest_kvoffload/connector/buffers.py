"""The worker's memory and time bookkeeping: chunk buffers gathered and not yet written (bounded, reused),
page-locked buffers the drive and the GPU both copy directly, and the union of busy intervals that
bandwidths are computed over."""

from __future__ import annotations

import threading

import numpy as np
import torch

from pytest_kvoffload.connector.io_memory import ALIGN, padded


class BusyTime:
    """The union of time intervals reported one by one, in any order: add() returns how much of the new
    interval no earlier one covered. Bandwidth is bytes over this union, never over a sum of overlapping
    walls. Keeps the most recent intervals only (older ones cannot overlap new I/O)."""

    KEEP = 256

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []  # disjoint, sorted by start

    def add(self, start: float, end: float) -> float:
        if end <= start:
            return 0.0
        covered = sum(max(0.0, min(end, e) - max(start, s)) for s, e in self._spans)
        merged, lo, hi = [], start, end
        for s, e in self._spans:
            if e < lo or s > hi:
                merged.append((s, e))
            else:
                lo, hi = min(lo, s), max(hi, e)
        merged.append((lo, hi))
        self._spans = sorted(merged)[-self.KEEP:]
        return (end - start) - covered


class SaveBatches:
    """Each step's saves, timed once all its writes are done: the histogram gets a batch's wall time (submission
    to last write), save_wall_seconds the union of the batches' intervals (a step's saves often start while the
    previous step's still write: summing both walls would count the shared time twice)."""

    def __init__(self, counters) -> None:
        self.counters = counters
        self._busy = BusyTime()
        self._batches: list[tuple[float, list]] = []  # (submitted, futures of (written, ended, bytes))

    def add(self, started: float, batch: list) -> None:
        self._batches.append((started, batch))

    def time_finished(self) -> None:
        pending = []
        for started, batch in self._batches:
            if not all(f.done() for f in batch):
                pending.append((started, batch))
                continue
            ended = max((f.result()[1] for f in batch if f.exception() is None), default=started)
            self.counters.add("save_wall_seconds", self._busy.add(started, ended))
            written = sum(f.result()[2] for f in batch if f.exception() is None and f.result()[0])
            if written:
                self.counters.observe("save_duration_seconds", ended - started)
                self.counters.observe("save_size_bytes", written)
        self._batches = pending


class GatheredBuffers:
    """Chunk buffers gathered in the step and not yet written: at most `limit` out at once (take() returns
    None past it), and those given back kept for reuse (a fresh buffer costs page faults)."""

    def __init__(self, make, limit: int) -> None:
        self._make = make
        self.limit = limit
        self._lock = threading.Lock()
        self.out = 0  # taken and not yet given back
        self._spare: list[np.ndarray] = []

    def take(self) -> np.ndarray | None:
        with self._lock:
            if self.out >= self.limit:
                return None
            self.out += 1
            if self._spare:
                return self._spare.pop()
        return self._make()

    def give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            self.out -= 1
            self._spare.append(buffer)  # never more than `limit` buffers are made


def pinned_buffer(nbytes: int) -> np.ndarray:
    """Like store.aligned_buffer, in page-locked memory: the drive and the GPU both copy it directly."""
    size = padded(nbytes)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=True)
    offset = (-raw.data_ptr()) % ALIGN
    array = raw[offset:offset + size].numpy()
    array.fill(0)
    return array

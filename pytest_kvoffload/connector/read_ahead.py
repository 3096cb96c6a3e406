"""Reads ahead for queued requests (the connector option read_ahead_mb): a request's stored chunks are read
into staging buffers once it arrives, before vLLM has given it cache blocks, and its load scatters them from
there when it has. The scheduler half decides on arrival (SchedulerSide.on_new_request, the admission rule
first) and names the requests no load will take (KVOffloadMetadata.drops); this holds the buffers, up to
read_ahead_mb (docs/connector.md, "Loads behind the queue").

Chunks are content-keyed (hashing.py), so a staged chunk stays right for its key even if the index evicts
the file meanwhile; a staged read that failed is read again by the load, which then counts what it finds."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pytest_kvoffload.connector.metadata import ReadAheadJob


class ReadAhead:
    """Staged chunks per request: (file key, blocks) -> a future of (read and checked, its buffer)."""

    def __init__(self, store, pool: ThreadPoolExecutor, limit_bytes: int, counters, read_slots) -> None:
        self.store = store
        self.pool = pool
        self.limit = limit_bytes
        self.counters = counters
        self.read_slots = read_slots
        self._staged: dict[str, dict[tuple[str, int], Future]] = {}
        self._held = 0  # buffers held or being filled, in bytes
        self._lock = threading.Lock()

    def step(self, meta, not_before: float) -> None:
        """A step's metadata: free the staging of requests no load will take, then start the new reads ahead,
        none before `not_before` (perf_counter)."""
        for req_id in meta.drops:
            self.drop(req_id)
        for job in meta.read_aheads:
            self.start(job, not_before)

    def start(self, job: ReadAheadJob, not_before: float) -> None:
        """Read `job`'s chunks, none before `not_before` (perf_counter), as far as the memory bound allows."""
        if job.req_id in self._staged:
            return
        staged: dict[tuple[str, int], Future] = {}
        size = self.store.layout.file_bytes
        for key, blocks in job.chunks:
            with self._lock:
                if self._held + size > self.limit:
                    self.counters.add("read_ahead_chunks_skipped", len(job.chunks) - len(staged))
                    break
                self._held += size
            staged[(key, blocks)] = self.pool.submit(self._read, key, blocks, not_before,
                                                     job.arrived if not staged else None)
        self._staged[job.req_id] = staged

    def _read(self, key: str, blocks: int, not_before: float, arrived: float | None) -> tuple[bool, np.ndarray]:
        delay = not_before - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if arrived:  # the request's first read: how long after its arrival the drive was asked
            self.counters.observe("read_ahead_issue_seconds", max(0.0, time.time() - arrived))
        buffer = self.store.new_buffer()
        ok = self.store.read(key, buffer, blocks, io_slot=self.read_slots)
        self.counters.add("read_ahead_chunks_read")
        return ok, buffer

    def serve(self, job, pool: ThreadPoolExecutor, blocks_of, scatter_for, read) -> list[Future | None]:
        """Per chunk of `job` (a LoadJob): a future on `pool` of (ok, when it finished) that scatters its staged
        read (`scatter_for(chunk, buffer, blocks)()`, as the worker's loads do), or None where it has none; a
        chunk whose read ahead failed is read again by `read(chunk)`, which counts what it finds. What the
        load does not take is freed. `blocks_of(chunk)`: the blocks its file holds."""
        staged = self._staged.pop(job.req_id, {})
        futures: list[Future | None] = []
        for chunk in job.chunks:
            ahead = staged.pop((chunk.key, blocks_of(chunk)), None)
            futures.append(ahead and pool.submit(self._use, ahead, chunk, blocks_of(chunk), scatter_for, read))
        for future in staged.values():
            self.release(future)
        return futures

    def _use(self, staged: Future, chunk, blocks: int, scatter_for, read) -> tuple[bool, float]:
        try:
            ok, buffer = staged.result()
            if not ok:
                return read(chunk)
            scatter_for(chunk, buffer, blocks)()
            self.counters.add("read_ahead_chunks_used")
            return True, time.perf_counter()
        finally:
            self.release(staged)

    def release(self, future: Future) -> None:
        """A staged buffer is done with: used, or no load will take it."""
        def freed(_: Future) -> None:
            with self._lock:
                self._held -= self.store.layout.file_bytes
        future.add_done_callback(freed)

    def drop(self, req_id: str) -> None:
        """Free what `req_id`'s load did not take, or all of it where no load will come."""
        for future in self._staged.pop(req_id, {}).values():
            self.release(future)

    def staged(self, req_id: str) -> list[Future]:
        """`req_id`'s reads ahead not yet taken or freed."""
        return list(self._staged.get(req_id, {}).values())

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=False)


__all__ = ["ReadAhead"]

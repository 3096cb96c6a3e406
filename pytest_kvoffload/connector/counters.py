"""The connector's counters, and their path to Prometheus through vLLM's connector-stats hooks.

Workers count; each step vLLM collects get_kv_connector_stats() from the workers, aggregates it in the
engine, and hands it to build_prom_metrics' observer in the API process, which exports
kvoffload:* counters on /metrics.
"""

from __future__ import annotations

import threading

# name -> help text. Counters are totals since start; "direct_io" is a 0/1 flag.
COUNTERS = {
    "bytes_read": "bytes read from the store (headers and padding included)",
    "bytes_written": "bytes written to the store (headers and padding included)",
    "useful_bytes_read": "KV payload bytes read",
    "useful_bytes_written": "KV payload bytes written",
    "load_seconds": "seconds spent reading chunks",
    "save_seconds": "seconds spent writing chunks",
    "load_wall_seconds": "wall seconds from a request's load start to its last chunk (delivered read bandwidth)",
    "save_wall_seconds": "wall seconds from each step's save submission to its last write (delivered write bandwidth)",
    "chunks_read": "chunks read",
    "chunks_written": "chunks written",
    "chunks_evicted": "chunks evicted to stay under the capacity",
    "chunks_missing": "chunks gone between lookup and load",
    "chunks_corrupt": "chunk files skipped as damaged",
    "chunks_foreign": "chunk files skipped as written for another model or layout",
    "read_errors": "chunk reads that failed with an OS error",
    "writes_declined": "chunk writes declined (full, read-only or vanished store, over capacity)",
    "write_errors_full": "writes that hit ENOSPC",
    "write_errors_read_only": "writes refused as read-only or not permitted",
    "write_errors_vanished": "writes to a store folder that no longer exists and could not be recreated",
    "store_recreated": "times the store folder had vanished and was recreated empty",
    "write_errors_write_error": "writes that failed otherwise",
    "blocks_load_failed": "KV blocks whose load failed and were recomputed",
    "loads_admitted": "prefix loads admitted by the admission rule",
    "loads_declined": "prefix loads declined by the admission rule",
    "tokens_declined": "prompt tokens whose load was declined by the admission rule",
    "requests_not_keyed": "requests neither saved nor loaded: their KV depends on more than tokens (multimodal, embeddings)",
    "loads_admitted_queued": "prefix loads admitted only because they finish while the request would queue anyway",
}
FLAGS = {"direct_io": "1 when the store uses O_DIRECT, 0 when buffered with cached pages dropped",
         "online_read_gbps": "the admission rule's running estimate of delivered read bandwidth, GB/s"}
PREFIX = "kvoffload:"


class Counters:
    """Thread-safe running totals, drained into connector stats once per engine step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delta: dict[str, float] = {}
        self._flags: dict[str, float] = {}

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._delta[name] = self._delta.get(name, 0.0) + value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._flags[name] = value

    def drain(self) -> dict[str, float]:
        with self._lock:
            data, self._delta = self._delta, {}
            data.update(self._flags)
        return data

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
    "save_wait_seconds": "seconds chunks waited from their step's save submission to an I/O thread taking them",
    "save_first_wait_seconds": "seconds the first chunk of each step's saves waited for an I/O thread",
    "save_batches": "steps that saved chunks",
    "save_copy_seconds": "seconds spent gathering chunks' blocks from the KV cache before writing them",
    "load_wall_seconds": "wall seconds with a load in flight, overlaps counted once (delivered read bandwidth)",
    "save_wall_seconds": "wall seconds with saves in flight, overlaps counted once (delivered write bandwidth)",
    "idle_wait_seconds": "seconds the worker waited in steps with nothing to compute for a load in flight (idle_wait.py)",
    "load_threads_on_all_cpus": "load threads moved off the worker's CPUs onto every CPU (load_cpus=all)",
    "save_threads_on_all_cpus": "save threads moved off the worker's CPUs onto every CPU (save_cpus=all)",
    "io_threads_short_slice": "I/O threads running with the short scheduler slice of io_slice_us (io_threads.py)",
    "requests_opted_out": 'requests neither saved nor loaded at their own asking (kv_transfer_params {"kvoffload": "skip"})',
    "chunks_read": "chunks read",
    "chunks_written": "chunks written",
    "chunks_written_over_free": "chunks written over a removed chunk's file instead of a new one (store.py)",
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
    "lookups_deferred": "requests told to wait while another request loaded the same chunks (read once, not twice)",
    "loads_admitted_queued": "prefix loads admitted only because they finish while the request would queue anyway",
    "prompt_tokens_computed": "prompt tokens the engine computed itself (a fully loaded prompt: its last token)",
    "read_ahead_chunks_read": "chunks read ahead for queued requests (read_ahead_mb: read_ahead.py)",
    "read_ahead_chunks_used": "chunks read ahead that their request's load took from staging memory",
    "read_ahead_chunks_skipped": "chunks not read ahead: staging memory (read_ahead_mb) full",
    "chunks_superseded": "chunk files removed once a newer file held all their blocks (a prompt's short last chunk)",
}
FLAGS = {"direct_io": "1 when the store uses O_DIRECT, 0 when buffered with cached pages dropped",
         "blocks_one_copy": "1 when a run of blocks moves in one copy for all layers (the CPU build, layers in one allocation)",
         "online_read_gbps": "the admission rule's running estimate of delivered read bandwidth, GB/s",
         "chunks_old_format": "chunk files of an older format found in the store at start: not read (index.py)",
         "buffers_on_huge_pages": "1 when the kernel grants the chunk buffers huge pages (io_memory.py), 0 on 4 KiB pages",
         "loads_on_aio": "1 when loads run on native AIO (load_io=aio, aio_loads.py), 0 on load threads"}
PREFIX = "kvoffload:"

# Seconds and bytes of single operations, exported as Prometheus histograms beside the totals (vLLM's
# offloading exports the same kind), so a user sees a distribution, not only a mean.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = tuple(float(2 ** k) for k in range(16, 31))  # 64 KiB to 1 GiB, doubling
# name -> (help text, bucket upper bounds)
HISTOGRAMS = {
    "load_duration_seconds": ("wall seconds of one request's load, from its first read to its last chunk",
                              SECONDS_BUCKETS),
    "load_size_bytes": ("bytes one request's load read", BYTES_BUCKETS),
    "save_duration_seconds": ("wall seconds of one step's saves, from submission to the last write", SECONDS_BUCKETS),
    "save_size_bytes": ("bytes one step's saves wrote", BYTES_BUCKETS),
    "read_ahead_issue_seconds": ("seconds from a queued request's arrival to its first read ahead (read_ahead_mb)",
                                 SECONDS_BUCKETS),
}


class Counters:
    """Thread-safe running totals and histogram observations, drained into connector stats once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delta: dict[str, float] = {}
        self._flags: dict[str, float] = {}
        self._samples: dict[str, list[float]] = {}

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._delta[name] = self._delta.get(name, 0.0) + value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._flags[name] = value

    def observe(self, name: str, value: float) -> None:
        """One observation of a histogram (HISTOGRAMS)."""
        with self._lock:
            self._samples.setdefault(name, []).append(float(value))

    def drain(self) -> dict[str, float | list[float]]:
        """Totals since the last drain, the flags, and each histogram's observations as a list."""
        with self._lock:
            data: dict = dict(self._delta)
            data.update(self._flags)
            data.update(self._samples)
            self._delta, self._samples = {}, {}
        return data

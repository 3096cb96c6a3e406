"""The worker half: moves whole KV blocks of every layer between the engine's cache and chunk files.

Loads and saves run on I/O threads (separate ones), so the forward pass never waits on the drive: a load is reported
through get_finished while its request waits in the scheduler, and a save holds its blocks (through
request_finished) until the file is in place. Whole blocks (kv[block_id]) are copied, which is exact
on the CPU and GPU cache layouts alike (vLLM 0.33 puts the block dimension first in both).
What to keep and what to remove is the scheduler's index's (index.ChunkIndex) to say: the worker carries out
its deletions, and reports back every finished load, every write and every chunk it found damaged.
On the CPU build a step's saves are gathered and sealed by the step's own thread (wait_for_save), up to a bound
on the memory held, the I/O threads only write, chunk buffers sit on huge pages (io_memory.py), and loads run
on native AIO where the kernel has it (aio_loads.py, load_io). On CUDA each I/O thread's chunk buffer is pinned
host memory, page-aligned for O_DIRECT, copied on that thread's stream.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from pytest_kvoffload.connector.aio_loads import AioLoads, available as aio_available
from pytest_kvoffload.connector.blocks import copy_runs, stacked_layers
from pytest_kvoffload.connector.buffers import BusyTime, GatheredBuffers, SaveBatches, pinned_buffer
from pytest_kvoffload.connector.config import ConnectorConfig
from pytest_kvoffload.connector.metadata import KVOffloadMetadata, KVOffloadWorkerMeta, LoadJob, SaveJob
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.connector.idle_wait import IdleWait
from pytest_kvoffload.connector.io_threads import ReadSlots, start_io_thread
from pytest_kvoffload.connector.read_ahead import ReadAhead
from pytest_kvoffload.connector.chunk_format import Layout
from pytest_kvoffload.connector.store import ChunkStore
from pytest_kvoffload.connector.timeline import NoTimeline

log = logging.getLogger("pytest_kvoffload.connector")

# Memory the CPU build's in-step gathers may hold at once (chunks gathered, not yet written); at least
# one chunk per I/O thread whatever the chunk size.
GATHER_AHEAD_BYTES = 64 << 20

# The I/O threads' names, also as the kernel shows them (15 bytes at most).
LOAD_THREADS, SAVE_THREADS = "kvoffload-load", "kvoffload-save"


class WorkerSide:
    read_delay_s = 0.0  # a load's reads start this long after its hand-over (rigged/: an emulated drive's latency)

    def __init__(self, config: ConnectorConfig, fingerprint: str, store_root: Path, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.store_root = store_root
        self.counters = Counters()
        self.layers: list[torch.Tensor] = []
        self.stacked: torch.Tensor | None = None  # every layer as one view, where they allow it (stacked_layers)
        self.store: ChunkStore | None = None
        # Loads and saves get threads of their own: a load must never queue behind another request's saves. Without AIO,
        # load_threads threads keep io_threads reads in flight while others check and scatter (docs/connector.md).
        self._read_slots = ReadSlots(config.io_threads)
        self.load_pool = self._io_pool(LOAD_THREADS, config.load_threads or 2 * config.io_threads)
        self.save_pool = self._io_pool(SAVE_THREADS, config.io_threads)
        self._loads: dict[str, tuple[LoadJob, list[Future], float]] = {}
        self._saves: dict[str, list[Future]] = {}
        self._save_batches = SaveBatches(self.counters)  # each step's saves, timed (their wall once)
        self._loads_busy = BusyTime()  # wall time with loads in flight, each instant counted once
        self._idle_wait = IdleWait(config.idle_wait_s, self.read_delay_s)  # how long an idle step waits
        self._report_lock = threading.Lock()  # I/O threads append to the report below
        self._report = KVOffloadWorkerMeta()
        self._local = threading.local()  # a chunk buffer per I/O thread, reused: fresh ones cost page faults
        self.step_buffers: GatheredBuffers | None = None  # the CPU build's in-step gathers (register_kv_caches)
        self._finished: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._cuda = False
        self.device = None
        self._aio: AioLoads | None = None  # the CPU build's loads with load_io=aio (register_kv_caches)
        self._aio_pool: ThreadPoolExecutor | None = None
        self.read_ahead: ReadAhead | None = None  # queued requests' reads (read_ahead_mb; register_kv_caches)
        self.timeline = NoTimeline()  # the timeline option's, set by connector.py (timeline.py)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = list(kv_caches.values())
        first = self.layers[0]
        shapes = {tuple(t.shape[1:]) for t in self.layers}
        if len(shapes) != 1 or len({t.dtype for t in self.layers}) != 1:
            raise ValueError("kvoffload connector: every layer's KV cache must share one block shape and dtype")
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        block_bytes = first[0].numel() * first.element_size()
        per_chunk = self.config.chunk_tokens // self.block_size
        self.layout = Layout(layers=len(self.layers), blocks=per_chunk, block_bytes=block_bytes)
        self._cuda = first.is_cuda
        self.device = first.device
        if not self._cuda:
            self.stacked = stacked_layers(self.layers)
            self.counters.set("blocks_one_copy", 1.0 if self.stacked is not None else 0.0)
            held = max(self.config.io_threads, GATHER_AHEAD_BYTES // self.layout.file_bytes)
            self.step_buffers = GatheredBuffers(lambda: self.store.new_buffer(), held)
        layout_text = f"{self.fingerprint}|shape={self.block_shape}|dtype={self.dtype}"
        self.store = self.new_store(layout_text)
        if not self._cuda and self.config.load_io == "aio":
            if aio_available():
                self._aio = AioLoads(self.store, self.config.io_threads)
                self._aio_pool = self._io_pool(LOAD_THREADS, 1)
            else:
                log.warning("kvoffload: load_io aio: this kernel has no native AIO; loads run on threads")
        self.counters.set("loads_on_aio", 1.0 if self._aio is not None else 0.0)
        if self.config.read_ahead_bytes:  # threads of its own: a load's thread waits on a read ahead's
            self.read_ahead = ReadAhead(self.store, self._io_pool(LOAD_THREADS, self.config.io_threads),
                                        self.config.read_ahead_bytes, self.counters, self._read_slots)
        log.info("kvoffload: %d layers, block shape %s %s, %d blocks (%d bytes) per chunk file, store %s (%s, "
                 "buffers on %s pages)%s", len(self.layers), self.block_shape, self.dtype, per_chunk,
                 self.layout.file_bytes, self.store_root, "O_DIRECT" if self.store.direct_io else "buffered",
                 "pinned" if self._cuda else "huge" if self.store.buffers_on_huge_pages else "4 KiB",
                 "" if self._cuda else ("; blocks move in one copy for all layers" if self.stacked is not None
                                        else "; blocks move a layer at a time (layers not in one allocation)"))

    # The test-only connector's worker (rigged/) paces this store and plants wrong KV in `loaded`.
    def new_store(self, layout_text: str) -> ChunkStore:
        return ChunkStore(self.store_root, layout_text, self.layout, self.config.direct_io, self.counters,
                          huge_pages=self.config.huge_pages)

    def loaded(self, src: torch.Tensor, chunk) -> torch.Tensor:  # a chunk's blocks, as they go into the cache
        return src

    # -- per-step entry points --
    def start_load_kv(self, meta: KVOffloadMetadata) -> None:
        self._delete(meta)
        if self.read_ahead is not None:
            self.read_ahead.step(meta, time.perf_counter() + self.read_delay_s)
        sync = []
        for job in meta.loads:
            # Chunks are read in parallel, none before read_delay_s; the request is released when all are in. The
            # load is timed from its hand-over, as the drive's reference times its requests (drive/probe.py).
            started = time.perf_counter()
            futures = self._read_chunks(job, started + self.read_delay_s)
            if job.sync:
                sync.append((job, futures, started))
            else:
                self._loads[job.req_id] = (job, futures, started)
        if meta.loads and not sync:
            self._hand_over()
        for job, futures, started in sync:
            # This step's forward reads these blocks: wait, and report failures in this same step.
            wait(futures)
            self._collect(job, futures, started)

    def _read_chunks(self, job: LoadJob, not_before: float) -> list[Future]:
        """A future of (ok, when it finished) per chunk of `job`: scattered from its read ahead where it has one
        (read_ahead.py), else read on AIO or the load threads."""
        futures = (self.read_ahead.serve(job, self.load_pool, self._blocks_in, self._scatter_for,
                                         lambda chunk: self._load_chunk(chunk, not_before))
                   if self.read_ahead else [None] * len(job.chunks))
        rest = [c for c, f in zip(job.chunks, futures) if f is None]
        if self._aio is not None and rest:
            read = [Future() for _ in rest]
            self._aio_pool.submit(self._aio.load, rest, read, self._scatter_for, not_before)
        else:
            read = [self.load_pool.submit(self._load_chunk, chunk, not_before) for chunk in rest]
        it = iter(read)
        return [f if f is not None else next(it) for f in futures]

    def _delete(self, meta: KVOffloadMetadata) -> None:
        """Carry out the index's deletions before this step's loads and saves (which may reuse a key)."""
        if meta.clear:
            # A reset: reads and writes already under way finish first, or they would outlive it.
            wait([f for _, futures, _ in self._loads.values() for f in futures]
                 + [f for futures in self._saves.values() for f in futures])
            removed = self.store.clear()
            log.info("kvoffload: store reset, %d chunk files removed", removed)
        for key in meta.deletes:
            # The index never evicts a chunk being read or written, so no I/O thread holds this file.
            self.store.delete(key)

    def wait_for_save(self, meta: KVOffloadMetadata) -> None:
        if not meta.saves:
            return
        ready = torch.cuda.Event() if self._cuda else None
        if ready is not None:
            ready.record()  # the side stream must not read blocks before this step's forward has written them
        # The CPU build: the step's own thread gathers and seals (_gather) the chunks (at the next step's bind:
        # connector.py), so the I/O threads (which share the forward's core there) only write. Up to a bound on
        # the memory held; past it a chunk is gathered by its I/O thread, as on CUDA.
        gathered = [self._gather_now(job) for job in meta.saves] if self.step_buffers else [None] * len(meta.saves)
        started, batch = time.perf_counter(), []
        for i, job in enumerate(meta.saves):
            future = self.save_pool.submit(self._save, job, ready, started, i == 0, gathered[i])
            self._saves.setdefault(job.req_id, []).append(future)
            batch.append(future)
        # Write bandwidth is timed per step's batch: a request's saves span its prefill steps.
        self._save_batches.add(started, batch)
        self._hand_over()

    def _hand_over(self) -> None:
        """Once a step has submitted I/O it does not wait for: on the CPU build the I/O threads share this thread's
        core and the GIL, which it would hold on into vLLM's Python, so it yields them both
        (docs/notes/2026-12-04-save-handover.md)."""
        if not self._cuda:
            os.sched_yield()

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> tuple[set[str] | None, set[str] | None]:
        if idle:
            # Blocked there this thread holds neither core nor GIL, which the CPU build's I/O threads need
            # (docs/notes/2026-12-02-paired.md).
            waited = self._idle_wait.wait_for_a_load(self._loads.values(), self._chunk_bytes)
            if waited is not None:
                self.counters.add("idle_wait_seconds", waited)
        received = set()
        for req_id, (job, futures, started) in list(self._loads.items()):
            if not all(f.done() for f in futures):
                continue
            del self._loads[req_id]
            self._collect(job, futures, started)
            received.add(req_id)
        self._finished.update(r for r in finished_req_ids if r in self._saves)
        sent = set()
        for req_id in list(self._finished):
            if not all(f.done() for f in self._saves[req_id]):
                continue
            for f in self._saves.pop(req_id):
                if f.exception() is not None:
                    log.warning("kvoffload: save for %s failed: %r", req_id, f.exception())
            self._finished.discard(req_id)
            sent.add(req_id)
        self._save_batches.time_finished()
        return sent or None, received or None

    def _collect(self, job, futures, started: float) -> None:
        """Record a finished load: failed blocks for vLLM to recompute, and its wall time."""
        ended = started
        moved = 0
        for chunk, future in zip(job.chunks, futures):
            error = future.exception()
            if error is not None:
                log.warning("kvoffload: load for %s failed, recomputing: %r", job.req_id, error)
                self._failed_blocks.update(b for _, b in chunk.blocks)
                continue
            ok, finished_at = future.result()
            ended = max(ended, finished_at)
            if ok:
                moved += self._chunk_bytes(chunk)
            else:
                self._failed_blocks.update(b for _, b in chunk.blocks)
                with self._report_lock:
                    self._report.dropped.append(chunk.key)
        self.counters.add("load_wall_seconds", self._loads_busy.add(started, ended))
        self.timeline.mark("load_read", job.req_id, t=ended, started=started, bytes=moved, chunks=len(job.chunks))
        with self._report_lock:
            self._report.loaded.append(job.req_id)
            if moved:
                self._report.loads.append((float(moved), ended - started))
        if moved:
            self._idle_wait.observe(moved, ended - started)
            self.counters.observe("load_duration_seconds", ended - started)
            self.counters.observe("load_size_bytes", moved)

    def _chunk_bytes(self, chunk) -> int:
        return self.layout.file_bytes_for(self._blocks_in(chunk))

    def _blocks_in(self, chunk) -> int:  # the blocks its file holds
        return chunk.count or self.layout.blocks

    def worker_meta(self) -> KVOffloadWorkerMeta | None:
        """What happened since the last step, for the index and the online bandwidth estimate."""
        with self._report_lock:
            report, self._report = self._report, KVOffloadWorkerMeta()
        if not (report.loads or report.loaded or report.stored or report.store_failed or report.dropped):
            return None
        return report

    def block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        if failed:
            self.counters.add("blocks_load_failed", len(failed))
        return failed

    # -- I/O threads ------------------------------------------------------------------------------------
    def _io_pool(self, name: str, threads: int) -> ThreadPoolExecutor:
        way, cpus = ("load", self.config.load_cpus) if name == LOAD_THREADS else ("save", self.config.save_cpus)
        return ThreadPoolExecutor(threads, name, initializer=start_io_thread,
                                  initargs=(name, way, cpus, self.config.io_slice_us, self.counters))

    def _views(self, buffer: np.ndarray, blocks: int) -> torch.Tensor:
        """The payload of a chunk buffer holding `blocks` blocks as [layers, blocks, *block_shape] in the
        cache's dtype."""
        payload = torch.from_numpy(self.store.payload_view(buffer, blocks))
        return payload.view(self.dtype).view(self.layout.layers, blocks, *self.block_shape)

    def _buffer(self):
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = pinned_buffer(self.layout.file_bytes) if self._cuda else self.store.new_buffer()
        return buffer

    def _thread_stream(self):
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.device)
        return stream

    def _load_chunk(self, chunk, not_before: float = 0.0) -> tuple[bool, float]:
        """Read one chunk and scatter its blocks into the cache (load_io=threads); (ok, when it finished)."""
        delay = not_before - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        buffer, count = self._buffer(), self._blocks_in(chunk)
        ok = self.store.read(chunk.key, buffer, count, used=len(chunk.blocks), io_slot=self._read_slots,
                             use=self._scatter_for(chunk, buffer, count))
        return ok, time.perf_counter()

    def _scatter_for(self, chunk, buffer: np.ndarray, count: int):
        """The scatter of `chunk`'s blocks from `buffer`, run by the store before the checksum: a damaged
        chunk's blocks are then reported failed (_collect) and recomputed."""
        def scatter() -> None:
            src = self.loaded(self._views(buffer, count), chunk)
            self._scatter(src, [i for i, _ in chunk.blocks], [b for _, b in chunk.blocks])
        return scatter

    def _scatter(self, src: torch.Tensor, index: list[int], ids: list[int]) -> None:
        if self._cuda:
            # A chunk's blocks are loaded as one run (the prefix ends inside the chunk): a slice, not a gather.
            contiguous = index == list(range(index[0], index[0] + len(index)))
            rows = src[:, index[0]:index[0] + len(index)] if contiguous else src[:, index]
            stream = self._thread_stream()
            with torch.cuda.stream(stream):
                dst_ids = torch.tensor(ids, device=self.device)
                for layer, blocks in zip(self.layers, rows):
                    layer.index_copy_(0, dst_ids, blocks.to(self.device, non_blocking=True))
            # The request is reported loaded only after this, so its first forward reads complete blocks.
            stream.synchronize()
            return
        copy_runs(self.layers, self.stacked, src, index, ids, into_cache=True)

    def _gather_now(self, job: SaveJob) -> np.ndarray | None:
        """Gather and seal a chunk on the calling (step's) thread into a held buffer; None past the bound."""
        buffer = self.step_buffers.take()
        if buffer is not None:
            self._gather(job, None, buffer)
        return buffer

    def _save(self, job: SaveJob, ready, submitted: float, first: bool,
              gathered: np.ndarray | None = None) -> tuple[bool, float, int]:
        """Write one chunk file: (written, when it finished, its bytes)."""
        # From the step's submission to this thread taking the chunk: the queue behind the other chunks,
        # and, where the engine's threads hold every core (the CPU build), waiting to be scheduled at all;
        # the first chunk of a step's saves waits for the second alone (when no earlier saves are queued).
        waited = time.perf_counter() - submitted
        self.counters.add("save_wait_seconds", waited)
        if first:
            self.counters.add("save_first_wait_seconds", waited)
            self.counters.add("save_batches")
        written, buffer = False, gathered
        size = self.layout.file_bytes_for(len(job.block_ids))
        try:
            if buffer is None:
                buffer = self._buffer()
                self._gather(job, ready, buffer)
            written = self.store.write(job.key, buffer, job.first_block, job.block_keys, sealed=True)
        finally:
            if gathered is not None:
                self.step_buffers.give_back(gathered)
            # Reported either way, or the index would hold the chunk as "being stored" for ever.
            with self._report_lock:
                (self._report.stored if written else self._report.store_failed).append(
                    (job.key, size, job.generation))
        return written, time.perf_counter(), size

    def _gather(self, job: SaveJob, ready, buffer: np.ndarray) -> None:
        """Copy the chunk's blocks of every layer from the cache into `buffer`'s payload, then seal it (store.seal)."""
        started = time.perf_counter()
        dst = self._views(buffer, len(job.block_ids))
        if self._cuda:
            stream = self._thread_stream()
            with torch.cuda.stream(stream):
                # Not before this step's forward has written the blocks (recorded on the engine's stream).
                stream.wait_event(ready)
                ids = torch.tensor(job.block_ids, device=self.device)
                for i, layer in enumerate(self.layers):
                    dst[i].copy_(layer.index_select(0, ids), non_blocking=True)  # into pinned memory
            stream.synchronize()
        else:
            copy_runs(self.layers, self.stacked, dst, range(len(job.block_ids)), job.block_ids, into_cache=False)
        # The gather's share of a save, beside save_seconds (the file write): where a slow save's time goes.
        self.counters.add("save_copy_seconds", time.perf_counter() - started)
        self.store.seal(job.key, buffer, job.first_block, job.block_keys)

    def shutdown(self) -> None:
        self.load_pool.shutdown(wait=True, cancel_futures=False)
        if self._aio is not None:
            self._aio_pool.shutdown(wait=True, cancel_futures=False)
            self._aio.close()
        if self.read_ahead is not None:
            self.read_ahead.shutdown()
        self.save_pool.shutdown(wait=True, cancel_futures=False)
        if self.store is not None:
            self.store.drop_free()

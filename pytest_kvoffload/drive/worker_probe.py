"""The connector's own save and load paths with no engine beside them.

A connector WorkerSide over a CPU KV cache of the model's geometry, in this process, fed a step's saves at
a time as vLLM feeds it (wait_for_save, then get_finished until they are done), with `gap_s` of nothing
between steps, then the chunks loaded back a load at a time, and timed by its own counters (bytes over
the union of the steps' walls, as in a server). Every line of those paths runs: the in-step gather, the
I/O threads with their options, the store's recycled files, the checked reads and scatters. Against the drive alone in the same bursts (probe.probe_disk_bursts) it is
what the connector's code costs; the connector in a server against it is what sharing the machine with
the engine costs.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from pytest_kvoffload.connector.config import ConnectorConfig
from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob, SaveJob
from pytest_kvoffload.connector.worker import WorkerSide
from pytest_kvoffload.drive.probe import remove_store
from pytest_kvoffload.drive.rate import Rate, Rates


@dataclass
class WorkerBurstResult(Rates):
    path: str
    file_bytes: int
    burst: int
    gap_s: float
    threads: int
    over_share: float  # of the timed chunks written over free files
    write: Rate
    read_burst: int = 0  # chunks a load: the written chunks read back once, that many a step; 0: not
    read: Rate = Rate()

    def describe(self) -> str:
        read = f"; read {self.read.describe()} in loads of {self.read_burst} chunks" if self.read_burst else ""
        return (f"write {self.write.describe()} in "
                f"bursts of {self.burst} chunks, {self.over_share:.0%} over free files{read}, "
                f"{self.gap_s * 1e3:.0f} ms apart, {self.threads} I/O thread(s)")


# A torch dtype of each KV element size: only the bytes matter to the save path (fp8 KV as one-byte ints).
DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}


def cpu_cache(layers: int, blocks: int, block_size: int, kv_bytes_per_token: int, element_bytes: int) -> dict:
    """Per layer [blocks, K and V, block_size, the rest of a token's KV]: the CPU build's block-first layout,
    a chunk file of the model's size, every layer a view of one allocation, layer after layer, as vLLM's
    allocate_kv_cache makes them (so the worker's one-copy path runs, as in a server)."""
    per_token = kv_bytes_per_token // layers // 2 // element_bytes
    every = torch.randn(layers, blocks, 2, block_size, per_token).to(DTYPES[element_bytes])
    return {f"layer{i}": every[i] for i in range(layers)}


def wait_done(side: WorkerSide, req_id: str, loading: bool, deadline_s: float = 60.0) -> None:
    """Until the worker reports `req_id`'s saves (or load) done, as vLLM learns it (get_finished)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        sent, received = side.get_finished(set() if loading else {req_id})
        if req_id in ((received if loading else sent) or ()):
            return
        time.sleep(0.005)  # coarse: the figures come from the I/O threads' own end times; a tight poll
        # would take the core the I/O threads are bound to
    raise TimeoutError(f"worker probe: the {'load' if loading else 'saves'} of {req_id} did not finish within "
                       f"{deadline_s:g} s")


def probe_worker_bursts(folder: str | Path, extra: dict, layers: int, block_size: int, kv_bytes_per_token: int,
                        element_bytes: int, burst: int, gap_s: float, total_bytes: int = 32 << 20,
                        repeats: int = 3, over_share: float = 0.0, cpus: set[int] | None = None,
                        read_burst: int = 0) -> WorkerBurstResult:
    """`burst` chunks a step, steps `gap_s` apart, through the connector's WorkerSide configured by `extra`
    (the server's connector options; its store folder is replaced by one under `folder`, removed after).
    `over_share` of the timed chunks go over free files (the store keeps removed chunks' files); where
    `read_burst`, the chunks written are then loaded back once, that many a load (start_load_kv, then
    get_finished), timed by the worker's load counters.
    `cpus`: the calling thread, and so the I/O threads it starts, bound there, as vLLM's CPU build binds
    its worker (the connector's threads inherit that binding)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"probe worker: {folder} is not a folder; pass the folder on the drive to measure")
    burst = max(1, burst)
    saved_affinity = os.sched_getaffinity(0) if cpus else None
    saved_torch_threads = torch.get_num_threads()
    writes: list[float] = []
    reads: list[float] = []
    threads = 0
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
            # As vLLM's CPU worker sets it: one torch thread per bound core. More (this process's default is
            # one per core of the machine) leave OpenMP threads spinning on the I/O threads' core after each
            # gather and scatter: on the 2-core VM 1.4 GB/s of reads where one thread gets 1.7.
            torch.set_num_threads(len(cpus))
        for n in range(repeats):
            root = folder / f".kvoffload-worker-probe-{os.getpid()}-{n}"
            config = ConnectorConfig.from_extra({**extra, "store_dir": str(root)}, block_size)
            threads = config.io_threads
            per_chunk = max(1, config.chunk_tokens // block_size)
            side = WorkerSide(config, "probe", root, block_size)
            side.register_kv_caches(cpu_cache(layers, max(burst, read_burst) * per_chunk, block_size, kv_bytes_per_token,
                                            element_bytes))
            bursts = max(1, total_bytes // (burst * side.layout.file_bytes))
            try:
                def step(req_id: str, keys: list[str]) -> None:
                    side.wait_for_save(KVOffloadMetadata(saves=[
                        SaveJob(req_id, key, list(range(i * per_chunk, (i + 1) * per_chunk)), i)
                        for i, key in enumerate(keys)]))
                    wait_done(side, req_id, loading=False)
                    side.worker_meta()  # the report the scheduler would take, dropped

                # Free files first, as the rounds left them: chunks written, then removed by the index.
                free = [uuid.uuid4().hex for _ in range(round(over_share * bursts * burst))]
                for first in range(0, len(free), burst):
                    step(f"free-{first}", free[first:first + burst])
                side.start_load_kv(KVOffloadMetadata(deletes=free))
                side.counters.drain()
                timed = [uuid.uuid4().hex for _ in range(bursts * burst)]
                for first in range(0, len(timed), burst):
                    step(f"burst-{first}", timed[first:first + burst])
                    time.sleep(gap_s)
                done = side.counters.drain()
                if not done.get("save_wall_seconds") or done.get("chunks_written", 0) < len(timed):
                    raise OSError(f"probe worker: chunk writes failed under {root}")
                writes.append(done["bytes_written"] / done["save_wall_seconds"] / 1e9)
                for first in range(0, len(timed), read_burst) if read_burst else ():
                    keys = timed[first:first + read_burst]
                    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob(f"load-{first}", [
                        ChunkBlocks(key, [(j, c * per_chunk + j) for j in range(per_chunk)])
                        for c, key in enumerate(keys)])]))
                    wait_done(side, f"load-{first}", loading=True)
                    side.worker_meta()
                    time.sleep(gap_s)
                if read_burst:
                    done = side.counters.drain()
                    if not done.get("load_wall_seconds") or done.get("chunks_read", 0) < len(timed):
                        raise OSError(f"probe worker: chunk reads failed under {root}")
                    reads.append(done["bytes_read"] / done["load_wall_seconds"] / 1e9)
            finally:
                side.shutdown()
                remove_store(side.store)
    finally:
        if saved_affinity:
            os.sched_setaffinity(0, saved_affinity)
        torch.set_num_threads(saved_torch_threads)
    return WorkerBurstResult(str(folder), side.layout.file_bytes, burst, gap_s, threads, over_share,
                             Rate.of(writes), read_burst, Rate.of(reads))

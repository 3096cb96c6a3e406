"""What the scheduler half tells the worker half each step, and what the workers report back (pickled
across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ChunkBlocks:
    """Blocks to load from one chunk file: (position of the block in the file, the engine's block id)."""

    key: str
    blocks: list[tuple[int, int]]
    count: int | None = None  # blocks the file holds (None: a whole chunk)


@dataclass
class LoadJob:
    req_id: str
    chunks: list[ChunkBlocks]
    sync: bool = False  # load before this step's forward instead of while the request waits


@dataclass
class SaveJob:
    req_id: str
    key: str  # the file's: its last block's key
    block_ids: list[int]  # the engine's ids of every block the file holds, in order
    first_block: int = 0  # the position of its first block in the prompt (recorded in the file header)
    generation: int = 0  # the index's generation when announced (index.ChunkIndex.reset)
    block_keys: list[str] | None = None  # each block's key (None: the file is one unit keyed by `key`)


@dataclass
class ReadAheadJob:
    """Chunk files to read ahead for a request still queued (read_ahead_mb: read_ahead.py), as (file key, blocks
    the file holds); `arrived` its arrival (time.time()), from which the first read's delay is counted."""

    req_id: str
    chunks: list[tuple[str, int]]
    arrived: float = 0.0


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Decided by the index (index.ChunkIndex): remove every file (a reset), then these chunks' files
    # (evicted or found damaged), before this step's loads and saves.
    clear: bool = False
    deletes: list[str] = field(default_factory=list)
    # No token is computed this step (vLLM still runs it, to poll the connector): the worker may wait for a
    # load in flight instead of returning at once (worker.WorkerSide.get_finished).
    idle: bool = False
    # Reads ahead for queued requests, and the requests whose read-ahead no load will take (read_ahead.py).
    read_aheads: list[ReadAheadJob] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    step: int = 0  # the scheduler's count of steps, for the timeline (timeline.py)


@dataclass
class KVOffloadWorkerMeta(KVConnectorWorkerMetadata):
    """What the worker half tells the scheduler half after a step.

    loads: (bytes, wall seconds) of each finished load, for the online bandwidth estimate;
    loaded: requests whose load finished (well or not), so the index unpins their chunks;
    stored / store_failed: (key, file bytes, generation) of each write that finished or was declined;
    dropped: keys whose file was missing or damaged at load, for the index to forget.
    """

    loads: list[tuple[float, float]] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    stored: list[tuple[str, int, int]] = field(default_factory=list)
    store_failed: list[tuple[str, int, int]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def aggregate(self, other: "KVOffloadWorkerMeta") -> "KVOffloadWorkerMeta":
        for name in ("loads", "loaded", "stored", "store_failed", "dropped"):
            getattr(self, name).extend(getattr(other, name, []))
        return self

"""What the scheduler half tells the worker half each step (pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ChunkBlocks:
    """Blocks of one stored chunk: (index of the block within the chunk, the engine's block id)."""

    key: str
    blocks: list[tuple[int, int]]


@dataclass
class LoadJob:
    req_id: str
    chunks: list[ChunkBlocks]
    sync: bool = False  # load before this step's forward instead of while the request waits


@dataclass
class SaveJob:
    req_id: str
    key: str
    block_ids: list[int]  # every block of the chunk, in order
    index: int = 0  # the chunk's position in the prompt (recorded in the file header)


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class KVOffloadWorkerMeta(KVConnectorWorkerMetadata):
    """What the worker half tells the scheduler half: (bytes, wall seconds) of each finished load."""

    loads: list[tuple[float, float]] = field(default_factory=list)

    def aggregate(self, other: "KVOffloadWorkerMeta") -> "KVOffloadWorkerMeta":
        self.loads.extend(getattr(other, "loads", []))
        return self

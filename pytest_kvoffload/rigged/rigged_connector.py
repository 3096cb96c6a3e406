"""RiggedKVOffloadConnector: the product connector with the rig's options read apart, its worker on an
emulated drive with planted faults, and its admission rule possibly planted (knobs.py has the options)."""

from __future__ import annotations

import torch

from pytest_kvoffload.connector.config import ConnectorConfig
from pytest_kvoffload.connector.connector import KVOffloadDiskConnector
from pytest_kvoffload.connector.store import ChunkStore
from pytest_kvoffload.connector.worker import WorkerSide
from pytest_kvoffload.rigged.emulated_drive import PacedChunkStore
from pytest_kvoffload.rigged.knobs import Rig, split
from pytest_kvoffload.rigged.planted_admission import rule
from pytest_kvoffload.rigged.planted_kv import planted, stale_block


class RiggedWorkerSide(WorkerSide):
    def __init__(self, config: ConnectorConfig, rig: Rig, *args) -> None:
        self.rig = rig
        self.read_delay_s = rig.read_latency_s
        self._faults = 0  # loads with a planted fault
        self._stale_in: set[str] = set()  # fault "stale": the first chunk of each load, which gets one stale block
        self._stale: torch.Tensor | None = None  # a block kept from an earlier load
        super().__init__(config, *args)

    def start_load_kv(self, meta) -> None:
        if self.rig.fault == "stale":
            self._stale_in.update(job.chunks[0].key for job in meta.loads if job.chunks)
        super().start_load_kv(meta)

    def new_store(self, layout_text: str) -> ChunkStore:
        return PacedChunkStore(self.store_root, layout_text, self.layout, self.config.direct_io, self.counters,
                               huge_pages=self.config.huge_pages, read_bytes_per_s=self.rig.read_bytes_per_s)

    def loaded(self, src: torch.Tensor, chunk) -> torch.Tensor:
        if not self.rig.fault:
            return src
        if self.rig.fault == "stale":
            first = chunk.blocks[0][0]
            earlier, self._stale = self._stale, src[:, first:first + 1].clone()
            if chunk.key not in self._stale_in:
                return src
            self._stale_in.discard(chunk.key)
            self._faults += 1
            return stale_block(src, first, earlier)
        self._faults += 1
        return planted(src, self.rig.fault, self._faults)


class RiggedKVOffloadConnector(KVOffloadDiskConnector):
    def read_config(self, extra: dict, block_size: int) -> ConnectorConfig:
        config, self.rig = split(extra, block_size)
        return config

    def new_worker(self, store_root, block_size: int):
        return RiggedWorkerSide(self.config, self.rig, self.fingerprint, store_root, block_size)

    def new_admission(self, tier: dict, kv_bytes_per_token: int):
        return rule(tier, kv_bytes_per_token, self._scheduler_counters, self.rig.admission)

"""vLLM's own KV offloading on the CPU platform: its specs, with a copy worker that needs no CUDA.

vLLM's `CPUOffloadingSpec.get_worker` refuses a CPU platform because its worker moves blocks with
CUDA streams, events and copy kernels (`vllm/v1/kv_offload/cpu/gpu_worker.py`). Everything else (the
scheduler-side `OffloadingConnector`, `CPUOffloadingManager`, the tiering manager and its `fs` tier)
is platform-independent. The specs here inherit all of that unchanged and only swap the worker: the
same block-to-chunk mapping, done with plain array copies on one thread, in submission order, as
the CUDA worker's one-stream-after-another order. Only the copy differs from a GPU run.

vLLM loads these specs by name through `kv_connector_extra_config` (`spec_name` +
`spec_module_path`, `vllm/v1/kv_offload/factory.py`); `serve/builtin/vllm_offloading.py` picks them on a CPU platform.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

class PlatformError(RuntimeError):
    """The shim asked for where vLLM's own worker applies (a GPU platform)."""


def refuse_gpu_platform(spec: str) -> None:
    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        raise PlatformError(f"{spec} is for vLLM's CPU platform; on {current_platform.device_name} "
                            f"use vLLM's own spec (CPUOffloadingSpec / TieringOffloadingSpec)")


def _rows(tensor: torch.Tensor) -> np.ndarray:
    """A (rows, bytes) int8 tensor as a numpy view with the same strides: numpy's fancy indexing
    copies without OpenMP, so the copy thread does not start a second thread team beside the
    engine's."""
    return tensor.detach().numpy()


@dataclass(frozen=True)
class BlockCopy:
    """Which rows move: engine block rows, and (chunk, sub-block) positions in the offload tensors."""

    engine_rows: np.ndarray
    chunk_ids: np.ndarray
    sub_ids: np.ndarray


def plan_copy(engine_blocks: np.ndarray, chunk_blocks: np.ndarray, group_sizes, block_indices,
              blocks_per_chunk: int) -> list[BlockCopy]:
    """One BlockCopy per KV cache group, the mapping vLLM's CUDA worker computes as pointers.

    A chunk holds `blocks_per_chunk` engine blocks. A group's first engine block may sit inside a
    chunk (its logical index `block_indices[g]` not a multiple of the chunk), so that many sub-blocks
    of the group's first chunk are skipped; its last chunk may be partly used.
    """
    copies = []
    engine_offset = chunk_offset = 0
    for size, index in zip(group_sizes, block_indices):
        if size == 0:
            continue
        skip = index % blocks_per_chunk
        num_chunks = -(-(size + skip) // blocks_per_chunk)
        chunks = np.asarray(chunk_blocks[chunk_offset:chunk_offset + num_chunks], dtype=np.int64)
        if len(chunks) != num_chunks or engine_offset + size > len(engine_blocks):
            raise ValueError(f"transfer spec mismatch: {size} blocks from index {index} need "
                             f"{num_chunks} chunks, got {len(chunks)}")
        positions = np.arange(skip, skip + size)
        copies.append(BlockCopy(
            engine_rows=np.asarray(engine_blocks[engine_offset:engine_offset + size], dtype=np.int64),
            chunk_ids=chunks[positions // blocks_per_chunk],
            sub_ids=positions % blocks_per_chunk,
        ))
        engine_offset += size
        chunk_offset += num_chunks
    if engine_offset != len(engine_blocks) or chunk_offset != len(chunk_blocks):
        raise ValueError(f"transfer spec mismatch: {len(engine_blocks)} engine blocks and "
                         f"{len(chunk_blocks)} chunks, used {engine_offset} and {chunk_offset}")
    return copies


class CopyWorker(OffloadingWorker):
    """Moves blocks between the engine's KV cache and the offload tensors, on one thread.

    `engine` tensors are (num_blocks, page_bytes) int8 views of the KV cache; `offload` tensors
    (num_chunks, page_bytes * blocks_per_chunk) int8, possibly row-strided (vLLM's shared region
    interleaves ranks in a row). Jobs run in submission order and are reported finished in that
    order, as the CUDA worker's events are queried.
    """

    def __init__(self, engine: list[torch.Tensor], offload: list[torch.Tensor],
                 group_refs: list[list[CanonicalKVCacheRef]], blocks_per_chunk: int):
        if len(engine) != len(offload):
            raise ValueError(f"{len(engine)} engine tensors but {len(offload)} offload tensors")
        self.blocks_per_chunk = blocks_per_chunk
        self.group_refs = group_refs
        self.engine = [_rows(t) for t in engine]
        self.offload = []
        for e, o in zip(self.engine, offload):
            page = e.shape[1]
            if o.shape[1] != page * blocks_per_chunk:
                raise ValueError(f"offload chunk of {o.shape[1]} bytes is not {blocks_per_chunk} pages "
                                 f"of {page}")
            rows = _rows(o)
            # (chunk, sub-block, byte): a sub-block is one engine page inside the chunk's row.
            self.offload.append(np.lib.stride_tricks.as_strided(
                rows, shape=(rows.shape[0], blocks_per_chunk, page),
                strides=(rows.strides[0], page, 1), writeable=True))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")
        self._jobs: deque[tuple[int, Future]] = deque()
        self._lock = threading.Lock()

    def _copy(self, copies: list[BlockCopy], to_engine: bool) -> tuple[int, float]:
        start = time.perf_counter()
        moved = 0
        for copy, refs in zip(copies, self.group_refs):
            for ref in refs:
                size = ref.page_size_bytes
                engine, offload = self.engine[ref.tensor_idx], self.offload[ref.tensor_idx]
                if to_engine:
                    engine[copy.engine_rows, :size] = offload[copy.chunk_ids, copy.sub_ids, :size]
                else:
                    offload[copy.chunk_ids, copy.sub_ids, :size] = engine[copy.engine_rows, :size]
                moved += len(copy.engine_rows) * size
        return moved, time.perf_counter() - start

    def _submit(self, job_id: int, engine_spec: GPULoadStoreSpec, chunk_spec: LoadStoreSpec,
                to_engine: bool) -> bool:
        if not isinstance(chunk_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"cannot copy to or from {type(chunk_spec).__name__}")
        copies = plan_copy(engine_spec.block_ids, chunk_spec.block_ids, engine_spec.group_sizes,
                           engine_spec.block_indices, self.blocks_per_chunk)
        with self._lock:
            self._jobs.append((job_id, self._executor.submit(self._copy, copies, to_engine)))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, to_engine=False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, dst_spec, src_spec, to_engine=True)

    def get_finished(self) -> list[TransferResult]:
        results = []
        with self._lock:
            while self._jobs and self._jobs[0][1].done():
                job_id, future = self._jobs.popleft()
                error = future.exception()
                if error is not None:
                    results.append(TransferResult(job_id=job_id, success=False))
                    continue
                size, seconds = future.result()
                results.append(TransferResult(job_id=job_id, success=True, transfer_size=size,
                                              transfer_time=seconds))
        return results

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            pending = [future for job_id, future in self._jobs if job_id in job_ids]
        for future in pending:
            future.exception()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def engine_tensors(kv_caches: CanonicalKVCaches) -> list[torch.Tensor]:
    """The KV cache as (num_blocks, page_bytes) int8 rows, as vLLM's CUDA worker views it."""
    return [t.tensor.view(torch.int8).view((-1, t.page_size_bytes)) for t in kv_caches.tensors]


def refuse_canonical_layout(spec: CPUOffloadingSpec) -> None:
    if getattr(spec.config, "canonical_layout", False):
        raise PlatformError("canonical_layout is not supported by the CPU-platform copy worker; "
                            "remove it from kv_connector_extra_config")



class CPUPlatformOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU memory tier (native-cpu) with the CPU-platform copy worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        refuse_gpu_platform(type(self).__name__)
        refuse_canonical_layout(self)
        if self._worker is None:
            engine = engine_tensors(kv_caches)
            offload = [torch.zeros((self.num_chunks, t.shape[1] * self.blocks_per_chunk), dtype=torch.int8)
                       for t in engine]
            self._worker = CopyWorker(engine, offload, kv_caches.group_data_refs, self.blocks_per_chunk)
        return self._worker


class CPUPlatformTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering (CPU tier plus secondary tiers such as `fs`: native-disk) with the copy worker.

    The CPU tier must be vLLM's shared region: the scheduler-side tier managers read and write the
    same memory (its rank-less view) when they move chunks to and from files.
    """

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        refuse_gpu_platform(type(self).__name__)
        refuse_canonical_layout(self)
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk, cpu_page_size=self.cpu_page_size_per_worker)
            engine = engine_tensors(kv_caches)
            offload = [region.create_next_worker_view(t.shape[1] * self.blocks_per_chunk) for t in engine]
            self._worker = RegionCopyWorker(engine, offload, kv_caches.group_data_refs,
                                            self.blocks_per_chunk, region)
        return self._worker


class RegionCopyWorker(CopyWorker):
    """A CopyWorker over vLLM's shared region, which it releases on shutdown."""

    def __init__(self, engine, offload, group_refs, blocks_per_chunk: int, region: SharedOffloadRegion):
        self.region = region
        try:
            super().__init__(engine, offload, group_refs, blocks_per_chunk)
        except Exception:
            region.cleanup()
            raise

    def shutdown(self) -> None:
        super().shutdown()
        self.engine.clear()
        self.offload.clear()
        self.region.cleanup()

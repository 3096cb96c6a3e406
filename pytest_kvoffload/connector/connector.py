"""KVOffloadDiskConnector: the class vLLM loads; it hands each call to the scheduler or worker half."""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from pytest_kvoffload.core.vllm_releases import cache_hit_source, installed
from pytest_kvoffload.core.calibration import check_fingerprint, machine_fingerprint, read_calibration, tier_entry
from pytest_kvoffload.connector.admission_rule import FIXED_MODES, Admission, FixedAdmission
from pytest_kvoffload.connector.config import ConnectorConfig
from pytest_kvoffload.connector.hashing import key_root
from pytest_kvoffload.connector.metadata import KVOffloadMetadata
from pytest_kvoffload.connector.scheduler import SchedulerSide
from pytest_kvoffload.connector.prom import KVOffloadPromMetrics, KVOffloadStats
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.connector.index import ChunkIndex
from pytest_kvoffload.connector.io_memory import padded
from pytest_kvoffload.connector.chunk_format import HEADER_SIZE
from pytest_kvoffload.connector.timeline import NoTimeline, timeline_for

log = logging.getLogger("pytest_kvoffload.connector")


def fingerprint(vllm_config, chunk_tokens: int) -> str:
    """Everything that makes stored KV unusable by another server: model, dtypes, geometry, platform."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    parts = [
        f"model={model.model}",
        f"dtype={model.dtype}",
        f"kv_dtype={cache.cache_dtype}",
        f"block={cache.block_size}",
        f"chunk={chunk_tokens}",
        f"layers={model.get_num_layers(parallel)}",
        f"kv_heads={model.get_num_kv_heads(parallel)}",
        f"head={model.get_head_size()}",
        f"tp={parallel.tensor_parallel_size}",
        f"platform={current_platform.device_type}",
        # Weight identity beyond the path: dummy and real weights in one folder give different KV.
        f"load={vllm_config.load_config.load_format}",
        f"quant={model.quantization}",
        f"revision={model.revision}",
    ]
    return "|".join(parts)


def server_fingerprint(vllm_config, store_dir) -> dict:
    """This server's values of the fields a calibration file must match (calibration.CHECKED)."""
    import torch
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    served = model.served_model_name
    name = served[0] if isinstance(served, (list, tuple)) else served
    dtype = model.dtype if cache.cache_dtype == "auto" else getattr(torch, str(cache.cache_dtype), model.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2
    kv_bytes = (model.get_num_layers(vllm_config.parallel_config) * 2 * model.get_total_num_kv_heads()
                * model.get_head_size() * itemsize)
    return {"model": name, "dtype": str(model.dtype).removeprefix("torch."), "kv_bytes_per_token": kv_bytes,
            "block_size": cache.block_size, "device": current_platform.device_type,
            **machine_fingerprint(store_dir, vllm_config.parallel_config.tensor_parallel_size)}


class KVOffloadDiskConnector(KVConnectorBase_V1):
    # Our hits count as "disk" where vLLM can name tiers (0.32 on), as external_kv_transfer on 0.31.
    _cache_hit_source = cache_hit_source("DISK")
    timeline = NoTimeline()  # the timeline option's, set in __init__ (timeline.py)

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        installed()  # a vLLM outside the declared range stops the server in one line (core/vllm_releases.py)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        block_size = vllm_config.cache_config.block_size
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = self.read_config(extra, block_size)
        self.fingerprint = fingerprint(vllm_config, self.config.chunk_tokens)
        chain_root = key_root(self.fingerprint)
        self._scheduler = None
        self._worker = None
        self._zeroes_blocks = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", True))
        self._deferred_saves: list = []  # the last step's saves, submitted at the next bind (wait_for_save)
        self._scheduler_counters = Counters()
        self._steps = 0  # the scheduler's, numbering each step's metadata for the timeline
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.timeline = timeline_for(self.config.timeline, side, str(self.config.store_dir))  # off: a no-op
        if role == KVConnectorRole.SCHEDULER:
            # Tensor-parallel ranks keep separate files of one key set; rank 0's folder seeds the index.
            root = self.config.store_dir / "rank0"
            root.mkdir(parents=True, exist_ok=True)
            index = ChunkIndex(root, self.config.capacity_bytes,
                               chunk_file_bytes(kv_cache_config, self.config.chunk_tokens // block_size),
                               self._scheduler_counters)
            log.info("kvoffload: index holds %d chunks from %s at start", len(index), root)
            self._scheduler = SchedulerSide(self.config, block_size, chain_root, index,
                                            admit=self._admission(vllm_config), counters=self._scheduler_counters)
        else:
            self._worker = self.new_worker(self.config.store_dir / f"rank{_tp_rank()}", block_size)
            self._worker.timeline = self.timeline

    # What the test-only connector (rigged/rigged_connector.py) replaces: the options it reads, its worker, its rule.
    def read_config(self, extra: dict, block_size: int) -> ConnectorConfig:
        return ConnectorConfig.from_extra(extra, block_size)

    def new_worker(self, store_root, block_size: int):
        from pytest_kvoffload.connector.worker import WorkerSide  # torch-heavy: the worker process only

        return WorkerSide(self.config, self.fingerprint, store_root, block_size)

    def new_admission(self, tier: dict, kv_bytes_per_token: int) -> Admission:
        return Admission(tier, kv_bytes_per_token, self._scheduler_counters, self.config.admission)

    def _admission(self, vllm_config) -> Admission | FixedAdmission | None:
        if self.config.admission in FIXED_MODES:
            log.info("kvoffload: admission %s: %s", self.config.admission,
                     "every load taken" if self.config.admission == "always" else "every load declined")
            return FixedAdmission(self.config.admission, self._scheduler_counters)
        if self.config.calibration is None:
            return None
        calibration = read_calibration(self.config.calibration)
        actual = server_fingerprint(vllm_config, self.config.store_dir)
        accepted = check_fingerprint(calibration, actual, self.config.calibration, self.config.calibration_mismatch)
        if accepted:
            log.warning("kvoffload: calibration %s measured elsewhere, accepted (calibration_mismatch=accept): %s",
                        self.config.calibration, "; ".join(accepted))
        tier = tier_entry(calibration)
        log.info("kvoffload: %s admission rule from %s: %s GB/s, fixed %.1f ms, margin %.0f%%: loads taken from a "
                 "%s-token prefix (hits pay from %s)", self.config.admission, self.config.calibration,
                 tier.get("bandwidth_gbps"), 1e3 * tier.get("fixed_s", 0.0), 100 * (tier.get("margin") or 0.0),
                 tier.get("enforced_break_even_prefix_tokens"), tier.get("break_even_prefix_tokens"))
        return self.new_admission(tier, actual["kv_bytes_per_token"])

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a dropped save is just a later miss.
        return False

    # -- worker side --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM starts asynchronous loads after the forward (start_load_kv); on the CPU build that waits for
        # the whole step. Binding happens before the forward: start the loads here, so they run beside it.
        # Not where new blocks are zeroed during the step (Mamba, mixed precision): a load could race it.
        if self._worker is not None and not self._zeroes_blocks:
            assert isinstance(connector_metadata, KVOffloadMetadata)
            # The last step's saves first, in the order they had when submitted in that step: before this
            # step's deletions (a reset waits for them), loads and forward (which may write their blocks anew).
            saves, self._deferred_saves = self._deferred_saves, []
            self._mark_bind(connector_metadata)
            if saves:
                self._worker.wait_for_save(KVOffloadMetadata(saves=saves))
                self.timeline.mark("saves_gathered", step=connector_metadata.step, chunks=len(saves))
            self._worker.start_load_kv(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._zeroes_blocks:
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVOffloadMetadata)
            self._mark_bind(meta)
            self._worker.start_load_kv(meta)

    def _mark_bind(self, meta: KVOffloadMetadata) -> None:
        if self.timeline.on:  # a step's start, with the loads it hands over (timeline.py)
            self.timeline.mark("bind", step=meta.step, loads=[job.req_id for job in meta.loads])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        # Saves copy whole chunks from the registered caches after the step (wait_for_save).
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVOffloadMetadata)
        if self.timeline.on:
            self.timeline.mark("forward_end", step=meta.step, saves=sorted({job.req_id for job in meta.saves}))
        if self._zeroes_blocks or self._worker.step_buffers is None:
            self._worker.wait_for_save(meta)
            return
        # The CPU build: submitted, so gathered and sealed, at the next step's bind, as vLLM's OffloadingConnector
        # defers its stores. vLLM calls this before the step samples: a gather here delays the step's tokens (a
        # prompt's first) by the gather and seal of every chunk it saves. A finished request's blocks are held
        # until its saves are written (request_finished), and nothing writes blocks before the next forward.
        self._deferred_saves.extend(meta.saves)

    def get_finished(self, finished_req_ids):
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        ours = isinstance(meta, KVOffloadMetadata)
        sent, received = self._worker.get_finished(finished_req_ids, idle=ours and meta.idle)
        if self.timeline.on:
            self.timeline.mark("step_end", step=meta.step if ours else None, loaded=sorted(received or ()),
                               saved=sorted(sent or ()))
            self.timeline.flush()
        return sent, received

    def build_connector_worker_meta(self):
        return self._worker.worker_meta() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.block_ids_with_load_errors() if self._worker else set()

    def get_kv_connector_stats(self):
        counters = self._worker.counters if self._worker is not None else self._scheduler_counters
        data = counters.drain()
        return KVOffloadStats(data=data) if data else None

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        self.timeline.close()

    # -- scheduler side -------------------------------------------------------------------------------
    def on_new_request(self, request) -> None:  # vLLM 0.32 on; an older vLLM never calls it
        self.timeline.mark("arrived", request.request_id, prompt=len(request.prompt_token_ids or ()))
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        found = self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        self.timeline.mark("lookup", request.request_id, computed=num_computed_tokens, load=found[0],
                           prompt=len(request.prompt_token_ids or ()))
        return found

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            self.timeline.mark("load_planned", request.request_id, tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = self._scheduler.build_connector_meta(scheduler_output)
        meta.step, self._steps = self._steps, self._steps + 1
        if self.timeline.on:
            self.timeline.mark("step", step=meta.step, scheduled=scheduled_tokens(scheduler_output))
            self.timeline.flush()
        return meta

    def update_connector_output(self, connector_output):
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        self.timeline.mark("finished", request.request_id)
        return self._scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler else None

    # -- metrics ----------------------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KVOffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (single process): rank 0
        return 0


def scheduled_tokens(scheduler_output) -> dict[str, list[int]]:
    """req_id -> [tokens computed before the step, tokens it computes], for the timeline."""
    before = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {req: [before.get(req, 0), n] for req, n in scheduler_output.num_scheduled_tokens.items() if n}


def chunk_file_bytes(kv_cache_config, blocks_per_chunk: int) -> int | None:
    """One chunk file's size from the engine's KV geometry, for the index's first capacity checks (the
    workers report the real size with every write); None where the config does not say."""
    try:
        per_block = sum(len(group.layer_names) * group.kv_cache_spec.page_size_bytes
                        for group in kv_cache_config.kv_cache_groups)
    except (AttributeError, TypeError):
        return None
    return HEADER_SIZE + padded(blocks_per_chunk * per_block) if per_block else None

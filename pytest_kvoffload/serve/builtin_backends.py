"""The built-in backends (docs/backends.md): gpu-only, native-cpu, native-disk, lmcache-disk, kvoffload-disk
and lmcache-inproc-disk (CUDA only), each its server's command line, how its tier is emptied and how a load
from it is proved."""

from __future__ import annotations

import json
from pathlib import Path

from pytest_kvoffload.connector.config import OPTIONS as CONNECTOR_OPTIONS
from pytest_kvoffload.connector.config import default_chunk_tokens
from pytest_kvoffload.core import machine
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.serve import lmcache
from pytest_kvoffload.serve.backends import (CPU_PLATFORM_SPEC_MODULE, CPU_PLATFORM_SPECS, Backend, BackendRegistry,
                                             LaunchContext, ServerSpec)


def kvoffload_chunk_tokens(settings: Settings) -> int:
    """Tokens of one of the connector's chunk files (its option chunk_tokens): the unit it writes and reads,
    not the unit it matches (one KV block)."""
    configured = settings.disk_opts.get("chunk_tokens")
    return int(configured) if configured else default_chunk_tokens(settings.block_size)


def kvoffload_store_dir(ctx: LaunchContext) -> Path:
    """The connector's store: --kv-disk-opt store_dir=... (the drive under test), else the run's scratch."""
    configured = ctx.settings.disk_opts.get("store_dir")
    return Path(configured) if configured else ctx.scratch / "kv-store"


def _kvoffload_disk(ctx: LaunchContext) -> ServerSpec:
    extra = {"chunk_tokens": kvoffload_chunk_tokens(ctx.settings), "capacity_gb": ctx.settings.disk_gb}
    extra.update(ctx.settings.disk_opts)
    extra["store_dir"] = str(kvoffload_store_dir(ctx))
    config = {
        "kv_connector": "KVOffloadDiskConnector",
        "kv_connector_module_path": "pytest_kvoffload.connector",
        "kv_role": "kv_both",
        # A damaged or vanished chunk must cost a recompute, never the request (vLLM's default is "fail").
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    return ServerSpec(args=["--kv-transfer-config", json.dumps(config)])


# kv_connector_extra_config keys vLLM 0.32/0.33's CPUOffloadingSpec and OffloadingSpec read
# (vllm/v1/kv_offload/cpu/spec.py, base.py; tests/serve/test_vllm_release.py checks them against 0.33's source).
NATIVE_OPTIONS = frozenset({"eviction_policy", "cache_policy_module_path", "store_threshold", "max_tracker_size",
                            "block_size", "offload_prompt_only", "cpu_bytes_to_use"})
# TieringOffloadingSpec adds `backpressure`, and raises "store_threshold is not supported" for one of 2 or more.
NATIVE_DISK_OPTIONS = (NATIVE_OPTIONS - {"store_threshold"}) | frozenset({"backpressure"})


def native_spec(spec: str) -> dict:
    """Which of vLLM's offloading specs a native backend runs: vLLM's own on a GPU; on the CPU platform
    the same spec with this package's copy worker (cpu_copy_worker.py), since vLLM's worker needs CUDA."""
    if machine.has_cuda():
        return {"spec_name": spec}
    return {"spec_name": CPU_PLATFORM_SPECS[spec], "spec_module_path": CPU_PLATFORM_SPEC_MODULE}


def native_platform_note() -> str | None:
    if machine.has_cuda():
        return None
    return ("CPU platform: vLLM's offloading connector and tier managers unchanged, blocks copied by "
            "pytest-kvoffload's CPU copy worker (vLLM's needs CUDA); only the copy differs from a GPU run")


def _native_cpu(ctx: LaunchContext) -> ServerSpec:
    size = ctx.settings.cpu_gib
    # What --kv-offloading-size with --kv-offloading-backend native expands to (vllm/config/vllm.py,
    # _post_init_kv_transfer_config), written out on both platforms so that a variant's options reach it.
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": int(size * 2**30), **native_spec("CPUOffloadingSpec")},
    }
    return ServerSpec(args=["--kv-transfer-config", json.dumps(config)])


def _native_disk(ctx: LaunchContext) -> ServerSpec:
    # vLLM's own file-system tier behind a CPU tier (TieringOffloadingSpec, secondary tier "fs").
    # Tier-only cells drain the CPU tier with reset_external (Backend.evict_connector), so hits come from the files.
    root = ctx.scratch / "native-disk"
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            **native_spec("TieringOffloadingSpec"),
            "cpu_bytes_to_use": int(ctx.settings.cpu_gib * 2**30),
            "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
        },
    }
    return ServerSpec(args=["--kv-transfer-config", json.dumps(config)])


def _lmcache_disk(ctx: LaunchContext) -> ServerSpec:
    # LMCache's multiprocess server holds the tiers (serve/lmcache.py); the hybrid KV cache manager is
    # off because LMCacheMPConnector refuses it.
    s = ctx.settings
    companion, port = lmcache.server_spec(ctx.scratch, lmcache.l1_gib(s.cpu_gib, s.max_model_len, s.kv_bytes_per_token))
    config = lmcache.connector_config(port)
    return ServerSpec(args=["--disable-hybrid-kv-cache-manager", "--kv-transfer-config", json.dumps(config)],
                      env=dict(lmcache.NO_TELEMETRY), companion=companion)


def _lmcache_inproc_disk(ctx: LaunchContext) -> ServerSpec:
    disk = ctx.scratch / "lmcache-inproc-disk"
    disk.mkdir(parents=True, exist_ok=True)
    config = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    env = {
        "LMCACHE_LOCAL_DISK": f"file://{disk}/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": str(ctx.settings.disk_gb),
        "LMCACHE_LOCAL_CPU": "False",
        # LMCache stages through CPU memory even when its CPU tier is off; zero breaks the disk tier.
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(ctx.settings.cpu_gib),
        "LMCACHE_CHUNK_SIZE": "256",
    }
    return ServerSpec(args=["--kv-transfer-config", json.dumps(config)], env=env)


# kvoffload-disk counters that say a load did not deliver what was promised.
KVOFFLOAD_LOAD_FAILURES = ("blocks_load_failed", "chunks_corrupt", "chunks_missing", "chunks_foreign", "read_errors")


def kvoffload_load_proof(connector: dict, tokens: int, kv_bytes_per_token: int) -> str | None:
    failed = {name: connector[f"kvoffload:{name}_total"] for name in KVOFFLOAD_LOAD_FAILURES
              if connector.get(f"kvoffload:{name}_total")}
    if failed:
        return f"the connector counted failed loads {failed}: the blocks were recomputed, not loaded"
    useful = connector.get("kvoffload:useful_bytes_read_total", 0)
    if useful < tokens * kv_bytes_per_token:
        return (f"the connector read {useful:,.0f} useful bytes, less than the {tokens * kv_bytes_per_token:,} "
                f"that {tokens} tokens need")
    return None


def native_load_proof(connector: dict, tokens: int, kv_bytes_per_token: int) -> str | None:
    """vLLM's offloading counts the bytes its worker copied into the engine's KV cache (CPU_to_GPU, also
    on the CPU build, where the copy worker reports them); a tier hit must have copied its tokens' worth."""
    from pytest_kvoffload.serve.metrics import OFFLOAD_LOADED_BYTES
    loaded = max((connector.get(name, 0) for name in OFFLOAD_LOADED_BYTES), default=0)
    if loaded < tokens * kv_bytes_per_token:
        return (f"vLLM's offloading copied {loaded:,.0f} bytes into the KV cache, less than the "
                f"{tokens * kv_bytes_per_token:,} that {tokens} tokens need")
    return None


def native_imports() -> tuple[str, ...]:
    # vLLM's own offloading on a GPU; this package's copy worker on the CPU platform (cpu_copy_worker.py).
    return () if machine.has_cuda() else (CPU_PLATFORM_SPEC_MODULE,)


def lmcache_imports(connector: str) -> tuple[str, ...]:
    # LMCache's compiled CUDA ops link libtorch's symbols: a build for another torch fails at import.
    return ("lmcache.cuda_ops" if machine.has_cuda() else "lmcache.lmcache_native", connector)


def _empty_folder(path: Path) -> None:
    if path.is_dir():
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                _empty_folder(child)
                child.rmdir()
            else:
                child.unlink()


def builtin_backends() -> list[Backend]:
    return [
        Backend(name="gpu-only", description="the engine's own prefix cache, no offload tier"),
        Backend(
            name="native-cpu",
            description="vLLM's OffloadingConnector with a CPU memory tier",
            tier="host",
            configure=_native_cpu,
            option_keys=NATIVE_OPTIONS,
            platform_note=native_platform_note,
            load_proof=native_load_proof,
            server_imports=native_imports,
            last_block_source="host",
            # vLLM 0.33's CPUOffloadingSpec stores on first sight (store_threshold defaults to 0), but a
            # store_threshold of 2 stores only on the second lookup: prime twice to be right under both.
            prime_requests=2,
        ),
        Backend(
            name="lmcache-disk",
            description="LMCache's multiprocess server with its file-system tier (skip_l1: hits read the files)",
            # vLLM's LMCache connectors name no cache-hit source, so their hits count as external_unspecified.
            tier="external_unspecified",
            configure=_lmcache_disk,
            needs_modules=("lmcache",),
            server_imports=lambda: lmcache_imports("lmcache.integration.vllm.lmcache_mp_connector"),
            tier_granularity=lambda s: lmcache.CHUNK_TOKENS,
            # Whole chunks only; a prompt it holds whole it serves but for the last token (prompts.expected_cached).
            last_block_source="external_unspecified",
            serves_all_but_last_token=True,
            load_proof=lmcache.load_proof,
            tier_settled=lmcache.tier_settled,
            started_facts=lmcache.started_facts,
            # LMCache indexes its files when its server starts: each start begins with an empty folder.
            reset_tier=lambda ctx: _empty_folder(lmcache.l2_folder(ctx.scratch)),
        ),
        Backend(
            name="native-disk",
            description="vLLM's OffloadingConnector with a file-system tier behind a CPU tier",
            tier="disk",
            configure=_native_disk,
            option_keys=NATIVE_DISK_OPTIONS,
            platform_note=native_platform_note,
            load_proof=native_load_proof,
            server_imports=native_imports,
            # The CPU tier in front of the files keeps what was just stored, the last block included.
            last_block_source="host",
            # reset_external drains the CPU tier and keeps the files (TieringOffloadingManager.reset_cache):
            # what is left is a prefix on disk only, counted under source "disk".
            evict_connector=True,
            reset_tier=lambda ctx: _empty_folder(ctx.scratch / "native-disk"),
        ),
        Backend(
            name="kvoffload-disk",
            description="pytest-kvoffload's own disk connector",
            tier="disk",
            configure=_kvoffload_disk,
            option_keys=CONNECTOR_OPTIONS - {"store_dir"},
            server_imports=lambda: ("pytest_kvoffload.connector.connector",),
            # Matched block by block, the prompt's last block included (asynchronous loads, the default;
            # a load_mode=sync variant leaves it to the engine: harness/backend_options.py).
            last_block_source="disk",
            load_proof=kvoffload_load_proof,
        ),
        Backend(
            name="lmcache-inproc-disk",
            description="LMCache's in-process connector (LMCacheConnectorV1) with a local disk tier",
            tier="external_unspecified",
            needs_cuda=True,
            cuda_reason=("LMCache 0.5.6's in-process connector has no CPU path (CreateGPUConnector raises for "
                         "cpu); lmcache-disk runs LMCache's multiprocess server instead; docs/backends.md"),
            configure=_lmcache_inproc_disk,
            server_imports=lambda: lmcache_imports("lmcache.integration.vllm.vllm_v1_adapter"),
            tier_granularity=lambda s: lmcache.CHUNK_TOKENS,
            reset_tier=lambda ctx: _empty_folder(ctx.scratch / "lmcache-inproc-disk"),
        ),
    ]


def default_registry() -> BackendRegistry:
    registry = BackendRegistry()
    for backend in builtin_backends():
        registry.register(backend)
    return registry



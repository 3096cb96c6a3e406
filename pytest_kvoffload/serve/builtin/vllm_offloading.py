"""What vLLM's own offloading backends (native-cpu, native-disk) share: the spec each runs on this platform,
the connector options vLLM reads, the proof that a tier hit copied its bytes, and the modules it loads."""

from __future__ import annotations

import json

from pytest_kvoffload.core import machine
from pytest_kvoffload.serve.backend import ServerSpec
from pytest_kvoffload.serve.command_line import CPU_PLATFORM_SPEC_MODULE, CPU_PLATFORM_SPECS

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


def offloading_server(extra: dict, options: dict, **tier) -> ServerSpec:
    """vLLM's OffloadingConnector with `extra` and a variant's `options` over it."""
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {**extra, **options}}
    return ServerSpec(args=["--kv-transfer-config", json.dumps(config)], **tier)


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

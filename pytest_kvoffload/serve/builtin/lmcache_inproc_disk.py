"""The lmcache-inproc-disk backend (CUDA only): LMCache's in-process connector (LMCacheConnectorV1) with a
local disk tier."""

from __future__ import annotations

import json

from pytest_kvoffload.serve.backend import Backend, LaunchContext, ServerSpec
from pytest_kvoffload.serve.builtin.lmcache_disk import CHUNK_TOKENS, NAME as LMCACHE_DISK, imports
from pytest_kvoffload.serve.builtin.folders import empty_folder

NAME = "lmcache-inproc-disk"


def configure(ctx: LaunchContext) -> ServerSpec:
    disk = ctx.scratch / NAME
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
    return ServerSpec(args=["--kv-transfer-config", json.dumps(config)], env=env, tier_folders=(disk,),
                      direct_io=False)


def backend() -> Backend:
    return Backend(
        name=NAME,
        description="LMCache's in-process connector (LMCacheConnectorV1) with a local disk tier",
        tier="external_unspecified",
        needs_cuda=True,
        cuda_reason=("LMCache 0.5.6's in-process connector has no CPU path (CreateGPUConnector raises for "
                     f"cpu); {LMCACHE_DISK} runs LMCache's multiprocess server instead; docs/backends.md"),
        configure=configure,
        server_imports=lambda: imports("lmcache.integration.vllm.vllm_v1_adapter"),
        tier_granularity=lambda s: CHUNK_TOKENS,
        reset_tier=lambda ctx: empty_folder(ctx.scratch / NAME),
    )

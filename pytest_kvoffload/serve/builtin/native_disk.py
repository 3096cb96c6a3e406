"""The native-disk backend: vLLM's own file-system tier behind a CPU tier (TieringOffloadingSpec, secondary
tier "fs")."""

from __future__ import annotations

from pytest_kvoffload.serve.backend import Backend, LaunchContext, ServerSpec, options_variant
from pytest_kvoffload.serve.builtin.folders import empty_folder
from pytest_kvoffload.serve.builtin.vllm_offloading import (NATIVE_DISK_OPTIONS, native_imports, native_load_proof,
                                                            native_platform_note, native_spec, offloading_server)

NAME = "native-disk"


def configure_with(ctx: LaunchContext, options: dict, suffix: str = "") -> ServerSpec:
    # Tier-only cells drain the CPU tier with reset_external (Backend.evict_connector), so hits come from the files.
    root = ctx.scratch / NAME
    root.mkdir(parents=True, exist_ok=True)
    extra = {**native_spec("TieringOffloadingSpec"), "cpu_bytes_to_use": int(ctx.settings.cpu_gib * 2**30),
             "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}
    # vLLM's fs tier opens its files with O_DIRECT, buffered where the filesystem refuses it (page_cache.io_mode).
    return offloading_server(extra, options, tier_folders=(root,), direct_io=True)


def backend() -> Backend:
    return Backend(
        name=NAME,
        description="vLLM's OffloadingConnector with a file-system tier behind a CPU tier",
        tier="disk",
        configure=lambda ctx: configure_with(ctx, {}),
        option_keys=NATIVE_DISK_OPTIONS,
        variant=lambda b, options, suffix: options_variant(b, options, suffix, configure_with),
        platform_note=native_platform_note,
        load_proof=native_load_proof,
        server_imports=native_imports,
        # The CPU tier in front of the files keeps what was just stored, the last block included.
        last_block_source="host",
        # reset_external drains the CPU tier and keeps the files (TieringOffloadingManager.reset_cache):
        # what is left is a prefix on disk only, counted under source "disk".
        evict_connector=True,
        reset_tier=lambda ctx: empty_folder(ctx.scratch / NAME),
    )

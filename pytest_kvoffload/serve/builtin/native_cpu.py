"""The native-cpu backend: vLLM's OffloadingConnector with a CPU memory tier."""

from __future__ import annotations

from pytest_kvoffload.serve.backend import Backend, LaunchContext, ServerSpec, options_variant
from pytest_kvoffload.serve.builtin.vllm_offloading import (NATIVE_OPTIONS, native_imports, native_load_proof,
                                                            native_platform_note, native_spec, offloading_server)

NAME = "native-cpu"


def configure_with(ctx: LaunchContext, options: dict, suffix: str = "") -> ServerSpec:
    # What --kv-offloading-size with --kv-offloading-backend native expands to (vllm/config/vllm.py,
    # _post_init_kv_transfer_config), written out on both platforms so that a variant's options reach it.
    extra = {"cpu_bytes_to_use": int(ctx.settings.cpu_gib * 2**30), **native_spec("CPUOffloadingSpec")}
    return offloading_server(extra, options)


def backend() -> Backend:
    return Backend(
        name=NAME,
        description="vLLM's OffloadingConnector with a CPU memory tier",
        tier="host",
        configure=lambda ctx: configure_with(ctx, {}),
        option_keys=NATIVE_OPTIONS,
        variant=lambda b, options, suffix: options_variant(b, options, suffix, configure_with),
        platform_note=native_platform_note,
        load_proof=native_load_proof,
        server_imports=native_imports,
        last_block_source="host",
        # vLLM 0.33's CPUOffloadingSpec stores on first sight (store_threshold defaults to 0), but a
        # store_threshold of 2 stores only on the second lookup: prime twice to be right under both.
        prime_requests=2,
    )

"""The kvoffload-disk backend: pytest-kvoffload's own disk connector, the project's subject (role "ours").
Its server runs the connector users deploy, or the test-only one where its options hold a test knob."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pytest_kvoffload.connector.config import OPTIONS, RIGGED_OPTIONS, ConnectorConfigError, default_chunk_tokens
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.rigged import knobs
from pytest_kvoffload.serve.backend import Backend, BackendConfigError, LaunchContext, ServerSpec, options_variant

NAME = "kvoffload-disk"
# kvoffload-disk counters that say a load did not deliver what was promised.
LOAD_FAILURES = ("blocks_load_failed", "chunks_corrupt", "chunks_missing", "chunks_foreign", "read_errors")


def kvoffload_chunk_tokens(settings: Settings) -> int:
    """Tokens of one of the connector's chunk files (its option chunk_tokens): the unit it writes and reads,
    not the unit it matches (one KV block)."""
    configured = settings.disk_opts.get("chunk_tokens")
    return int(configured) if configured else default_chunk_tokens(settings.block_size)


def kvoffload_store_dir(ctx: LaunchContext) -> Path:
    """The connector's store: --kv-disk-opt store_dir=... (the drive under test), else the run's scratch."""
    configured = ctx.settings.disk_opts.get("store_dir")
    return Path(configured) if configured else ctx.scratch / "kv-store"


def transfer_config(extra: dict) -> dict:
    """vLLM's --kv-transfer-config for these options: the deployed connector, or the test-only one
    (pytest_kvoffload/rigged/) where they hold an emulated drive, a planted fault or a planted rule."""
    module, cls = ((knobs.MODULE, knobs.CLASS) if knobs.needs_rig(extra)
                   else ("pytest_kvoffload.connector", "KVOffloadDiskConnector"))
    return {
        "kv_connector": cls,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        # A damaged or vanished chunk must cost a recompute, never the request (vLLM's default is "fail").
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def configure_with(ctx: LaunchContext, options: dict, suffix: str = "") -> ServerSpec:
    extra = {"chunk_tokens": kvoffload_chunk_tokens(ctx.settings), "capacity_gb": ctx.settings.disk_gb}
    extra.update(ctx.settings.disk_opts)
    extra["store_dir"] = str(kvoffload_store_dir(ctx))
    extra.update(options)
    if suffix:
        extra["store_dir"] = f"{extra['store_dir']}-{suffix}"
    direct = str(extra.get("direct_io", True)).lower() not in ("false", "0", "no", "off")
    return ServerSpec(args=["--kv-transfer-config", json.dumps(transfer_config(extra))],
                      tier_folders=(Path(extra["store_dir"]),), direct_io=direct)


def variant(backend: Backend, options: dict, suffix: str) -> Backend:
    """A variant with connector options (test knobs included: knobs.py), checked before any server starts."""
    try:
        knobs.check({**options, "store_dir": "/variant-check"}, 16)
    except ConnectorConfigError as exc:
        raise BackendConfigError(str(exc)) from None
    made = options_variant(backend, options, suffix, configure_with)
    if options.get("load_mode") == "sync":
        # A synchronous load leaves the prompt's last block to the engine (connector/scheduler.py _loadable).
        made = dataclasses.replace(made, last_block_source=None)
    return made


def load_proof(connector: dict, tokens: int, kv_bytes_per_token: int) -> str | None:
    failed = {name: connector[f"kvoffload:{name}_total"] for name in LOAD_FAILURES
              if connector.get(f"kvoffload:{name}_total")}
    if failed:
        return f"the connector counted failed loads {failed}: the blocks were recomputed, not loaded"
    useful = connector.get("kvoffload:useful_bytes_read_total", 0)
    if useful < tokens * kv_bytes_per_token:
        return (f"the connector read {useful:,.0f} useful bytes, less than the {tokens * kv_bytes_per_token:,} "
                f"that {tokens} tokens need")
    return None


def backend() -> Backend:
    return Backend(
        name=NAME,
        description="pytest-kvoffload's own disk connector",
        tier="disk",
        role="ours",
        configure=lambda ctx: configure_with(ctx, {}),
        # A variant may also set the test-only connector's knobs (rigged/knobs.py).
        option_keys=(OPTIONS | frozenset(RIGGED_OPTIONS)) - {"store_dir"},
        variant=variant,
        server_imports=lambda: ("pytest_kvoffload.connector.connector", "pytest_kvoffload.rigged.rigged_connector"),
        # Matched block by block, the prompt's last block included (asynchronous loads, the default;
        # a load_mode=sync variant leaves it to the engine: variant above).
        last_block_source="disk",
        load_proof=load_proof,
    )

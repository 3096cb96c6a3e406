"""The lmcache-disk backend: LMCache's multiprocess server with its file-system tier (L2), beside vLLM's
LMCacheMPConnector. Its command line, vLLM's side of it, and the proof that a tier hit read the files.

Why the multiprocess server: it is the LMCache integration with a CPU path (its CPU cache context shares
the engine's KV over POSIX shared memory), where the in-process LMCacheConnectorV1 needs CUDA. Measured by
hand on a 2-core VM (docs/backends.md): with `--l2-store-policy skip_l1` every stored chunk leaves the
server's DRAM tier (L1) once it is on disk, so a prefix evicted from vLLM's cache can only come from the
files; the server counts each chunk it loads from L2 (`lmcache_mp_l2_prefetch_load_completed`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from pytest_kvoffload.core import machine
from pytest_kvoffload.serve.backend import Backend, LaunchContext, ServerSpec
from pytest_kvoffload.serve.builtin.folders import empty_folder
from pytest_kvoffload.serve.companion import CompanionSpec
from pytest_kvoffload.serve.page_cache import direct_io_works
from pytest_kvoffload.serve.processes import free_port

NAME = "lmcache-disk"

# LMCache's unit of storage and lookup (its server's default --chunk-size, passed explicitly so that a
# changed default cannot move the cells' expectations): one file per chunk in the fs tier.
CHUNK_TOKENS = 256
SERVER_MODULE = "lmcache.v1.multiprocess.server"
# What the server logs once it takes requests (lmcache/v1/multiprocess/server.py, run_cache_server).
READY_LINE = b"LMCache cache server is running..."
# Its counters: chunks loaded from L2 (the fs tier) into its staging memory, on their way to vLLM.
L2_LOADED_CHUNKS = "lmcache_mp_l2_prefetch_load_completed_chunks_total"
# Its stores to the disk tier (L2), submitted and completed, and its DRAM tier's (L1) writes and evictions.
L2_STORE_SUBMITTED, L2_STORE_COMPLETED = ("lmcache_mp_l2_store_submitted_objects_chunks_total",
                                          "lmcache_mp_l2_store_completed_objects_chunks_total")
L1_WRITTEN, L1_EVICTED = "lmcache_mp_l1_write_chunks_total", "lmcache_mp_l1_evicted_chunks_total"
METRIC_PREFIXES = ("lmcache_mp_",)
# KV moved by the server (STORE/RETRIEVE over CUDA IPC, or POSIX shared memory on a CPU), not by vLLM.
TRANSFER_MODE = "lmcache_driven"
# LMCache starts usage telemetry threads that post to stats.lmcache.ai unless told not to
# (lmcache/usage_telemetry/identity.py); a benchmark must not phone home or spend cycles on it.
NO_TELEMETRY = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


# LMCache's DRAM tier (L1) only stages chunks between vLLM and the files here (skip_l1 keeps nothing in
# it), so it gets room for this many prompts of --max-model-len in flight (the trace replay sends 4 at
# once), never more than --kv-cpu-gib: 2.9 GiB of it was allocated and touched at start (4.4 GB RSS).
L1_PROMPTS = 8


def l1_gib(cpu_gib: float, max_model_len: int, kv_bytes_per_token: int) -> float:
    return min(cpu_gib, max(L1_PROMPTS * max_model_len * kv_bytes_per_token / 2**30, 0.25))


def l2_folder(scratch: Path) -> Path:
    return scratch / NAME


def server_spec(scratch: Path, l1_gib: float) -> tuple[CompanionSpec, int, bool]:
    """The LMCache server's command line (its own ports, its L2 folder under `scratch`), its port, and
    whether its fs adapter reads with O_DIRECT."""
    folder = l2_folder(scratch)
    folder.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_port(), free_port()
    # O_DIRECT where the filesystem allows it, as vLLM's fs tier and our store read: no DRAM cache in
    # front of the files. Elsewhere it stays buffered and the harness drops the files from the page
    # cache before every tier-only round (serve/page_cache.py; the session reads use_odirect below).
    adapter = {"type": "fs", "base_path": str(folder), "use_odirect": direct_io_works(folder)}
    argv = [sys.executable, "-m", SERVER_MODULE, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(metrics_port), "--chunk-size", str(CHUNK_TOKENS),
            "--l1-size-gb", f"{l1_gib:g}", "--eviction-policy", "LRU",
            # Chunks leave L1 once stored in L2: a tier-only hit then reads the files.
            "--l2-store-policy", "skip_l1", "--l2-adapter", json.dumps(adapter),
            # The server's default, named so that both sides agree (connector_config says why).
            "--supported-transfer-mode", TRANSFER_MODE]
    spec = CompanionSpec(name="LMCache's server", argv=argv, env=NO_TELEMETRY,
                         metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", metric_prefixes=METRIC_PREFIXES,
                         ready_line=READY_LINE)
    return spec, port, adapter["use_odirect"]


def connector_config(port: int) -> dict:
    """vLLM's --kv-transfer-config for LMCacheMPConnector against the server on `port`."""
    # The connector's default mode (auto) asks for the engine-driven path first, which this server does
    # not serve: "No handler registered for operation register_kv_cache_engine_driven_context", and vLLM
    # gave up after 300 s (tried by hand on the CPU build). The same mode on every platform: one command.
    extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port, "lmcache.mp.mp_transfer_mode": TRANSFER_MODE}
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def load_proof(counters: dict, tokens: int, kv_bytes_per_token: int) -> str | None:
    """A tier hit counts only if LMCache's server loaded the tokens' chunks from its disk tier (L2). A
    prompt's last chunk may be partial, so whole chunks bound the bytes from above."""
    chunks = int(counters.get(L2_LOADED_CHUNKS, 0))
    if chunks * CHUNK_TOKENS < tokens:
        return (f"LMCache's server loaded {chunks} chunks ({chunks * CHUNK_TOKENS * kv_bytes_per_token:,} bytes at "
                f"most) from its disk tier, less than the {tokens * kv_bytes_per_token:,} that {tokens} tokens need")
    return None


def tier_settled(counters: dict) -> bool:
    """No store to the disk tier in flight and nothing left in L1 (LMCache's server counters, as totals):
    a request then finds its chunks in the files alone. The server stores to L2 after the request that
    computed them has returned, and skip_l1 evicts a chunk from L1 once it is stored there; a tier hit sent
    before that is served from L1 (docs/notes/2026-12-01-lmcache.md)."""
    return (counters.get(L2_STORE_COMPLETED, 0) >= counters.get(L2_STORE_SUBMITTED, 0)
            and counters.get(L1_EVICTED, 0) >= counters.get(L1_WRITTEN, 0))


# vLLM's lmcache_mp_connector.py loads lmcache's own class when lmcache is installed, its builtin copy
# (LMCacheMPConnectorUpstream) under LMCACHE_USE_UPSTREAM_MP or when the import fails, and logs which.
_EXTERNAL = re.compile(rb"Using external LMCacheMPConnector from ([\w.]+)")
_UPSTREAM = (b"Force use builtin LMCacheMPConnectorUpstream", b"falling back to builtin implementation in vLLM")


def started_facts(log_path: Path) -> dict:
    """Which LMCacheMPConnector vLLM loaded (lmcache's own, or vLLM's builtin copy), from its log."""
    try:
        text = log_path.read_bytes()
    except OSError:
        text = b""
    external = _EXTERNAL.search(text)
    if external:
        return {"connector_class": f"{external.group(1).decode()}.LMCacheMPConnector"}
    if any(line in text for line in _UPSTREAM):
        return {"connector_class": "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector."
                                   "LMCacheMPConnectorUpstream"}
    return {"connector_class": "not logged"}


def imports(connector: str) -> tuple[str, ...]:
    """What an LMCache server's Python must import: LMCache's compiled ops link libtorch's symbols, so a build
    for another torch fails at import; then the connector vLLM loads."""
    return ("lmcache.cuda_ops" if machine.has_cuda() else "lmcache.lmcache_native", connector)


def configure(ctx: LaunchContext) -> ServerSpec:
    # LMCache's multiprocess server holds the tiers; the hybrid KV cache manager is off because
    # LMCacheMPConnector refuses it.
    s = ctx.settings
    companion, port, direct = server_spec(ctx.scratch, l1_gib(s.cpu_gib, s.max_model_len, s.kv_bytes_per_token))
    return ServerSpec(args=["--disable-hybrid-kv-cache-manager", "--kv-transfer-config",
                            json.dumps(connector_config(port))],
                      env=dict(NO_TELEMETRY), companion=companion, tier_folders=(l2_folder(ctx.scratch),),
                      direct_io=direct)


def backend() -> Backend:
    return Backend(
        name=NAME,
        description="LMCache's multiprocess server with its file-system tier (skip_l1: hits read the files)",
        # vLLM's LMCache connectors name no cache-hit source, so their hits count as external_unspecified.
        tier="external_unspecified",
        configure=configure,
        needs_modules=("lmcache",),
        server_imports=lambda: imports("lmcache.integration.vllm.lmcache_mp_connector"),
        tier_granularity=lambda s: CHUNK_TOKENS,
        # Whole chunks only; a prompt it holds whole it serves but for the last token (prompts.expected_cached).
        last_block_source="external_unspecified",
        serves_all_but_last_token=True,
        load_proof=load_proof,
        tier_settled=tier_settled,
        started_facts=started_facts,
        # LMCache indexes its files when its server starts: each start begins with an empty folder.
        reset_tier=lambda ctx: empty_folder(l2_folder(ctx.scratch)),
    )

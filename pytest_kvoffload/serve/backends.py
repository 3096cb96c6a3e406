"""KV backends: what each needs from vLLM, whether this machine can run it, and the registry users extend.

A backend only describes a server; starting it is server.py's job, measuring it the suites'.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pytest_kvoffload.serve import compile_cache
from pytest_kvoffload.core import machine
from pytest_kvoffload.connector.config import OPTIONS as CONNECTOR_OPTIONS
from pytest_kvoffload.connector.config import default_chunk_tokens
from pytest_kvoffload.core.settings import Settings


class BackendConfigError(ValueError):
    """A backend's server command that cannot work here; the message is one line for the user."""


@dataclass(frozen=True)
class LaunchContext:
    """What a backend may use to build its server: the run's settings and a scratch folder of its own."""

    settings: Settings
    scratch: Path


@dataclass(frozen=True)
class ServerSpec:
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def _no_extra(ctx: LaunchContext) -> ServerSpec:
    return ServerSpec()


@dataclass(frozen=True)
class Backend:
    """One way of serving with (or without) a KV offload tier.

    `tier` is the `source` label under which vLLM counts this backend's tier hits
    (vllm:prompt_tokens_cached_by_source); None means the backend has no tier below the engine's cache.
    `tier_granularity` is the token multiple in which the tier stores prefixes (None: one KV block).
    `reset_tier` empties a tier that outlives vLLM's reset_external (LMCache's and vLLM's file tiers);
    it runs before the backend's server starts, because LMCache indexes its files in memory.
    Tier-only state (a prefix resident in the tier and nowhere above it): prime `prime_requests` times,
    then reset the engine's cache, and with `evict_connector` the connector's memory tier as well (for a
    file tier behind a CPU tier, which vLLM's reset drains but leaves the files of).
    """

    name: str
    description: str
    tier: str | None = None
    needs_cuda: bool = False
    cuda_reason: str = ""
    configure: Callable[[LaunchContext], ServerSpec] = _no_extra
    tier_granularity: Callable[[Settings], int] | None = None
    reset_tier: Callable[[LaunchContext], None] | None = None
    prime_requests: int = 1
    evict_connector: bool = False
    # Proof that a tier hit was a load, from the connector's own counters: (counter deltas of the request,
    # tokens expected from the tier, KV bytes per token) -> None, or what is wrong. vLLM's per-source
    # counter moves when the scheduler accepts external tokens, even when every load then fails.
    load_proof: Callable[[dict, int, int], str | None] | None = None
    # The tier that serves a prompt's last KV block, which the engine's own cache never serves; None when
    # the backend's connector, like the engine, leaves it to be computed (prompts.expected_cached).
    last_block_source: str | None = None
    # What differs on this platform from the backend as users deploy it, in one line (None: nothing).
    platform_note: Callable[[], str | None] = lambda: None
    # kv_connector_extra_config keys a variant (NAME[KEY=VALUE,...]) may set; empty: the backend has none.
    option_keys: frozenset[str] = frozenset()
    # The Python that runs this backend's server (--kv-backend-python); None: the one running pytest.
    python: str | None = None
    # Whether users deploy it as it is: registered backends and the variants a user names on the command
    # line are; emulated drives, planted rules, fault servers and A/B twins are not. Only user-facing
    # backends are gated from night to night (compare.py): the others are re-derived every run.
    user_facing: bool = True

    def unavailable_reason(self) -> str | None:
        if self.needs_cuda and not machine.has_cuda():
            return f"{self.name} needs an NVIDIA GPU: {self.cuda_reason}"
        return None

    def granularity(self, settings: Settings) -> int:
        return self.tier_granularity(settings) if self.tier_granularity else settings.block_size


class BackendRegistry:
    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}

    def register(self, backend: Backend, replace: bool = False) -> None:
        if backend.name in self._backends and not replace:
            raise ValueError(f"backend {backend.name!r} is already registered; pass replace=True to override it")
        # Commas separate backends in --kv-backend, except inside a variant's brackets.
        if backend.name == "all" or "," in backend.name.partition("[")[0] or not backend.name:
            raise ValueError(f"backend name {backend.name!r} is reserved or malformed")
        self._backends[backend.name] = backend

    def get(self, name: str) -> Backend:
        return self._backends[name]

    def names(self) -> list[str]:
        return list(self._backends)

    def __contains__(self, name: str) -> bool:
        return name in self._backends

    def tiers(self) -> dict[str, str]:
        """Each registered backend with a tier, and its tier's name (what the record layer fits)."""
        return {name: b.tier for name, b in self._backends.items() if b.tier}


def server_command(backend: Backend, ctx: LaunchContext, port: int) -> tuple[list[str], dict[str, str]]:
    """The full vLLM command line and environment for one backend's server."""
    settings = ctx.settings
    model = settings.model
    argv = [
        backend.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.path),
        "--served-model-name", model.name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--skip-tokenizer-init",
        "--block-size", str(settings.block_size),
        "--max-model-len", str(settings.max_model_len),
        "--enable-prompt-tokens-details",
        "--enable-per-request-metrics",
        "--seed", str(settings.random_seed),
        "--dtype", settings.dtype,
    ]
    if not model.has_weights:
        argv += ["--load-format", "dummy"]
    # The engine's own prefix cache is what every backend sits behind; make it explicit.
    argv += ["--enable-prefix-caching"]
    if settings.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(settings.tensor_parallel)]
    if machine.has_cuda():
        # An A/B run keeps both servers on the GPU at once: each gets half.
        utilization = settings.gpu_memory_utilization / (2 if settings.ab else 1)
        argv += ["--gpu-memory-utilization", f"{utilization:g}"]
    spec = backend.configure(ctx)
    argv += spec.args
    argv += list(settings.server_args)
    env = dict(os.environ)
    # /reset_prefix_cache is a dev-mode endpoint; the suites need it to evict the engine's cache.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if not machine.has_cuda():
        # Unset, the CPU build claims 92% of the machine's memory for KV.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # The CPU build keeps one core per rank for its scheduler, and one more whenever a KV connector is
        # configured (for NIXL; vllm/utils/ompmultiprocessing.py). On 2 cores the extra one cannot be had,
        # so a connector's worker ended up with both cores and gpu-only's with one: prefill ran twice as
        # fast with a connector, a difference that would be credited to offload. The same reservation for
        # every backend keeps their engines equal.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(settings.tensor_parallel))
    # Servers of one model, dtype and shape load what the first one compiled (compile_cache.py says why).
    env.update(compile_cache.server_env(machine.has_cuda(), env))
    env.update(spec.env)
    problem = offloading_spec_problem(backend.name, argv, machine.has_cuda())
    if problem:
        raise BackendConfigError(problem)
    return argv, env


def _kvoffload_chunk_tokens(settings: Settings) -> int:
    configured = settings.disk_opts.get("chunk_tokens")
    return int(configured) if configured else default_chunk_tokens(settings.block_size)


def kvoffload_store_dir(ctx: LaunchContext) -> Path:
    """The connector's store: --kv-disk-opt store_dir=... (the drive under test), else the run's scratch."""
    configured = ctx.settings.disk_opts.get("store_dir")
    return Path(configured) if configured else ctx.scratch / "kv-store"


def _kvoffload_disk(ctx: LaunchContext) -> ServerSpec:
    extra = {"chunk_tokens": _kvoffload_chunk_tokens(ctx.settings), "capacity_gb": ctx.settings.disk_gb}
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
# (vllm/v1/kv_offload/cpu/spec.py, base.py); TieringOffloadingSpec adds `backpressure`.
NATIVE_OPTIONS = frozenset({"eviction_policy", "cache_policy_module_path", "store_threshold", "max_tracker_size",
                            "block_size", "offload_prompt_only", "cpu_bytes_to_use"})


# vLLM's spec -> its CPU-platform twin; named here so that building a command line does not import vLLM.
CPU_PLATFORM_SPEC_MODULE = "pytest_kvoffload.cpu_copy_worker"
CPU_PLATFORM_SPECS = {"CPUOffloadingSpec": "CPUPlatformOffloadingSpec", "TieringOffloadingSpec": "CPUPlatformTieringSpec"}


def offloading_spec_problem(backend: str, argv: list[str], cuda: bool) -> str | None:
    """A server command that asks for vLLM's offloading spec on the wrong platform, in one line; else None.

    vLLM's own CPU worker raises deep in the engine on a CPU platform, and the CPU-platform twin would
    copy a GPU's KV through host memory on a GPU, so both are refused before a server starts.
    """
    platform = "a CUDA GPU" if cuda else "the CPU platform (no CUDA GPU)"
    # --kv-offloading-size turns vLLM's offloading on; its backend "native" is the default.
    if not cuda and "--kv-offloading-size" in argv and "--kv-transfer-config" not in argv:
        return (f"{backend}: --kv-offloading-backend native uses vLLM's CPUOffloadingSpec, which needs a CUDA or "
                f"XPU GPU; this is {platform}: use spec_name {CPU_PLATFORM_SPECS['CPUOffloadingSpec']} "
                f"(spec_module_path {CPU_PLATFORM_SPEC_MODULE})")
    if "--kv-transfer-config" not in argv:
        return None
    # argparse keeps the last occurrence, so does this check.
    position = len(argv) - 1 - argv[::-1].index("--kv-transfer-config")
    try:
        config = json.loads(argv[position + 1])
    except (IndexError, ValueError):
        return f"{backend}: --kv-transfer-config is not valid JSON"
    if config.get("kv_connector") != "OffloadingConnector":
        return None
    spec = config.get("kv_connector_extra_config", {}).get("spec_name", "CPUOffloadingSpec")
    if not cuda and spec in CPU_PLATFORM_SPECS:
        return (f"{backend}: vLLM's {spec} needs a CUDA or XPU GPU; this is {platform}: use "
                f"{CPU_PLATFORM_SPECS[spec]} (spec_module_path {CPU_PLATFORM_SPEC_MODULE})")
    twins = {twin: original for original, twin in CPU_PLATFORM_SPECS.items()}
    if cuda and spec in twins:
        return (f"{backend}: {spec} is the CPU-platform copy worker; this is {platform}: use vLLM's own "
                f"{twins[spec]}")
    return None


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
    if machine.has_cuda():
        return ServerSpec(args=["--kv-offloading-size", str(size), "--kv-offloading-backend", "native"])
    # What --kv-offloading-backend native expands to (vllm/config/vllm.py), with the CPU-platform spec.
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
    disk = ctx.scratch / "lmcache-disk"
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
            last_block_source="host",
            # vLLM 0.33's CPUOffloadingSpec stores on first sight (store_threshold defaults to 0), but a
            # store_threshold of 2 stores only on the second lookup: prime twice to be right under both.
            prime_requests=2,
        ),
        Backend(
            name="lmcache-disk",
            description="LMCache with a local disk tier",
            # vLLM's LMCacheConnectorV1 names no cache-hit source, so its hits count as external_unspecified.
            tier="external_unspecified",
            needs_cuda=True,
            cuda_reason=("LMCache 0.5.6 has no CPU connector (CreateGPUConnector raises for cpu) and its wheel "
                         "needs CUDA (cupy-cuda13x, libcudart); docs/backends.md"),
            configure=_lmcache_disk,
            tier_granularity=lambda s: 256,
            reset_tier=lambda ctx: _empty_folder(ctx.scratch / "lmcache-disk"),
        ),
        Backend(
            name="native-disk",
            description="vLLM's OffloadingConnector with a file-system tier behind a CPU tier",
            tier="disk",
            configure=_native_disk,
            option_keys=NATIVE_OPTIONS | frozenset({"backpressure"}),
            platform_note=native_platform_note,
            load_proof=native_load_proof,
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
            tier_granularity=_kvoffload_chunk_tokens,
            load_proof=kvoffload_load_proof,
        ),
    ]


def default_registry() -> BackendRegistry:
    registry = BackendRegistry()
    for backend in builtin_backends():
        registry.register(backend)
    return registry


def interpreter_versions(python: str) -> dict:
    """vLLM's, LMCache's and torch's versions as installed for `python`, read without importing them."""
    import subprocess
    code = ("import json, importlib.metadata as m\n"
            "def v(*names):\n"
            "    for n in names:\n"
            "        try: return m.version(n)\n"
            "        except m.PackageNotFoundError: pass\n"
            "print(json.dumps({'vllm': v('vllm', 'vllm-cpu'), 'lmcache': v('lmcache'), 'torch': v('torch')}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
        return json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}


def with_connector_options(backend: Backend, suffix: str, server_args: tuple[str, ...] = (),
                           user_facing: bool = False, **options) -> Backend:
    """A variant of a connector backend with extra kv_connector_extra_config entries and its own store.

    It gets its own name (`name[suffix]`), hence its own server in the session's pool. `server_args` go
    before the user's --kv-server-arg, which therefore still win. A suite's own variant (an emulated drive,
    a planted fault) is not user-facing; one a user names on the command line is.
    """
    def configure(ctx: LaunchContext) -> ServerSpec:
        spec = backend.configure(ctx)
        args = list(spec.args) + list(server_args)
        if "--kv-transfer-config" not in args:
            raise BackendConfigError(f"{backend.name} configures no KV connector to pass options to")
        i = args.index("--kv-transfer-config") + 1
        config = json.loads(args[i])
        extra = config.setdefault("kv_connector_extra_config", {})
        extra.update(options)
        if "store_dir" in extra:
            extra["store_dir"] = f"{extra['store_dir']}-{suffix}"
        args[i] = json.dumps(config)
        return dataclasses.replace(spec, args=args)

    return dataclasses.replace(backend, name=f"{backend.name}[{suffix}]", configure=configure, user_facing=user_facing)


# B's suffix when --kv-ab compares a backend with itself (measure/ab.py).
SELF_SUFFIX = "~b"


def twin_name(name: str) -> str:
    """B's name when a backend is compared with itself: its own server and store, the same configuration."""
    return f"{name}{SELF_SUFFIX}"

"""KV backends: what each needs from vLLM, whether this machine can run it, and the registry users extend.

A backend only describes a server; starting it is serve/server.py's job, measuring it the suites'.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pytest_kvoffload.serve import compile_cache, cpu_engine
from pytest_kvoffload.serve.companion import CompanionSpec
from pytest_kvoffload.core import machine
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.core.vllm_releases import Release, release

# The folder holding this package, for a server run by another interpreter (--kv-backend-python).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class BackendConfigError(ValueError):
    """A backend's server command that cannot work here; the message is one line for the user."""


@dataclass(frozen=True)
class LaunchContext:
    """What a backend may use to build its server: the run's settings and a scratch folder of its own."""

    settings: Settings
    scratch: Path


@dataclass(frozen=True)
class ServerSpec:
    """What a backend adds to vLLM's command line and environment, and the process it needs beside vLLM."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    companion: CompanionSpec | None = None


@dataclass(frozen=True)
class Launch:
    """A server's full command line and environment, and its companion's (None: vLLM alone)."""

    argv: list[str]
    env: dict[str, str]
    companion: CompanionSpec | None = None


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
    # Whether the tier holds what was stored and nothing above it does yet, from the server's counters (totals):
    # a tier whose stores complete after the request returns (LMCache's server) is waited for before a tier
    # hit is measured (measure/runner.place_in_tier_only). None: the tier is settled when the request returns.
    tier_settled: Callable[[dict], bool] | None = None
    # The tier that serves a prompt's last KV block, which the engine's own cache never serves; None when
    # the backend's connector, like the engine, leaves it to be computed (prompts.expected_cached).
    last_block_source: str | None = None
    # How it counts a prompt it holds whole: False, vLLM's offloading and ours, every whole block (the
    # last one too; vLLM then recomputes one token); True, LMCache's MP connector, every token but the
    # last (it reports len(prompt) - 1: lmcache_mp_connector.py).
    serves_all_but_last_token: bool = False
    # Python modules the backend's processes import besides vLLM (LMCache's server: "lmcache").
    needs_modules: tuple[str, ...] = ()
    # Modules the server loads into vLLM that a build against another torch or vLLM breaks (compiled ops,
    # our connector), imported in the server's Python before it starts (serve/server_imports.py).
    server_imports: Callable[[], tuple[str, ...]] = lambda: ()
    # What a started server's log says of it, for run.json (which connector class vLLM loaded).
    started_facts: Callable[[Path], dict] | None = None
    # What differs on this platform from the backend as users deploy it, in one line (None: nothing).
    platform_note: Callable[[], str | None] = lambda: None
    # kv_connector_extra_config keys a variant (NAME[KEY=VALUE,...]) may set; empty: the backend has none.
    option_keys: frozenset[str] = frozenset()
    # The Python that runs this backend's server (--kv-backend-python); None: the one running pytest.
    python: str | None = None
    # Whether users deploy it as it is: registered backends and the variants a user names on the command
    # line are; emulated drives, planted rules, fault servers and A/B twins are not. Only user-facing
    # backends are gated from night to night (record/compare.py): the others are re-derived every run.
    user_facing: bool = True

    def unavailable_reason(self) -> str | None:
        if self.needs_cuda and not machine.has_cuda():
            return f"{self.name} needs an NVIDIA GPU: {self.cuda_reason}"
        # Another interpreter (--kv-backend-python) brings its own packages: only this one is looked at.
        missing = [m for m in self.needs_modules if self.python is None and importlib.util.find_spec(m) is None]
        if missing:
            return (f"{self.name} needs the Python package {', '.join(missing)}, not installed here "
                    f"(make installs it; or --kv-backend-python {self.name}=PATH to a Python that has it)")
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
    launch = server_launch(backend, ctx, port)
    return launch.argv, launch.env


def server_launch(backend: Backend, ctx: LaunchContext, port: int) -> Launch:
    """server_command's command line and environment, with the backend's companion process."""
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
    if settings.engine_tokens is not None:
        argv += ["--num-gpu-blocks-override", str(-(-settings.engine_tokens // settings.block_size))]
    if settings.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(settings.tensor_parallel)]
    if machine.has_cuda():
        # An A/B run keeps both servers on the GPU at once: each gets half.
        utilization = settings.gpu_memory_utilization / (2 if settings.ab else 1)
        argv += ["--gpu-memory-utilization", f"{utilization:g}"]
    spec = backend.configure(ctx)
    companion = spec.companion
    if companion is not None:
        # The companion runs in this environment too, its own variables over it, and comes from the same
        # installation as the server's vLLM (--kv-backend-python).
        command = companion.argv
        if backend.python and command[0] == sys.executable:
            command = [backend.python, *command[1:]]
        companion = dataclasses.replace(companion, argv=command, env={**os.environ, **companion.env})
    argv += spec.args
    env = dict(os.environ)
    env.update(package_path(backend))
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
    # Servers of one model, dtype and shape load what the first one compiled (serve/compile_cache.py says why).
    env.update(compile_cache.server_env(machine.has_cuda(), env))
    # --kv-engine one-process on the CPU build: no worker spawn, the same compute threads (serve/cpu_engine.py).
    engine_args, engine_env = cpu_engine.server_settings(settings.engine, machine.has_cuda(),
                                                         settings.tensor_parallel, settings.server_args, env)
    argv += engine_args + list(settings.server_args)
    env.update(engine_env)
    env.update(spec.env)
    problem = offloading_spec_problem(backend.name, argv, machine.has_cuda())
    if problem:
        raise BackendConfigError(problem)
    return Launch(argv, env, companion)


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


def package_path(backend: Backend) -> dict[str, str]:
    """The environment a server of another interpreter needs to import this checkout's connector and copy
    worker, not a copy installed beside it: an upgrade comparison changes vLLM only. Empty for our own."""
    if not backend.python:
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}


def server_release(backend: Backend) -> tuple[Release, str | None]:
    """The vLLM release a backend's server runs (its interpreter's, --kv-backend-python), with the version;
    UnsupportedVllm in one line outside the declared range (core/vllm_releases.py)."""
    if backend.python is None:
        version, where = machine.package_version("vllm", "vllm-cpu"), sys.executable
    else:
        version, where = interpreter_versions(backend.python).get("vllm"), backend.python
    return release(version, f"{backend.name}'s server, {where}"), version


@functools.lru_cache(maxsize=None)
def interpreter_versions(python: str) -> dict:
    """vLLM's, LMCache's and torch's versions as installed for `python`, read without importing them;
    asked once per interpreter in a session (the options, the header and run.json all want them)."""
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


# B's suffix when --kv-ab compares a backend with itself (suite_machinery/ab.py).
SELF_SUFFIX = "~b"


def twin_name(name: str) -> str:
    """B's name when a backend is compared with itself: its own server and store, the same configuration."""
    return f"{name}{SELF_SUFFIX}"

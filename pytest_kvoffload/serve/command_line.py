"""A server's full command line and environment: vLLM's own flags, the backend's part, the engine's and the
compile cache's settings, and the interpreter that runs it (another vLLM: --kv-backend-python)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

from pytest_kvoffload.serve import compile_cache, cpu_engine
from pytest_kvoffload.serve.backend import Backend, BackendConfigError, Launch, LaunchContext
from pytest_kvoffload.core import machine
from pytest_kvoffload.core.vllm_releases import Release, release

# The folder holding this package, for a server run by another interpreter (--kv-backend-python).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


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
        "--block-size", str(backend.kv_block(settings)),
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
        argv += ["--num-gpu-blocks-override", str(-(-settings.engine_tokens // backend.kv_block(settings)))]
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
    return Launch(argv, env, companion, tuple(spec.tier_folders), spec.direct_io)


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



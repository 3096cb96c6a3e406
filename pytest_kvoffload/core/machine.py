"""What this machine can run: CUDA or not, and the defaults that follow from it."""

from __future__ import annotations

import os
import platform
import shutil
from functools import lru_cache
from importlib import metadata
from pathlib import Path


@lru_cache(maxsize=1)
def device_kind() -> str:
    """'cuda' when an NVIDIA GPU is visible, else 'cpu'.

    KVOFFLOAD_DEVICE overrides the probe, so tests can check the CPU and GPU branches anywhere.
    Probing the driver's files, not torch, keeps pytest start-up fast.
    """
    forced = os.environ.get("KVOFFLOAD_DEVICE")
    if forced in ("cpu", "cuda"):
        return forced
    if os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi"):
        return "cuda"
    return "cpu"


def has_cuda() -> bool:
    return device_kind() == "cuda"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo).

    KVOFFLOAD_CPU_FLAGS (space separated) overrides them, so tests can take the branch of a CPU this
    machine is not (an AVX2-only one, say).
    """
    forced = os.environ.get("KVOFFLOAD_CPU_FLAGS")
    if forced is not None:
        return frozenset(forced.split())
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# The flags that make a CPU compute bf16 natively; without them vLLM's CPU build emulates bf16 and runs
# about 5x slower than float32 (seen on an AVX2-only EPYC: 5.3 s against 1.1 s for 1,024 tokens).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# The flags worth recording with every run: they decide which kernels vLLM's CPU build runs.
RECORDED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile", "asimd", "sve")


def native_dtype(model_dtype: str) -> tuple[str, str]:
    """The dtype this machine computes the model in natively, and why (for the run header and run.json)."""
    if has_cuda():
        return model_dtype, f"the model's own dtype on a GPU ({model_dtype})"
    flags = cpu_flags()
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return "bfloat16", f"the CPU computes bf16 natively ({', '.join(native)})"
    return "float32", ("the CPU lacks avx512_bf16 and amx_bf16, and vLLM's CPU build runs bf16 about 5x "
                       "slower than float32 there")


def describe() -> dict:
    flags = cpu_flags()
    return {
        "device": device_kind(),
        "cpu": cpu_model(),
        "cpu_flags": [f for f in RECORDED_FLAGS if f in flags],
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "platform": platform.platform(),
    }


# Per-machine defaults. No speed is assumed here: the grid on a CPU is cut to what the measured prefill
# speed finishes in budget (measure/prefill_speed.py), and the admission suite derives its slowed drive from measurements.
# max_prefill_s is a time budget, not a speed: on a CPU, default lengths whose cold prefill takes longer are
# left out, so make bench fits its 15 minutes on the slowest of our CPUs as on the fastest.
CPU_DEFAULTS = {"model": "tiny-llama", "lengths": "512,1024,2048,4096", "fractions": "0.5,1.0", "rounds": "3",
                "block_size": 128, "max_prefill_s": 3.0}
GPU_DEFAULTS = {
    "model": "llama-3.2-3b",
    "lengths": "1024,2048,4096,8192,16384,32768,65536",
    "fractions": "0.1,0.5,0.9",
    "rounds": "5",
    "block_size": 16,
    "max_prefill_s": None,
}


def defaults() -> dict:
    return GPU_DEFAULTS if has_cuda() else CPU_DEFAULTS


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


def default_cpu_gib() -> float:
    """CPU memory for a CPU tier: a quarter of the machine, 1 to 64 GiB, leaving room for the engine.

    Without a GPU the engine's own KV cache, its weights and the tier all live in that memory, and vLLM's
    tiering fills its whole region up front: an eighth, at most 4 GiB (the engine gets 2, serve/command_line.py).
    """
    if not has_cuda():
        return round(min(4.0, max(1.0, memory_gib() / 8)), 1)
    return round(min(64.0, max(1.0, memory_gib() / 4)), 1)


def nearest_existing(folder) -> Path:
    """`folder`, or its nearest parent that exists (a run's folders are made later; its drive is known now)."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def default_disk_gb(folder) -> float:
    """A disk tier's capacity: half the free space where the run writes, 1 to 256 GB."""
    free = shutil.disk_usage(nearest_existing(folder)).free / 1e9
    return round(min(256.0, max(1.0, free / 2)), 1)


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None

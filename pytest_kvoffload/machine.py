"""What this machine can run: CUDA or not, and the defaults that follow from it."""

from __future__ import annotations

import os
import platform
import shutil
from functools import lru_cache
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


def describe() -> dict:
    return {
        "device": device_kind(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "platform": platform.platform(),
    }


# Per-machine defaults: on a 2-core CPU the grid must finish in minutes, on a GPU it is the seed's grid.
# slow_drive_gbps: the drive the admission suite emulates, chosen so that the break-even prefix falls
# inside the default lengths (tiny-llama on 2 cores needs about 20 to 40 MB/s; Llama 3.2 3B on an H100
# about 3 to 23 GB/s). step_tokens: the admission suite's --max-num-batched-tokens, so that it knows
# how long a prompt must be to keep the next request queued for a step.
CPU_DEFAULTS = {"model": "tiny-llama", "lengths": "512,1024,2048,4096", "fractions": "0.5,1.0", "rounds": "3",
                "block_size": 128, "slow_drive_gbps": 0.025, "step_tokens": 2048}
GPU_DEFAULTS = {
    "model": "llama-3.2-3b",
    "lengths": "1024,2048,4096,8192,16384,32768,65536",
    "fractions": "0.1,0.5,0.9",
    "rounds": "5",
    "block_size": 16,
    "slow_drive_gbps": 4.0,
    "step_tokens": 8192,
}


def defaults() -> dict:
    return GPU_DEFAULTS if has_cuda() else CPU_DEFAULTS


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


def default_cpu_gib() -> float:
    """CPU memory for a CPU tier: a quarter of the machine, 1 to 64 GiB, leaving room for the engine."""
    return round(min(64.0, max(1.0, memory_gib() / 4)), 1)


def default_disk_gb(folder) -> float:
    """A disk tier's capacity: half the free space where the run writes, 1 to 256 GB."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free / 1e9
    return round(min(256.0, max(1.0, free / 2)), 1)

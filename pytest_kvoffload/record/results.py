"""A run's results computed from its measurements: the per-cell table, the break-even analysis per backend
and, beside each measured tier, the first-order figures at the prefill speed this run achieved."""

from __future__ import annotations

from pytest_kvoffload.analysis.fits import analyse
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.core.first_order import first_order_at_measured_speed
from pytest_kvoffload.core.models import DTYPE_BYTES
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.analysis.cell_stats import cell_table
from pytest_kvoffload.analysis.tier_limit import DRIVE, HOST, tier_limits


def compute_results(measurements: list[dict], tiers: dict[str, str], settings: Settings,
                    environment: dict | None = None) -> tuple[list[dict], dict]:
    """(cells, analysis) of a run's measurement records; `tiers`: each backend with a tier, its tier's name;
    `environment` the run's, for the rates each tier's limit reads its bytes at."""
    cells = cell_table(measurements)
    analysis = analyse(cells, settings.kv_bytes_per_token, tiers)
    env = environment or {}
    rates = {DRIVE: (env.get("drive") or {}).get("read_gbps"), HOST: (env.get("host_copy") or {}).get("gbps")}
    for backend, limits in tier_limits(measurements, tiers, settings.kv_bytes_per_token, rates).items():
        analysis.setdefault(backend, {})["tier_limit"] = limits
    for backend, entry in analysis.items():
        cold = {c["length"]: c["ttft"]["p50"] for c in cells
                if c["backend"] == backend and c["state"] == State.COLD.value}
        if entry.get("tier") and cold:
            entry["tier"]["first_order"] = first_order_at_measured_speed(settings.model, cold,
                                                                         DTYPE_BYTES[settings.dtype])
    return cells, analysis

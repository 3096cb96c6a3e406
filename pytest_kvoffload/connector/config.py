"""The connector's options, read from kv_connector_extra_config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pytest_kvoffload.connector.io_threads import MAX_SLICE_US, MIN_SLICE_US
from pytest_kvoffload.connector.chunk_format import MAX_BLOCKS

DEFAULT_CHUNK_TOKENS = 256


# The admission rule's modes (admission_rule.py): the calibrated ones first, then the two fixed controls.
ADMISSION_MODES = ("queue", "static", "online", "always", "never")
# Options only the test-only connector takes (pytest_kvoffload/rigged/: an emulated drive, planted wrong KV),
# named here so that the connector a user deploys refuses them in one line, saying where they live.
RIGGED_CONNECTOR = "pytest_kvoffload.rigged"
RIGGED_OPTIONS = ("read_gbps", "read_latency_ms", "fault")


def admission_mode(text: str) -> str:
    """An `admission` value read; ValueError, one line, when it is none of the modes (a planted rule, the
    admission suite's wrong-on-purpose control, is the test-only connector's)."""
    text = str(text)
    if text in ADMISSION_MODES:
        return text
    if ":" in text and text.partition(":")[0] in ADMISSION_MODES:
        raise ValueError(f"admission {text!r} is a planted rule of the test-only connector ({RIGGED_CONNECTOR}); "
                         f"the connector you deploy takes one of {', '.join(ADMISSION_MODES)}")
    raise ValueError(f"admission {text!r} must be one of {', '.join(ADMISSION_MODES)}")




class ConnectorConfigError(ValueError):
    pass


def _number(extra: dict, key: str, kind: type, default, what: str):
    """extra[key] as `kind`, or `default` when absent; a value that is no number is a ConnectorConfigError."""
    value = extra.get(key)
    if value is None or value == "":
        return default
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConnectorConfigError(f"kvoffload connector: {key} {value!r} must be {what}") from None


def _switch(extra: dict, key: str, default: bool) -> bool:
    """extra[key] as on/off: a JSON boolean, 1/0 or one of the words a person would write."""
    value = extra.get(key, default)
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    word = str(value).strip().lower()
    if word in SWITCH_WORDS:
        return SWITCH_WORDS[word]
    raise ConnectorConfigError(f"kvoffload connector: {key} {value!r} must be true or false (also 1/0, yes/no, on/off)")


SWITCH_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


# Where the load threads (load_cpus) and the save threads (save_cpus) run: "worker", the CPUs vLLM bound its
# worker to (inherited), or "all" the machine's CPUs.
THREAD_CPUS = ("worker", "all")


def _cpus(extra: dict, key: str) -> str:
    value = str(extra.get(key, "worker"))
    if value not in THREAD_CPUS:
        raise ConnectorConfigError(f"kvoffload connector: {key} {value!r} must be 'worker' (the worker's CPUs) or "
                                   f"'all' (every CPU)")
    return value


def _threads(extra: dict) -> tuple[int, int, str, str]:
    """io_threads, load_threads, load_cpus and save_cpus, checked; a ConnectorConfigError names the one that is
    off."""
    threads = _number(extra, "io_threads", int, 2, "a whole number of threads")
    if threads < 1:
        raise ConnectorConfigError(f"kvoffload connector: io_threads {threads} must be at least 1")
    load_threads = _number(extra, "load_threads", int, 2 * threads, "a whole number of threads")
    if load_threads < threads:
        raise ConnectorConfigError(f"kvoffload connector: load_threads {load_threads} must be at least io_threads "
                                   f"({threads}): that many read at once")
    return threads, load_threads, _cpus(extra, "load_cpus"), _cpus(extra, "save_cpus")


def _timeline(extra: dict) -> Path | None:
    timeline = Path(extra["timeline"]) if extra.get("timeline") else None
    if timeline is not None and not timeline.parent.is_dir():
        raise ConnectorConfigError(f"kvoffload connector: timeline {str(timeline)!r} must be a file in a folder "
                                   f"that exists (its events are appended there)")
    return timeline


# Every kv_connector_extra_config key the connector reads.
OPTIONS = frozenset({"store_dir", "capacity_gb", "chunk_tokens", "io_threads", "direct_io",
                     "calibration", "calibration_mismatch", "load_mode", "admission", "io_slice_us", "idle_wait_ms", "load_threads", "load_cpus", "save_cpus", "huge_pages",
                     "load_io", "read_ahead_mb", "timeline"})

# How long an idle step's worker waits for a load in flight past its expected end (idle_wait_ms; idle_wait.py).
# Shorter only costs one empty step a wait.
DEFAULT_IDLE_WAIT_MS = 5.0


def default_chunk_tokens(block_size: int) -> int:
    """About DEFAULT_CHUNK_TOKENS, in whole blocks: large sequential files without coarse prefix matching."""
    return max(block_size, DEFAULT_CHUNK_TOKENS // block_size * block_size)


@dataclass(frozen=True)
class ConnectorConfig:
    store_dir: Path
    capacity_bytes: int = 64 << 30
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    io_threads: int = 2  # reads (writes) in flight at once
    # Threads that load chunks: io_threads of them read at once, the rest check and scatter chunks already read,
    # so the drive is not left a read short while a chunk's CPU work runs (worker.py). None: twice io_threads.
    load_threads: int | None = None
    load_cpus: str = "worker"  # THREAD_CPUS: the load threads' CPUs (io_threads.start_io_thread)
    # The CPU build's loads: "aio", one thread with io_threads reads queued on Linux native AIO (aio_loads.py),
    # falling back to "threads" (load_threads threads) where the kernel has none. CUDA loads run on threads.
    load_io: str = "aio"
    save_cpus: str = "worker"  # THREAD_CPUS: the save threads' CPUs
    # The I/O threads' scheduler slice (io_threads.py): the kernel's shortest by default; 0 keeps its default.
    io_slice_us: int = MIN_SLICE_US
    # A step with nothing to compute and loads in flight waits for one to finish, until its expected end and this
    # long beyond (idle_wait.py), instead of handing the core back to vLLM's empty-step loop; 0: never waits.
    idle_wait_s: float = DEFAULT_IDLE_WAIT_MS / 1e3
    direct_io: bool = True  # O_DIRECT where the file system allows it; buffered + page drop otherwise
    # Chunk buffers on transparent huge pages where the kernel allows: one segment per O_DIRECT request
    # instead of one per 4 KiB page (io_memory.py has the measurement); false: ordinary pages.
    huge_pages: bool = True
    calibration: Path | None = None
    # refuse: a calibration measured on another machine, model or drive stops the server (core/calibration.py);
    # accept: it is used anyway and what differs is logged.
    calibration_mismatch: str = "refuse"
    # async: the request waits in the scheduler while I/O threads read (hides loads behind queueing);
    # sync: the step that computes the request loads first (no extra scheduler round trips).
    load_mode: str = "async"
    admission: str = "queue"  # static | online | queue (need `calibration`) | always | never: admission_rule.py
    # Staging memory for reads of queued requests' chunks, started on arrival (read_ahead.py); 0: loads start
    # when the scheduler first considers the request.
    read_ahead_bytes: int = 0
    timeline: Path | None = None  # a file for each request's load, step by step (timeline.py); None: off

    @classmethod
    def from_extra(cls, extra: dict, block_size: int) -> "ConnectorConfig":
        """Keys: OPTIONS; a bad one is a ConnectorConfigError naming it and what would be valid."""
        known = OPTIONS
        rigged = sorted(set(extra) & set(RIGGED_OPTIONS))
        if rigged:
            raise ConnectorConfigError(
                f"kvoffload connector: {', '.join(rigged)} is a test knob (an emulated drive or a planted fault) of "
                f"the test-only connector {RIGGED_CONNECTOR}, not of the one you deploy; valid: {', '.join(sorted(known))}")
        unknown = set(extra) - known
        if unknown:
            raise ConnectorConfigError(
                f"kvoffload connector: unknown option(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(known))}"
            )
        if not extra.get("store_dir"):
            raise ConnectorConfigError("kvoffload connector: store_dir is required (a folder for the KV chunk files)")
        chunk = _number(extra, "chunk_tokens", int, default_chunk_tokens(block_size), "a whole number of tokens")
        if chunk <= 0 or chunk % block_size:
            raise ConnectorConfigError(
                f"kvoffload connector: chunk_tokens {chunk} must be a positive multiple of the block size {block_size}"
            )
        if chunk // block_size > MAX_BLOCKS:
            raise ConnectorConfigError(
                f"kvoffload connector: chunk_tokens {chunk} is {chunk // block_size} blocks of {block_size}; a chunk "
                f"file's header keys at most {MAX_BLOCKS} blocks (chunk_tokens up to {MAX_BLOCKS * block_size})")
        threads, load_threads, load_cpus, save_cpus = _threads(extra)
        capacity = _number(extra, "capacity_gb", float, 64, "a number of GB")
        if capacity <= 0:
            raise ConnectorConfigError(f"kvoffload connector: capacity_gb {capacity} must be above 0")
        load_mode = str(extra.get("load_mode", "async"))
        if load_mode not in ("async", "sync"):
            raise ConnectorConfigError(f"kvoffload connector: load_mode {load_mode!r} must be 'async' or 'sync'")
        admission = str(extra.get("admission", "queue"))
        try:
            admission_mode(admission)
        except ValueError as exc:
            raise ConnectorConfigError(f"kvoffload connector: {exc}") from None
        mismatch = str(extra.get("calibration_mismatch", "refuse"))
        if mismatch not in ("refuse", "accept"):
            raise ConnectorConfigError(
                f"kvoffload connector: calibration_mismatch {mismatch!r} must be 'refuse' or 'accept'")
        slice_us = _number(extra, "io_slice_us", int, MIN_SLICE_US, "a whole number of microseconds")
        if slice_us and not MIN_SLICE_US <= slice_us <= MAX_SLICE_US:
            raise ConnectorConfigError(f"kvoffload connector: io_slice_us {slice_us} must be 0 (the kernel's "
                                       f"default) or {MIN_SLICE_US} to {MAX_SLICE_US}")
        idle_wait_ms = _number(extra, "idle_wait_ms", float, DEFAULT_IDLE_WAIT_MS, "a number of milliseconds")
        if not 0 <= idle_wait_ms <= 1000:
            raise ConnectorConfigError(f"kvoffload connector: idle_wait_ms {idle_wait_ms} must be 0 (never wait) "
                                       f"to 1000")
        load_io = str(extra.get("load_io", "aio"))
        if load_io not in ("aio", "threads"):
            raise ConnectorConfigError(f"kvoffload connector: load_io {load_io!r} must be 'aio' (native AIO, one "
                                       f"thread) or 'threads' (load_threads threads)")
        read_ahead_mb = _number(extra, "read_ahead_mb", float, 0.0, "a number of MB")
        if read_ahead_mb < 0:
            raise ConnectorConfigError(f"kvoffload connector: read_ahead_mb {read_ahead_mb} must be 0 (off) or more")
        direct = _switch(extra, "direct_io", True)
        huge_pages = _switch(extra, "huge_pages", True)
        return cls(
            store_dir=Path(extra["store_dir"]),
            capacity_bytes=int(capacity * 1e9),
            chunk_tokens=chunk,
            io_threads=threads,
            load_threads=load_threads,
            load_cpus=load_cpus,
            load_io=load_io,
            save_cpus=save_cpus,
            io_slice_us=slice_us,
            idle_wait_s=idle_wait_ms / 1e3,
            direct_io=bool(direct),
            huge_pages=huge_pages,
            calibration=Path(extra["calibration"]) if extra.get("calibration") else None,
            calibration_mismatch=mismatch,
            load_mode=load_mode,
            admission=admission,
            read_ahead_bytes=int(read_ahead_mb * 1e6),
            timeline=_timeline(extra),
        )

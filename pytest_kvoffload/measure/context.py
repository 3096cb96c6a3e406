"""What measuring code takes from the harness, instead of the session itself (the way pytest-benchmark's
fixture gets an `add_stats` callback): a Recorder (the run's settings, the salt that keys its prompts,
where each measurement goes, progress lines, the run's cells so far) and the Servers (one per backend,
started on first use, released when a suite is done with it). The harness's session builds both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pytest_kvoffload.core.progress import Say, print_line
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.serve.backend import Backend
from pytest_kvoffload.serve.client import Endpoint


def _no_tier_read(backend: str) -> dict | None:
    return None


@dataclass(frozen=True)
class Recorder:
    settings: Settings
    # Part of every prompt's key, so a rerun against a long-lived server cannot hit last run's cache.
    salt: str
    # Keeps one measurement record (the run record, and the pytest_kvoffload_measurement hook).
    keep: Callable[[dict], None]
    progress: Say = print_line
    # Before a tier-only round of a buffered disk tier: its files dropped from the page cache, and what was
    # resident (serve/page_cache.py); None for tiers that read with O_DIRECT.
    before_tier_read: Callable[[str], dict | None] = _no_tier_read
    # The grid's lengths (decided at the first server's start), the run's per-cell statistics of one
    # backend and purpose, the run's environment and folder, and a benchmark's figures kept in run.json.
    lengths: Callable[[], tuple[int, ...]] = lambda: ()
    cells: Callable[..., list[dict]] = lambda backend=None, purpose="measure": []
    environment: Callable[[], dict] = dict
    run_dir: Callable[[], Path] = Path.cwd
    add_benchmark: Callable[[str, str, dict], None] = lambda name, text, data: None


def _no_room(servers: int | None) -> None:
    return None


@dataclass(frozen=True)
class Servers:
    endpoint: Callable[[Backend], Endpoint]
    release: Callable[[str], None]
    # Keep up to this many servers running at once (None: back to the session's own limit): the admission
    # suite needs its control and guarded servers up together without stopping the one a later test reuses.
    room: Callable[[int | None], None] = _no_room
    # Whether a backend's server is up now (no start-up to wait for): suite_machinery/ttft.py orders its work by it.
    running: Callable[[str], bool] = lambda name: False

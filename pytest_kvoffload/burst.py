"""A probe request that arrives while the engine is busy with a long prefill: the queue a load can hide in.

The background prompt is longer than one step's token budget, so the engine first looks at the probe in
the step that finishes the background's prefill, with that prefill still ahead of it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .client import RequestResult, settled_snapshot, stream_completion
from .server import Endpoint


def background_length(step_tokens: int, max_model_len: int, block_size: int) -> int:
    """Two steps' worth of prompt, less a sliver so the probe is looked at in the second step."""
    return max(block_size, min(2 * step_tokens - step_tokens // 32, max_model_len - block_size))


@dataclass
class QueuedProbe:
    probe: RequestResult
    background: RequestResult
    # Counter deltas around both requests. The background prompt is fresh, so every hit and every
    # admission decision in them is the probe's.
    cached_by_source: dict
    connector: dict


def queued_behind(endpoint: Endpoint, background: list[int], probe: list[int], lead_s: float = 0.05) -> QueuedProbe:
    before = endpoint.metrics()
    # One HTTP session per thread: requests' sessions are not thread-safe.
    other = Endpoint(endpoint.url, endpoint.model_name)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-background") as pool:
        pending = pool.submit(stream_completion, other, background)
        time.sleep(lead_s)
        probe_result = stream_completion(endpoint, probe)
        background_result = pending.result()
    delta = settled_snapshot(endpoint, before, len(background) + len(probe)).delta(before)
    return QueuedProbe(probe_result, background_result,
                       {k: int(v) for k, v in delta.cached_by_source.items() if v},
                       {k: v for k, v in delta.extra.items() if v})

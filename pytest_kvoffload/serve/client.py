"""A vLLM server over HTTP (Endpoint: health, metrics, prefix-cache reset) and one streamed completion request,
timed from just before the POST to the first streamed token."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import requests

from pytest_kvoffload.core.vllm_releases import DEFAULT, Release
from pytest_kvoffload.serve.metrics import PROMPT_TOKENS, Snapshot, snapshot


class Endpoint:
    """A vLLM server reached over HTTP, started by us or not. `release`: the server's vLLM, which says how
    its metrics name cached tokens by source (the session sets it from the server's interpreter)."""

    def __init__(self, url: str, model_name: str, release: Release = DEFAULT) -> None:
        self.url = url.rstrip("/")
        self.model_name = model_name
        self.release = release
        self.http = requests.Session()

    def healthy(self) -> bool:
        try:
            return self.http.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def metrics_text(self) -> str:
        response = self.http.get(f"{self.url}/metrics", timeout=10)
        response.raise_for_status()
        return response.text

    def metrics(self) -> Snapshot:
        return snapshot(self.metrics_text(), release=self.release)

    def reset_prefix_cache(self, external: bool, attempts: int = 120) -> None:
        """Evict the engine's prefix cache (and the connector's store when `external`).

        vLLM answers {"success": false} while blocks are still held (a finishing request, an
        in-flight save), so retry briefly.
        """
        last = ""
        for _ in range(attempts):
            response = self.http.post(
                f"{self.url}/reset_prefix_cache", params={"reset_external": str(external).lower()}, timeout=30
            )
            if response.status_code == 200:
                try:
                    ok = response.json().get("success", True)
                except ValueError:
                    ok = True
                if ok:
                    return
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code == 404:
                break
            time.sleep(0.25)
        raise RuntimeError(
            f"{self.url}/reset_prefix_cache failed ({last}); the server must run with VLLM_SERVER_DEV_MODE=1"
        )



@dataclass
class RequestResult:
    prompt_tokens: int
    client_ttft_s: float
    total_s: float
    cached_tokens: int | None = None
    server_ttft_s: float | None = None
    server_queue_s: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Per output token, the most likely tokens' logprobs (only when asked for with `logprobs`).
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    cached_by_source: dict[str, int] = field(default_factory=dict)
    connector: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class RequestError(RuntimeError):
    pass


def stream_completion(endpoint: Endpoint, prompt: list[int], max_tokens: int = 1, timeout: float = 600.0,
                      cache_salt: str | None = None, logprobs: int | None = None,
                      kv_transfer_params: dict | None = None) -> RequestResult:
    """One streamed request. `cache_salt` (vLLM's per-request cache isolation) keeps it from sharing any
    cached prefix with requests of another salt: a recompute of the same prompt, whatever is cached."""
    body = {
        "model": endpoint.model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params  # for the connector (e.g. kvoffload's opt-out)
    if logprobs:
        # Without a tokenizer, tokens can only be named by id ("token_id:123").
        body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
    top: list[dict[int, float]] = []
    started_at = time.time()
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict = {}
    metrics: dict = {}
    tokens: list[int] = []
    with endpoint.http.post(f"{endpoint.url}/v1/completions", json=body, stream=True, timeout=timeout) as response:
        if response.status_code != 200:
            raise RequestError(f"POST /v1/completions: HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line or not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RequestError(f"server error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if first is None:
                    first = time.perf_counter() - t0
                tokens.extend(choice.get("token_ids") or [])
                for step in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                    top.append({int(name.rsplit(":", 1)[-1]): lp for name, lp in (step or {}).items()})
            if chunk.get("usage"):
                usage = chunk["usage"]
                metrics = chunk.get("metrics") or {}
    total = time.perf_counter() - t0
    if first is None:
        raise RequestError("the stream ended without a token")
    details = usage.get("prompt_tokens_details") or {}
    ttft_ms = metrics.get("time_to_first_token_ms")
    queue_ms = metrics.get("queue_time_ms")
    return RequestResult(
        prompt_tokens=int(usage.get("prompt_tokens", len(prompt))),
        client_ttft_s=first,
        total_s=total,
        cached_tokens=details.get("cached_tokens"),
        server_ttft_s=ttft_ms / 1000 if ttft_ms is not None else None,
        server_queue_s=queue_ms / 1000 if queue_ms is not None else None,
        output_token_ids=tokens,
        top_logprobs=top,
        started_at=started_at,
    )


def poll_metrics(endpoint: Endpoint, done: Callable[[Snapshot], bool], deadline_s: float,
                 every_s: float) -> tuple[Snapshot, bool]:
    """The server's metrics once `done` holds of them, read every `every_s`, or the last read past
    `deadline_s`; and whether it held."""
    end = time.monotonic() + deadline_s
    while True:
        after = endpoint.metrics()
        if done(after):
            return after, True
        if time.monotonic() > end:
            return after, False
        time.sleep(every_s)


def settled_snapshot(endpoint: Endpoint, before: Snapshot, prompt_tokens: int, deadline_s: float = 5.0) -> Snapshot:
    """Metrics after a request, once its prompt tokens have been counted.

    vLLM updates its counters from the engine's stats loop, which can trail the response slightly.
    """
    return poll_metrics(endpoint, lambda after: after.prompt_tokens - before.prompt_tokens >= prompt_tokens,
                        deadline_s, every_s=0.05)[0]


def measure(endpoint: Endpoint, prompt: list[int], max_tokens: int = 1, logprobs: int | None = None) -> RequestResult:
    """A request with the change of the cached-token counters (by source) around it."""
    before = endpoint.metrics()
    result = stream_completion(endpoint, prompt, max_tokens, logprobs=logprobs)
    attach_sources(endpoint, before, result)
    return result


def attach_sources(endpoint: Endpoint, before: Snapshot, result: RequestResult) -> None:
    delta = settled_snapshot(endpoint, before, result.prompt_tokens).delta(before)
    result.cached_by_source = {k: int(v) for k, v in delta.cached_by_source.items() if v}
    result.connector = {k: v for k, v in delta.extra.items() if v}


__all__ = ["RequestResult", "RequestError", "stream_completion", "measure", "attach_sources", "poll_metrics", "PROMPT_TOKENS"]

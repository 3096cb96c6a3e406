"""Prometheus text from vLLM's /metrics, reduced to the counters the suites read."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def parse(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (prometheus_client's parser). A line the parser refuses
    costs only itself: the text is then read line by line, skipping those."""
    try:
        return _samples(text)
    except ValueError:
        samples = []
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    samples += _samples(line + "\n")
                except ValueError:
                    continue
        return samples


def _samples(text: str) -> list[Sample]:
    return [Sample(sample.name, tuple(sorted(sample.labels.items())), float(sample.value))
            for family in text_string_to_metric_families(text) for sample in family.samples]


@dataclass(frozen=True)
class Snapshot:
    """The counters one request moves, summed over engines and models."""

    prompt_tokens: float
    cached_by_source: dict[str, float]
    extra: dict[str, float]

    def delta(self, before: "Snapshot") -> "Snapshot":
        sources = set(self.cached_by_source) | set(before.cached_by_source)
        keys = set(self.extra) | set(before.extra)
        return Snapshot(
            prompt_tokens=self.prompt_tokens - before.prompt_tokens,
            cached_by_source={s: self.cached_by_source.get(s, 0.0) - before.cached_by_source.get(s, 0.0) for s in sources},
            extra={k: self.extra.get(k, 0.0) - before.extra.get(k, 0.0) for k in keys},
        )


# vLLM's offloading counters (vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py): bytes
# moved, per direction by the label transfer_type in 0.32 (kv_offload_total_bytes), per name from 0.33
# (kv_offload_load_bytes / kv_offload_store_bytes). Kept per direction: a sum of both would mean nothing.
VLLM_OFFLOAD_PREFIX = "vllm:kv_offload_"
OFFLOAD_LOADED_BYTES = ('vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}',
                        "vllm:kv_offload_load_bytes_total")


def _extra_key(sample: Sample) -> str:
    direction = sample.label("transfer_type")
    return f'{sample.name}{{transfer_type="{direction}"}}' if direction else sample.name


def snapshot(text: str, extra_prefixes: tuple[str, ...] = ("kvoffload:", VLLM_OFFLOAD_PREFIX)) -> Snapshot:
    prompt = 0.0
    by_source: dict[str, float] = {}
    extra: dict[str, float] = {}
    for s in parse(text):
        if s.name == PROMPT_TOKENS:
            prompt += s.value
        elif s.name == CACHED_BY_SOURCE:
            source = s.label("source") or "unknown"
            by_source[source] = by_source.get(source, 0.0) + s.value
        elif s.name.startswith(extra_prefixes) and s.name.endswith("_total"):
            key = _extra_key(s)
            extra[key] = extra.get(key, 0.0) + s.value
    return Snapshot(prompt, by_source, extra)

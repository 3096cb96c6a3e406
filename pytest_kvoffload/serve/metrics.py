"""Prometheus text from vLLM's /metrics, reduced to the counters the suites read."""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pytest_kvoffload.core.vllm_releases import DEFAULT, Release

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

    def with_extra(self, extra: dict[str, float]) -> "Snapshot":
        """This snapshot with another process's counters (a backend's companion) among the extra ones."""
        return Snapshot(self.prompt_tokens, self.cached_by_source, {**self.extra, **extra})

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


def snapshot(text: str, extra_prefixes: tuple[str, ...] = ("kvoffload:", VLLM_OFFLOAD_PREFIX),
             release: Release = DEFAULT) -> Snapshot:
    """The counters of one /metrics text, cached tokens by source read as `release` exposes them (the
    family and its labels differ by release: core/vllm_releases.py; 0.32's is the default)."""
    prompt = 0.0
    by_source: dict[str, float] = {}
    extra: dict[str, float] = {}
    cached = release.cached_family + "_total"
    for s in parse(text):
        if s.name == PROMPT_TOKENS:
            prompt += s.value
        elif s.name == cached:
            source = release.source(s.label("source") or "unknown")
            if source is not None:
                by_source[source] = by_source.get(source, 0.0) + s.value
        elif s.name.startswith(extra_prefixes) and s.name.endswith("_total"):
            key = _extra_key(s)
            extra[key] = extra.get(key, 0.0) + s.value
    return Snapshot(prompt, by_source, extra)


def histograms(text: str, prefix: str = "kvoffload:") -> dict[str, dict]:
    """The histograms under `prefix`, summed over engines: {name: {"buckets": [[upper bound, cumulative
    count], ...], "count": n, "sum": s}}, bounds ascending with +Inf last as float("inf")."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram" or not family.name.startswith(prefix):
            continue
        buckets: dict[float, float] = {}
        entry = out.setdefault(family.name, {"buckets": [], "count": 0.0, "sum": 0.0})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                entry["count"] += sample.value
            elif sample.name.endswith("_sum"):
                entry["sum"] += sample.value
        entry["buckets"] = [[bound, count] for bound, count in sorted(buckets.items())]
    return {name: h for name, h in out.items() if h["count"]}


def merge_histograms(a: dict[str, dict], b: dict[str, dict]) -> dict[str, dict]:
    """Two servers' histograms of the same buckets, added (a backend's server restarted mid-run)."""
    merged = {name: {"buckets": [list(x) for x in h["buckets"]], "count": h["count"], "sum": h["sum"]}
              for name, h in a.items()}
    for name, h in b.items():
        if name not in merged:
            merged[name] = {"buckets": [list(x) for x in h["buckets"]], "count": h["count"], "sum": h["sum"]}
            continue
        counts = {bound: count for bound, count in merged[name]["buckets"]}
        for bound, count in h["buckets"]:
            counts[bound] = counts.get(bound, 0.0) + count
        merged[name] = {"buckets": [[bound, counts[bound]] for bound in sorted(counts)],
                        "count": merged[name]["count"] + h["count"], "sum": merged[name]["sum"] + h["sum"]}
    return merged


def family_problems(text: str, families: dict[str, dict], where: str) -> list[str]:
    """What a /metrics text lacks of `families` (name -> {"labels": [...], "values": {label: [...]}}, a
    release's golden file: tests/serve/golden/), one line each; a family is its samples' name without
    _total, _created, _count, _sum or _bucket."""
    found: dict[str, dict[str, set[str]]] = {}
    for s in parse(text):
        name = re.sub(r"_(total|created|count|sum|bucket)$", "", s.name)
        labels = found.setdefault(name, {})
        for key, value in s.labels:
            labels.setdefault(key, set()).add(value)
    problems = []
    for name, want in families.items():
        if name not in found:
            problems.append(f"{name}: absent from {where}'s /metrics, where {want.get('read_by', 'the harness')} "
                            f"reads it; a renamed family needs core/vllm_releases.py and its golden file updated")
            continue
        missing = [label for label in want.get("labels", []) if label not in found[name]]
        if missing:
            problems.append(f"{name}: {where}'s /metrics has no label {', '.join(missing)}")
        for label, values in want.get("values", {}).items():
            absent = [v for v in values if v not in found[name].get(label, set())]
            if absent:
                problems.append(f"{name}: {where}'s /metrics has no {label} {', '.join(absent)}")
    return problems

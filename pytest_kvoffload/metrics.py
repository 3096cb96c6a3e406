"""Prometheus text from vLLM's /metrics, reduced to the counters the suites read."""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

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
    """Samples of a Prometheus text exposition; comments and malformed lines are skipped."""
    samples = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            continue
        name, _, labels, value = match.group(1), match.group(2), match.group(3), match.group(4)
        try:
            number = float(value)
        except ValueError:
            continue
        pairs = tuple(sorted(_LABEL.findall(labels or "")))
        samples.append(Sample(name, pairs, number))
    return samples


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


def snapshot(text: str, extra_prefixes: tuple[str, ...] = ("kvoffload:",)) -> Snapshot:
    prompt = 0.0
    by_source: dict[str, float] = {}
    extra: dict[str, float] = {}
    for s in parse(text):
        if s.name == PROMPT_TOKENS:
            prompt += s.value
        elif s.name == CACHED_BY_SOURCE:
            source = s.label("source") or "unknown"
            by_source[source] = by_source.get(source, 0.0) + s.value
        elif s.name.startswith(extra_prefixes) and not s.name.endswith("_created"):
            extra[s.name] = extra.get(s.name, 0.0) + s.value
    return Snapshot(prompt, by_source, extra)

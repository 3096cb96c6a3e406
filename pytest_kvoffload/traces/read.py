"""Request traces (Mooncake and Alibaba Bailian style) turned into token-id prompts that keep their
prefix sharing: equal leading hash ids give equal leading tokens, different ids different tokens.

Mooncake: {"timestamp": ms, "input_length", "output_length", "hash_ids"}, 512 tokens a block.
Bailian:  {"chat_id", "parent_chat_id", "timestamp": s, "input_length", "output_length", "turn", "hash_ids"},
          16 tokens a block.
Traces are scaled to fit a machine: tokens per trace block (length), a time factor, a request limit and
a time window; the scaling is part of the result so reports can state it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pytest_kvoffload.measure.prompts import _tokens

FORMATS = {"mooncake": {"block_tokens": 512, "time_unit_s": 1e-3},
           "bailian": {"block_tokens": 16, "time_unit_s": 1.0}}
REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that cannot be used; names the file, the line and what was expected."""


@dataclass(frozen=True)
class TraceRequest:
    line: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    chat_id: str | None = None


@dataclass(frozen=True)
class Scaling:
    tokens_per_block: int | None = None  # None: the format's own block size (no length scaling)
    time_factor: float = 1.0  # multiplies arrival times (0.1 = ten times faster)
    limit: int | None = None
    window_s: tuple[float, float] | None = None

    def describe(self, fmt: str) -> str:
        native = FORMATS[fmt]["block_tokens"]
        per_block = self.tokens_per_block or native
        parts = [f"{per_block} tokens per {native}-token trace block (x{per_block / native:g} lengths)",
                 f"arrival times x{self.time_factor:g}"]
        if self.window_s:
            parts.append(f"window {self.window_s[0]:g}-{self.window_s[1]:g} s")
        if self.limit:
            parts.append(f"first {self.limit} requests")
        return ", ".join(parts)


@dataclass
class Trace:
    path: Path
    format: str
    requests: list[TraceRequest] = field(default_factory=list)


def detect_format(record: dict) -> str:
    return "bailian" if "chat_id" in record or "turn" in record else "mooncake"


def read_trace(path: str | Path, fmt: str | None = None) -> Trace:
    p = Path(path)
    if fmt is not None and fmt not in FORMATS:
        raise TraceError(f"trace format {fmt!r}: expected one of {', '.join(FORMATS)}")
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise TraceError(f"trace {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {p}: cannot read it ({exc})") from None
    trace = Trace(p, fmt or "mooncake")
    last = None
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(f"trace {p}, line {number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise TraceError(f"trace {p}, line {number}: expected a JSON object per line")
        if not trace.requests and fmt is None:
            trace.format = detect_format(record)
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise TraceError(f"trace {p}, line {number}: missing {', '.join(missing)} "
                             f"(each line needs {', '.join(REQUIRED)})")
        try:
            arrival = float(record["timestamp"]) * FORMATS[trace.format]["time_unit_s"]
            request = TraceRequest(number, arrival, int(record["input_length"]), int(record["output_length"]),
                                   tuple(int(h) for h in record["hash_ids"]),
                                   str(record["chat_id"]) if "chat_id" in record else None)
        except (TypeError, ValueError):
            raise TraceError(f"trace {p}, line {number}: timestamp, lengths and hash_ids must be numbers") from None
        if request.input_length < 1:
            raise TraceError(f"trace {p}, line {number}: input_length must be at least 1")
        if last is not None and arrival < last:
            raise TraceError(f"trace {p}, line {number}: timestamp goes backwards "
                             f"({record['timestamp']} after a later one); traces must be sorted by arrival")
        last = arrival
        trace.requests.append(request)
    if not trace.requests:
        raise TraceError(f"trace {p}: empty; expected one JSON object per line with {', '.join(REQUIRED)}")
    return trace


def select(trace: Trace, scaling: Scaling) -> list[TraceRequest]:
    """The requests inside the window and limit, arrival times rebased to 0 and scaled."""
    chosen = trace.requests
    if scaling.window_s:
        start, end = scaling.window_s
        chosen = [r for r in chosen if start <= r.arrival_s < end]
    if scaling.limit:
        chosen = chosen[: scaling.limit]
    if not chosen:
        return []
    t0 = chosen[0].arrival_s
    return [TraceRequest(r.line, (r.arrival_s - t0) * scaling.time_factor, r.input_length, r.output_length,
                         r.hash_ids, r.chat_id) for r in chosen]


def build_prompt(request: TraceRequest, fmt: str, scaling: Scaling, vocab_size: int, salt: str = "") -> list[int]:
    """Token ids whose blocks follow the request's hash ids: block k's tokens depend only on hash_ids[k]
    and on the blocks before it, so shared leading ids share tokens and nothing else does."""
    native = FORMATS[fmt]["block_tokens"]
    per_block = scaling.tokens_per_block or native
    length = max(1, round(request.input_length * per_block / native))
    tokens: list[int] = []
    chain = salt
    for block, hash_id in enumerate(request.hash_ids):
        if len(tokens) >= length:
            break
        chain = f"{chain}/{hash_id}"
        tokens.extend(_tokens(f"trace|{chain}", min(per_block, length - len(tokens)), vocab_size))
    if len(tokens) < length:
        # Prompts longer than their hash ids cover get a tail of their own.
        tokens.extend(_tokens(f"trace-tail|{salt}|{request.line}", length - len(tokens), vocab_size))
    return tokens

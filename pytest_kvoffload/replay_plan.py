"""The --kv-trace options, checked before any server starts, and the prompts they produce."""

from __future__ import annotations

from dataclasses import dataclass

from .replay import ReplayItem
from .settings import OptionError, parse_positive_int
from .traces import FORMATS, Scaling, Trace, TraceError, build_prompt, read_trace, select


@dataclass
class ReplayPlan:
    trace: Trace
    scaling: Scaling
    mode: str
    concurrency: int
    max_output: int

    def items(self, vocab_size: int, salt: str) -> list[ReplayItem]:
        return [ReplayItem(r.line, r.arrival_s, build_prompt(r, self.trace.format, self.scaling, vocab_size, salt),
                           max(1, min(r.output_length, self.max_output)))
                for r in select(self.trace, self.scaling)]

    def shared_prefixes(self, block_size: int) -> list[int]:
        """Per request, in order, the tokens of its prompt that an earlier request of the replay already
        had, in whole cache blocks: the part a cache could serve, which is what a break-even prefix is
        compared with (not the prompt's length)."""
        from .plan import block_keys, leading

        seen: set[int] = set()
        shared = []
        for request in select(self.trace, self.scaling):
            _, keys = block_keys(request, self.trace.format, self.scaling, block_size)
            shared.append(leading(keys, seen) * block_size)
            seen.update(keys)
        return shared

    def describe(self) -> dict:
        return {"path": str(self.trace.path), "format": self.trace.format, "requests": len(self.trace.requests),
                "scaling": self.scaling.describe(self.trace.format), "mode": self.mode,
                "concurrency": self.concurrency, "max_output": self.max_output}


def _float(option: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise OptionError(f"{option} {value!r}: expected a positive number") from None
    if number <= 0:
        raise OptionError(f"{option} {value!r}: expected a positive number")
    return number


def build_replay_plan(config, value) -> ReplayPlan | None:
    path = value(config, "kv_trace", None)
    if not path:
        return None
    fmt = value(config, "kv_trace_format", None)
    if fmt is not None and fmt not in FORMATS:
        raise OptionError(f"--kv-trace-format {fmt!r}: expected one of {', '.join(FORMATS)}")
    try:
        trace = read_trace(path, fmt)
    except TraceError as exc:
        raise OptionError(f"--kv-trace: {exc}") from None
    per_block = value(config, "kv_trace_tokens_per_block", None)
    window = value(config, "kv_trace_window", None)
    window_s = None
    if window:
        try:
            start, end = (float(x) for x in str(window).split(":"))
        except ValueError:
            raise OptionError(f"--kv-trace-window {window!r}: expected START:END in seconds, e.g. 0:60") from None
        if end <= start:
            raise OptionError(f"--kv-trace-window {window!r}: END must be after START")
        window_s = (start, end)
    limit = value(config, "kv_trace_limit", None)
    scaling = Scaling(
        tokens_per_block=parse_positive_int("--kv-trace-tokens-per-block", per_block) if per_block else None,
        time_factor=_float("--kv-trace-time-scale", str(value(config, "kv_trace_time_scale", "1"))),
        limit=parse_positive_int("--kv-trace-limit", limit) if limit else None,
        window_s=window_s,
    )
    mode = str(value(config, "kv_trace_mode", "open"))
    if mode not in ("open", "closed"):
        raise OptionError(f"--kv-trace-mode {mode!r}: expected open or closed")
    plan = ReplayPlan(trace, scaling, mode,
                      parse_positive_int("--kv-trace-concurrency", value(config, "kv_trace_concurrency", "4")),
                      parse_positive_int("--kv-trace-max-output", value(config, "kv_trace_max_output", "4")))
    if not select(trace, scaling):
        raise OptionError(f"--kv-trace: no request of {path} falls inside --kv-trace-window {window}")
    return plan

"""What a --kv-trace run replays (options.build_replay_plan reads it): the trace, its scaling and the prompts."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvoffload.traces.prefix_trees import block_keys, leading, reuse_share, slice_by_tree, slice_gap
from pytest_kvoffload.traces.read import Scaling, Trace, TraceRequest, build_prompt, select


@dataclass(frozen=True)
class ReplayItem:
    """One request of the replay: its trace line, arrival and token-id prompt."""

    line: int
    arrival_s: float
    tokens: list[int]
    max_tokens: int


@dataclass
class ReplayPlan:
    trace: Trace
    scaling: Scaling
    mode: str
    concurrency: int
    max_output: int
    repeats: int = 3  # replays per backend (--kv-trace-repeats)
    # --kv-trace-slice: this many requests taken as whole prefix trees, the draw closest to the trace's reuse
    # (prefix_trees.slice_by_tree), not a window.
    slice_size: int | None = None

    def requests(self) -> list[TraceRequest]:
        """The replayed requests, in trace order: the window and limit, then the slice."""
        chosen = select(self.trace, self.scaling)
        if self.slice_size:
            chosen = slice_by_tree(chosen, self.slice_size)
        return chosen

    def items(self, vocab_size: int, salt: str) -> list[ReplayItem]:
        return [ReplayItem(r.line, r.arrival_s, build_prompt(r, self.trace.format, self.scaling, vocab_size, salt),
                           max(1, min(r.output_length, self.max_output)))
                for r in self.requests()]

    def shared_prefixes(self, block_size: int, after_warm: bool = False) -> list[int]:
        """Per request, in order, the tokens of its prompt that an earlier request of the replay already
        had, in whole cache blocks: the part a cache could serve, which is what a break-even prefix is
        compared with (not the prompt's length). `after_warm`: after a warming pass of the same slice
        (suite_machinery/trace_replay.py:warm_pass), which has seen every block."""
        keyed = [block_keys(request, self.trace.format, self.scaling, block_size)[1] for request in self.requests()]
        seen: set[int] = {key for keys in keyed for key in keys} if after_warm else set()
        shared = []
        for keys in keyed:
            shared.append(leading(keys, seen) * block_size)
            seen.update(keys)
        return shared

    def describe(self) -> dict:
        return {"path": str(self.trace.path), "format": self.trace.format, "requests": len(self.trace.requests),
                "scaling": self.scaling.describe(self.trace.format), "mode": self.mode,
                "concurrency": self.concurrency, "max_output": self.max_output, "repeats": self.repeats,
                "slice": self.slice_size, "replayed": len(self.requests()),
                # Shares of trace blocks an earlier request had: what a cache could ever serve.
                "reuse_share": reuse_share(self.requests()), "trace_reuse_share": reuse_share(self.trace.requests),
                "slice_gap": slice_gap(self.requests(), select(self.trace, self.scaling)) if self.slice_size else None}

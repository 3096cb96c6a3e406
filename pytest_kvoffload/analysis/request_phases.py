"""Where each request's time went, read from the connector's step timeline (connector/timeline.py).

From arrival to the forward that computes its last prompt token, in phases: queued (arrival to the step that
plans its load, or that computes it where nothing loads), waiting for the worker (the plan to the worker's
step taking the load), reading (the load's reads, with the bytes they moved), reporting (reads done to the
step that tells the scheduler), rescheduling (that step to the step computing the request), gathering saves
(the CPU build gathers the last step's saves at a step's start, before its forward: another request's, or
its own earlier chunks), computing (the forwards of the steps that compute its tokens) and the gaps between
those steps (sampling, the scheduler, the model runner's input preparation).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace


class TimelineError(ValueError):
    pass


@dataclass
class RequestPhases:
    req: str
    prompt: int
    loaded_tokens: int = 0
    load_bytes: int = 0
    # phase -> seconds; absent where it did not happen (no load: no waiting, reading, reporting, rescheduling)
    phases: dict[str, float] = field(default_factory=dict)
    steps: int = 0  # steps that computed its prompt tokens
    computed_tokens: int = 0

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    @property
    def read_gbps(self) -> float | None:
        seconds = self.phases.get("reading")
        return self.load_bytes / seconds / 1e9 if seconds and self.load_bytes else None


def events_from_lines(lines, source: str) -> list[dict]:
    """The timeline's events; a TimelineError naming the line that is not one (a cut last line is skipped:
    the server may still be writing)."""
    events = []
    lines = list(lines)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            if not isinstance(event, dict) or "t" not in event or "event" not in event:
                raise ValueError
        except ValueError:
            if number == len(lines):
                continue
            raise TimelineError(f"{source} line {number}: not a timeline event (a JSON object with t and event, "
                                f"as the connector's timeline option writes)") from None
        events.append(event)
    return events


def request_phases(events: list[dict]) -> list[RequestPhases]:
    """Each request that computed its last prompt token in the timeline, in arrival order."""
    first: dict[tuple[str, str], float] = {}  # (event, req) -> when it first happened
    prompt: dict[str, int] = {}
    planned_tokens: dict[str, int] = {}
    reads: dict[str, dict] = {}
    # Steps are numbered per server: (server, step) -> the worker's bind (the step's start), its forward's end.
    binds: dict[tuple, float] = {}
    gathered: dict[tuple, float] = {}  # the step's start done gathering the last step's saves (the CPU build)
    forwards: dict[tuple, float] = {}
    computing: dict[str, list[tuple[tuple, int, int]]] = defaultdict(list)  # req -> [(step, before, tokens)]
    for e in sorted(events, key=lambda e: e["t"]):
        kind, req, at = e["event"], e.get("req"), (e.get("server"), e.get("step"))
        if req is not None:
            first.setdefault((kind, req), e["t"])
            if "prompt" in e:
                prompt.setdefault(req, e["prompt"])
        if kind == "load_planned":
            planned_tokens[req] = e.get("tokens", 0)
        elif kind == "load_read":
            reads.setdefault(req, e)
        elif kind == "bind":
            binds.setdefault(at, e["t"])
            for loading in e.get("loads", ()):
                first.setdefault(("handed", loading), e["t"])
        elif kind == "saves_gathered":
            gathered.setdefault(at, e["t"])
        elif kind == "forward_end":
            forwards.setdefault(at, e["t"])
        elif kind == "step_end":
            for loaded in e.get("loaded", ()):
                first.setdefault(("reported", loaded), e["t"])
        elif kind == "step":
            for r, (before, n) in e.get("scheduled", {}).items():
                computing[r].append((at, before, n))
    steps = SimpleNamespace(binds=binds, gathered=gathered, forwards=forwards)
    found = [_phases(r, prompt[r], first, planned_tokens.get(r, 0), reads.get(r), steps, computing[r])
             for r in prompt if r in computing]
    found = [p for p in found if p is not None]
    return sorted(found, key=lambda p: first.get(("arrived", p.req), first.get(("lookup", p.req), 0.0)))


def _phases(req: str, prompt: int, first: dict, planned: int, read: dict | None, by_step: SimpleNamespace,
            steps: list[tuple[tuple, int, int]]) -> RequestPhases | None:
    binds, gathered, forwards = by_step.binds, by_step.gathered, by_step.forwards
    prefill = [(s, before, n) for s, before, n in steps if before < prompt and s in binds and s in forwards]
    if not prefill or prefill[-1][1] + prefill[-1][2] < prompt:
        return None  # its last prompt token not computed within the timeline
    start = first.get(("arrived", req), first.get(("lookup", req)))
    found = RequestPhases(req, prompt, loaded_tokens=planned, steps=len(prefill),
                          computed_tokens=sum(min(n, prompt - before) for _, before, n in prefill))
    begin = binds[prefill[0][0]]
    marks = [("queued", begin if start is None else start)]
    if read is not None and ("handed", req) in first:
        found.load_bytes = int(read.get("bytes", 0))
        marks += [("waiting for the worker", first.get(("load_planned", req), marks[0][1])),
                  ("reading", first[("handed", req)]), ("reporting", read["t"]),
                  ("rescheduling", first.get(("reported", req), read["t"]))]
    marks.append(("", begin))
    for (name, at), (_, until) in zip(marks, marks[1:]):
        found.phases[name] = max(0.0, until - at)
    gathering = sum(gathered.get(s, binds[s]) - binds[s] for s, _, _ in prefill)
    computing = sum(forwards[s] - gathered.get(s, binds[s]) for s, _, _ in prefill)
    found.phases["gathering saves"] = gathering
    found.phases["computing"] = computing
    found.phases["between its steps"] = max(0.0, forwards[prefill[-1][0]] - begin - gathering - computing)
    return found

"""A request's phases from the connector's timeline (analysis/request_phases.py) and their table
(record/timeline_table.py): a tier hit's load phase by phase, a cold prompt over two steps, an engine hit, an
unfinished request left out, the last step's saves gathered at a step's start, a damaged line named."""

import json

import pytest

from pytest_kvoffload.analysis.request_phases import TimelineError, events_from_lines, request_phases
from pytest_kvoffload.record.timeline_table import kind_of, timeline_table


def ms(x):
    return x / 1e3


def timeline():
    s, w = "scheduler", "worker"
    return [
        # a tier hit of 1,024 tokens, 768 loaded
        {"t": 0.0, "event": "arrived", "side": s, "req": "hit", "prompt": 1024},
        {"t": ms(1), "event": "lookup", "side": s, "req": "hit", "computed": 0, "load": 768, "prompt": 1024},
        {"t": ms(2), "event": "load_planned", "side": s, "req": "hit", "tokens": 768},
        {"t": ms(3), "event": "step", "side": s, "step": 5, "scheduled": {}},
        {"t": ms(4), "event": "bind", "side": w, "step": 5, "loads": ["hit"]},
        {"t": ms(5), "event": "forward_end", "side": w, "step": 5, "saves": []},
        {"t": ms(14), "event": "load_read", "side": w, "req": "hit", "started": ms(4), "bytes": 9_000_000, "chunks": 3},
        {"t": ms(15), "event": "step_end", "side": w, "step": 5, "loaded": ["hit"], "saved": []},
        {"t": ms(16), "event": "step", "side": s, "step": 6, "scheduled": {"hit": [768, 256]}},
        {"t": ms(17), "event": "bind", "side": w, "step": 6, "loads": []},
        {"t": ms(27), "event": "forward_end", "side": w, "step": 6, "saves": ["hit"]},
        # a cold prompt of 2,048 tokens over two steps, and an engine hit of 1,024 with 512 cached
        {"t": ms(30), "event": "arrived", "side": s, "req": "cold", "prompt": 2048},
        {"t": ms(31), "event": "arrived", "side": s, "req": "engine", "prompt": 1024},
        {"t": ms(32), "event": "step", "side": s, "step": 7, "scheduled": {"cold": [0, 1024]}},
        {"t": ms(33), "event": "bind", "side": w, "step": 7, "loads": []},
        {"t": ms(53), "event": "forward_end", "side": w, "step": 7, "saves": []},
        {"t": ms(56), "event": "step", "side": s, "step": 8, "scheduled": {"cold": [1024, 1024], "engine": [512, 512]}},
        {"t": ms(57), "event": "bind", "side": w, "step": 8, "loads": []},
        {"t": ms(59), "event": "saves_gathered", "side": w, "step": 8, "chunks": 4},  # the last step's saves
        {"t": ms(87), "event": "forward_end", "side": w, "step": 8, "saves": []},
        # arrived, never computed
        {"t": ms(90), "event": "arrived", "side": s, "req": "late", "prompt": 512},
    ]


def test_a_tier_hit_phase_by_phase():
    found = {p.req: p for p in request_phases(timeline())}
    assert set(found) == {"hit", "cold", "engine"}  # "late" never computed its prompt
    hit = found["hit"]
    want = {"queued": 2, "waiting for the worker": 2, "reading": 10, "reporting": 1, "rescheduling": 2,
            "gathering saves": 0, "computing": 10, "between its steps": 0}
    assert {k: round(v * 1e3, 6) for k, v in hit.phases.items()} == want
    assert hit.total == pytest.approx(ms(27)) and hit.read_gbps == pytest.approx(0.9)
    assert kind_of(hit) == "tier hit, 75% loaded"


def test_steps_of_a_long_prompt_and_the_gap_between_them():
    found = {p.req: p for p in request_phases(timeline())}
    cold, engine = found["cold"], found["engine"]
    assert cold.steps == 2 and cold.computed_tokens == 2048 and kind_of(cold) == "cold"
    assert cold.phases["computing"] == pytest.approx(ms(48)) and cold.phases["gathering saves"] == pytest.approx(ms(2))
    assert cold.phases["between its steps"] == pytest.approx(ms(4))
    assert "reading" not in cold.phases and cold.total == pytest.approx(ms(57))
    assert kind_of(engine) == "engine hit, 50% cached" and engine.phases["queued"] == pytest.approx(ms(26))


def test_the_table_has_each_request_and_each_kinds_medians():
    text = timeline_table(request_phases(timeline()), per_request=True)
    assert "tier hit, 75% loaded" in text and "engine hit, 50% cached" in text and "cold" in text
    assert "0.90" in text  # the hit's read rate, GB/s
    medians = timeline_table(request_phases(timeline()), per_request=False)
    assert len(medians.splitlines()) == 2 + 3  # headers, rule, one row a kind


def test_a_damaged_line_is_named_and_a_cut_last_line_skipped():
    lines = [json.dumps(e) for e in timeline()]
    assert len(events_from_lines(lines + ['{"t": 1.0, "ev'], "t.jsonl")) == len(lines)
    with pytest.raises(TimelineError, match=r"^t.jsonl line 3: not a timeline event"):
        events_from_lines(lines[:2] + ["[1, 2]"] + lines[2:], "t.jsonl")


def test_two_servers_in_one_file_keep_their_steps_apart():
    def server(name, shift):
        out = []
        for e in timeline():
            e = {**e, "server": name, "t": e["t"] + shift}
            if "req" in e:
                e["req"] = f"{name}-{e['req']}"
            for key in ("loads", "loaded"):
                if key in e:
                    e[key] = [f"{name}-{r}" for r in e[key]]
            if "scheduled" in e:
                e["scheduled"] = {f"{name}-{r}": v for r, v in e["scheduled"].items()}
            out.append(e)
        return out
    # The same step numbers on both, the second server's steps 5 ms later: each request's phases as alone.
    found = {p.req: p for p in request_phases(server("a", 0.0) + server("b", ms(5)))}
    alone = {p.req: p for p in request_phases(timeline())}
    for name in ("a", "b"):
        for req, p in alone.items():
            assert found[f"{name}-{req}"].phases == pytest.approx(p.phases)

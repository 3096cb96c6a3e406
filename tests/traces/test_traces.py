import json

import pytest

from pytest_kvoffload.traces.read import Scaling, TraceError, build_prompt, read_trace, select

from pathlib import Path

# CI lays shared/ beside the clone, as on a developer's machine.
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"


def write(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return path


def mooncake(ts, length, ids):
    return {"timestamp": ts, "input_length": length, "output_length": 4, "hash_ids": ids}


def test_reads_mooncake_and_scales_time(tmp_path):
    trace = read_trace(write(tmp_path, [mooncake(1000, 1024, [0, 1]), mooncake(3000, 512, [0])]))
    assert trace.format == "mooncake"
    requests = select(trace, Scaling(time_factor=0.5))
    assert [r.arrival_s for r in requests] == [0.0, 1.0]


def test_detects_bailian(tmp_path):
    rec = {"chat_id": 7, "parent_chat_id": -1, "timestamp": 2.5, "input_length": 48, "output_length": 3,
           "turn": 1, "hash_ids": [4, 5, 6]}
    trace = read_trace(write(tmp_path, [rec]))
    assert trace.format == "bailian" and trace.requests[0].chat_id == "7"
    assert len(build_prompt(trace.requests[0], "bailian", Scaling(), 32000)) == 48


def test_shared_leading_ids_share_tokens_and_nothing_else(tmp_path):
    trace = read_trace(write(tmp_path, [mooncake(0, 2048, [1, 2, 3, 4]), mooncake(1, 2048, [1, 2, 9, 10]),
                                        mooncake(2, 2048, [5, 2, 3, 4])]))
    scaling = Scaling(tokens_per_block=32)
    a, b, c = (build_prompt(r, "mooncake", scaling, 32000) for r in trace.requests)
    assert len(a) == 128
    assert a[:64] == b[:64] and a[64:96] != b[64:96]
    # Equal later ids after a different first id share nothing: a block depends on its whole prefix.
    assert a[:32] != c[:32] and a[32:64] != c[32:64]


def test_partial_last_block_and_window_and_limit(tmp_path):
    trace = read_trace(write(tmp_path, [mooncake(t * 1000, 700, [t, t + 100]) for t in range(10)]))
    chosen = select(trace, Scaling(limit=3, window_s=(2.0, 9.0)))
    assert [r.line for r in chosen] == [3, 4, 5]
    assert len(build_prompt(chosen[0], "mooncake", Scaling(tokens_per_block=64), 32000)) == round(700 * 64 / 512)


@pytest.mark.parametrize("lines,match", [
    ([], "empty; expected one JSON object per line"),
    (["{not json"], "line 1: not JSON"),
    ([{"timestamp": 0, "input_length": 5}], "line 1: missing output_length, hash_ids"),
    ([mooncake(5, 10, [1]), mooncake(4, 10, [1])], "line 2: timestamp goes backwards"),
    ([mooncake(0, "x", [1])], "line 1: timestamp, lengths and hash_ids must be numbers"),
    (["[1, 2]"], "line 1: expected a JSON object per line"),
])
def test_bad_traces_name_the_line(tmp_path, lines, match):
    with pytest.raises(TraceError, match=match):
        read_trace(write(tmp_path, lines))


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="expected one of mooncake, bailian"):
        read_trace(write(tmp_path, [mooncake(0, 1, [1])]), fmt="azure")


def test_the_shared_mooncake_trace(tmp_path):
    if not SHARED.exists():
        pytest.skip("shared Mooncake trace not present")
    trace = read_trace(SHARED)
    assert len(trace.requests) == 3993 and trace.format == "mooncake"
    assert Scaling(tokens_per_block=16, time_factor=0.1, limit=50).describe("mooncake").startswith(
        "16 tokens per 512-token trace block")

import json

import pytest

from pytest_kvoffload.cli import main
from pytest_kvoffload.core.first_order import estimate
from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.drive.probe import probe_disk


@pytest.mark.parametrize("model,tokens,params,gbps", [
    ("llama-3.2-3b", 8192, None, 7.24),
    ("llama-3.2-3b", 81920, None, 2.76),
    ("llama-3.3-70b", 32768, 70.55e9, 0.88),
])
def test_estimate_reproduces_the_seed(model, tokens, params, gbps):
    assert round(estimate(load_model(model), tokens, params=params).required_gbps, 2) == gbps


def test_fp8_kv_halves_the_requirement():
    m = load_model("llama-3.2-3b")
    assert estimate(m, 8192, kv_dtype_bytes=1).required_gbps == pytest.approx(estimate(m, 8192).required_gbps / 2)


def test_estimate_command(capsys):
    assert main(["estimate", "--model", "llama-3.2-3b", "--tokens", "8192"]) == 0
    assert "7.24" in capsys.readouterr().out


def test_estimate_unknown_model(capsys):
    assert main(["estimate", "--model", "nope", "--tokens", "8192"]) == 2
    assert "--model 'nope'" in capsys.readouterr().err


def test_probe_disk(tmp_path, capsys):
    result = probe_disk(tmp_path, request_bytes=1 << 20, total_bytes=8 << 20, repeats=1)
    assert result.read_gbps > 0 and result.write_gbps > 0 and list(tmp_path.iterdir()) == []
    assert main(["probe", "disk", str(tmp_path), "--size-mib", "4", "--repeats", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["read_gbps"] > 0


def test_probe_store_writes_and_reads_chunk_files_and_leaves_nothing(tmp_path, capsys):
    assert main(["probe", "disk", str(tmp_path), "--request-mib", "1", "--size-mib", "4", "--repeats", "1",
                 "--store", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["store"]["read_gbps"] > 0 and out["store"]["write_gbps"] > 0
    assert out["store"]["request_bytes"] == out["request_bytes"]  # the same bytes per file as per request
    assert list(tmp_path.iterdir()) == []


def test_probe_missing_folder(tmp_path, capsys):
    assert main(["probe", "disk", str(tmp_path / "no")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_report_of_a_missing_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no run.json there" in capsys.readouterr().err


def test_probe_with_fio_missing_is_one_line(tmp_path, capsys, monkeypatch):
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["probe", "disk", str(tmp_path), "--size-mib", "4", "--repeats", "1", "--fio"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvoffload probe disk --fio: fio is not installed; install it (e.g. apt install fio) to compare "
                   "the probe with it")


def test_probe_in_bursts_prints_the_pattern_against_the_continuous_passes(tmp_path, capsys):
    assert main(["probe", "disk", str(tmp_path), "--request-mib", "1", "--size-mib", "4", "--repeats", "1",
                 "--bursts", "2", "--gap-ms", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    bursts = out["bursts"]
    assert bursts["burst"] == bursts["read_burst"] == 2 and bursts["gap_s"] == 0.01
    assert min(bursts["write_gbps"], bursts["overwrite_gbps"], bursts["read_gbps"]) > 0
    assert bursts["request_bytes"] == out["request_bytes"]  # the same requests as the continuous passes
    assert main(["probe", "disk", str(tmp_path), "--request-mib", "1", "--size-mib", "4", "--repeats", "1",
                 "--bursts", "2"]) == 0
    assert "bursts / continuous: read" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        main(["probe", "disk", str(tmp_path), "--bursts", "0"])
    assert "--bursts" in capsys.readouterr().err


def test_timeline_command_prints_the_phases_and_names_bad_files(tmp_path, capsys):
    hit = [{"t": 0.0, "event": "arrived", "req": "hit", "prompt": 1024},
           {"t": 0.002, "event": "load_planned", "req": "hit", "tokens": 768},
           {"t": 0.004, "event": "bind", "step": 5, "loads": ["hit"]},
           {"t": 0.014, "event": "load_read", "req": "hit", "started": 0.004, "bytes": 9_000_000, "chunks": 3},
           {"t": 0.015, "event": "step_end", "step": 5, "loaded": ["hit"]},
           {"t": 0.016, "event": "step", "step": 6, "scheduled": {"hit": [768, 256]}},
           {"t": 0.017, "event": "bind", "step": 6, "loads": []},
           {"t": 0.027, "event": "forward_end", "step": 6, "saves": ["hit"]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in hit) + "\n")
    assert main(["timeline", str(path), "--requests"]) == 0
    out = capsys.readouterr().out
    assert "reading" in out and "tier hit, 75% loaded" in out
    assert main(["timeline", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"kvoffload timeline: {tmp_path / 'missing.jsonl'}: No such file")
    path.write_text('{"t": 1, "event": "arrived"}\nnot json\n{"t": 2, "event": "bind", "step": 1}\n')
    assert main(["timeline", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (f"kvoffload timeline: {path} line 2: not a timeline event (a JSON "
                                               f"object with t and event, as the connector's timeline option writes)")
    path.write_text('{"t": 1, "event": "bind", "step": 1}\n')
    assert main(["timeline", str(path)]) == 2
    assert "no request computed its prompt in it" in capsys.readouterr().err
    path.write_bytes(b"\xff\xfe\x00")
    assert main(["timeline", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"kvoffload timeline: {path} is not text (a timeline is JSON lines)"

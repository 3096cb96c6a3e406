import numpy as np
import pytest

from pytest_kvoffload.cli import main
from pytest_kvoffload.records import RunWriter
from pytest_kvoffload.stats import cell_table


def write_run(path, ttfts_by_cell, model="tiny-llama", seed=0):
    writer = RunWriter(path, path.name, {"model": {"name": model}}, {})
    rng = np.random.default_rng(seed)
    for (backend, length, state), center in ttfts_by_cell.items():
        for _ in range(7):
            writer.add_measurement({"backend": backend, "length": length, "fraction": 0.0 if state == "cold" else 1.0,
                                    "state": state, "purpose": "measure", "prompt_tokens": length,
                                    "client_ttft_s": center * (1 + rng.normal(0, 0.03)), "cached_by_source": {}})
    writer.finish("complete", cell_table(writer.data["measurements"]))
    return path


CELLS = {("gpu-only", 1024, "cold"): 0.20, ("gpu-only", 1024, "engine-hit"): 0.05,
         ("kvoffload-disk", 4096, "tier-hit"): 0.12}


def test_planted_regression_fails_the_gate(tmp_path, capsys):
    base = write_run(tmp_path / "base", CELLS)
    slower = dict(CELLS)
    slower[("kvoffload-disk", 4096, "tier-hit")] = 0.18
    new = write_run(tmp_path / "new", slower, seed=1)
    assert main(["compare", str(base), str(new), "--fail-above", "10%"]) == 1
    captured = capsys.readouterr()
    assert "slower" in captured.out
    assert "FAIL: 1 cell(s) slower" in captured.err and "kvoffload-disk/4096/1.0/tier-hit" in captured.err


def test_pure_noise_has_no_slower_verdict(tmp_path, capsys):
    base = write_run(tmp_path / "base", CELLS, seed=2)
    new = write_run(tmp_path / "new", CELLS, seed=3)
    assert main(["compare", str(base), str(new)]) == 0
    out = capsys.readouterr().out
    verdicts = [line.rsplit("  ", 1)[-1].strip() for line in out.splitlines()[3:6]]
    assert verdicts and all(v in ("within noise", "faster") for v in verdicts)
    assert "ok: no cell slower" in out


def test_a_regression_below_the_threshold_passes(tmp_path):
    base = write_run(tmp_path / "base", CELLS)
    slower = {k: v * 1.3 for k, v in CELLS.items()}
    new = write_run(tmp_path / "new", slower, seed=1)
    assert main(["compare", str(base), str(new), "--fail-above", "50%"]) == 0


def test_different_models_are_refused_unless_forced(tmp_path, capsys):
    base = write_run(tmp_path / "base", CELLS)
    new = write_run(tmp_path / "new", CELLS, model="llama-3.2-3b")
    assert main(["compare", str(base), str(new)]) == 2
    assert "different models (tiny-llama vs llama-3.2-3b); pass --force" in capsys.readouterr().err
    assert main(["compare", str(base), str(new), "--force"]) == 0


@pytest.mark.parametrize("value", ["ten", "-5%"])
def test_bad_threshold(tmp_path, value, capsys):
    base = write_run(tmp_path / "base", CELLS)
    assert main(["compare", str(base), str(base), f"--fail-above={value}"]) == 2
    assert "--fail-above" in capsys.readouterr().err

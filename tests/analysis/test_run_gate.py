from pathlib import Path

import numpy as np
import pytest

from pytest_kvoffload.cli import main
from pytest_kvoffload.record.run_record import RunWriter
from pytest_kvoffload.analysis.cell_stats import cell_table


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
    assert "MISSED: kvoffload-disk tier-hit over 1 cell(s) 1.5" in captured.out
    assert "FAIL: against the previous run: 2 verdict(s) missed (slower than 10%, shown at 95%); worst" in captured.err
    assert "kvoffload-disk" in captured.err and "1.50x" in captured.err


def test_pure_noise_passes_every_verdict(tmp_path, capsys):
    base = write_run(tmp_path / "base", CELLS, seed=2)
    new = write_run(tmp_path / "new", CELLS, seed=3)
    assert main(["compare", str(base), str(new)]) == 0
    out = capsys.readouterr().out
    assert "3 cell(s):" in out and out.count(" met\n") + out.count(" met") >= 3
    assert "ok: every backend and state within 10%" in out


def test_a_run_compared_with_itself_passes(tmp_path, capsys):
    base = write_run(tmp_path / "base", CELLS, seed=2)
    assert main(["compare", str(base), str(base)]) == 0
    assert "UNDECIDED" not in capsys.readouterr().err


def test_a_noisy_run_compared_with_itself_passes_and_its_rounds_under_another_name_do_not(tmp_path, capsys):
    """The same run on both sides: every ratio is exactly 1. The control: the same numbers recorded as another
    run are two runs whose noise (30% a round, 3 rounds) bounds nothing, so they stay undecided."""
    import json
    base, _ = one_cell_runs(tmp_path, 1.0, 0.3, rounds=3)
    assert main(["compare", base, base]) == 0
    assert "the same run on both sides" in capsys.readouterr().out
    other = json.loads((Path(base) / "run.json").read_text())
    other["run_id"] = "another"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "run.json").write_text(json.dumps(other))
    assert main(["compare", base, str(tmp_path / "other")]) == 3


def test_a_regression_below_the_threshold_passes(tmp_path):
    base = write_run(tmp_path / "base", CELLS)
    slower = {k: v * 1.3 for k, v in CELLS.items()}
    new = write_run(tmp_path / "new", slower, seed=1)
    assert main(["compare", str(base), str(new), "--fail-above", "50%", "--fail-above-p90", "50%"]) == 0


def one_cell_runs(tmp_path, factor, noise, rounds=7, seed=0):
    """Two runs of one cell: the new one `factor` slower, both with `noise` relative spread per round."""
    tmp_path.mkdir(parents=True, exist_ok=True)

    def run(name, centre, s):
        writer = RunWriter(tmp_path / name, name, {"model": {"name": "tiny-llama"}}, {})
        rng = np.random.default_rng(s)
        for _ in range(rounds):
            writer.add_measurement({"backend": "gpu-only", "length": 1024, "fraction": 0.0, "state": "cold",
                                    "purpose": "measure", "prompt_tokens": 1024, "cached_by_source": {},
                                    "client_ttft_s": centre * float(np.exp(rng.normal(0, noise)))})
        writer.finish("complete", cell_table(writer.data["measurements"]))
        return str(tmp_path / name)
    return run("base", 0.2, seed), run("new", 0.2 * factor, seed + 100)


@pytest.mark.parametrize("factor, noise, codes, least", [
    (1.12, 0.02, {1}, 6),     # 12% slower, quiet: missed in every draw
    (1.05, 0.02, {0, 3}, 5),  # 5% slower, quiet: within the 10% limit at 95% (one draw in six measured 7%: undecided)
    (1.08, 0.08, {3}, 6),     # 8% slower, noisy: could be past 10%, not shown to be: undecided, never a pass
    (1.00, 0.02, {0}, 6),     # no change
])
def test_near_misses_on_either_side_of_the_limit(tmp_path, capsys, factor, noise, codes, least):
    got = []
    for seed in range(6):  # six draws, not one lucky one
        base, new = one_cell_runs(tmp_path / str(seed), factor, noise, seed=seed)
        got.append(main(["compare", base, new]))
        err = capsys.readouterr().err
        assert ("UNDECIDED: " in err) == (got[-1] == 3) and ("FAIL: " in err) == (got[-1] == 1)
    assert set(got) <= codes and got.count(min(codes)) >= least, got


def test_a_p90_is_compared_only_with_enough_rounds_and_then_decides(tmp_path, capsys):
    from pytest_kvoffload.core.tolerances import GATE_P90_ROUNDS
    base, new = one_cell_runs(tmp_path, 1.0, 0.02, rounds=5)
    assert main(["compare", base, new]) == 0
    assert f"p90 not compared for 1 cell(s): fewer than {GATE_P90_ROUNDS} rounds" in capsys.readouterr().out

    def run(name, tail, seed):
        writer = RunWriter(tmp_path / name, name, {"model": {"name": "tiny-llama"}}, {})
        rng = np.random.default_rng(seed)
        for i in range(60):
            slow = tail if i % 4 == 3 else 1.0  # every fourth round slower: the tail, not the centre
            writer.add_measurement({"backend": "gpu-only", "length": 1024, "fraction": 0.0, "state": "cold",
                                    "purpose": "measure", "prompt_tokens": 1024, "cached_by_source": {},
                                    "client_ttft_s": 0.2 * slow * float(np.exp(rng.normal(0, 0.01)))})
        writer.finish("complete", cell_table(writer.data["measurements"]))
        return str(tmp_path / name)

    assert main(["compare", run("b", 1.3, 1), run("n", 1.3 * 1.5, 2), "--fail-above", "30%"]) == 1
    assert "p90 slower" not in capsys.readouterr().out  # the message names the verdict, not the old wording
    assert main(["compare", run("b2", 1.3, 1), run("n2", 1.3, 2)]) == 0


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


def test_a_drift_of_5_percent_a_night_passes_night_to_night_and_fails_against_the_pin(tmp_path, capsys):
    nights = [write_run(tmp_path / f"night{n}", {k: v * 1.05 ** n for k, v in CELLS.items()}, seed=n)
              for n in range(6)]
    pin = nights[0]
    night_to_night = [main(["compare", str(nights[n - 1]), str(nights[n])]) for n in range(1, 6)]
    # None fails (1); a night whose noise reaches past 10% is undecided (3), never a silent pass.
    assert set(night_to_night) <= {0, 3} and 0 in night_to_night
    with_pin = [main(["compare", str(nights[n - 1]), str(nights[n]), "--baseline", str(pin)]) for n in range(1, 6)]
    assert with_pin[0] in (0, 3) and with_pin[-1] == 1 and 1 in with_pin[:3]
    assert "FAIL: against the pinned baseline" in capsys.readouterr().err


def test_a_run_missing_a_backend_fails_unless_allowed(tmp_path, capsys):
    base = write_run(tmp_path / "base", CELLS)
    partial = write_run(tmp_path / "new", {k: v for k, v in CELLS.items() if k[0] == "gpu-only"}, seed=1)
    assert main(["compare", str(base), str(partial)]) == 1
    assert "(backends kvoffload-disk missing); --allow-missing to accept" in capsys.readouterr().err
    assert main(["compare", str(base), str(partial), "--allow-missing"]) == 0


# ---- a gate for nights: user-facing backends only, p90 with its own limit, undecided is not a pass ----

FIXTURES = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "compare"


def test_two_nights_that_differ_only_in_their_emulated_servers_pass():
    # night-a ran the admission suite's second control, kvoffload-disk[slow2]; night-b did not (committed runs).
    assert main(["compare", str(FIXTURES / "night-a"), str(FIXTURES / "night-b")]) == 0
    assert main(["compare", str(FIXTURES / "night-b"), str(FIXTURES / "night-a")]) == 0


def test_a_planted_15_percent_slower_p90_of_3_rounds_is_said_not_compared(capsys):
    # night-p90's cells are night-a's with the p90 of one cell 15% slower; 3 rounds cannot estimate a p90.
    assert main(["compare", str(FIXTURES / "night-a"), str(FIXTURES / "night-p90")]) == 0
    assert "p90 not compared for 72 cell(s): fewer than 20 rounds" in capsys.readouterr().out


def test_a_workflow_reruns_undecided_nights_with_more_rounds():
    workflow = (Path(__file__).resolve().parents[2] / ".github" / "workflows" / "nightly-gpu.yml").read_text()
    assert "-eq 3" in workflow and "--kv-rounds" in workflow




REAL = FIXTURES / "make-test"  # make test's run of 2026-12-04: 2 rounds a cell, 384 and 1,280 tokens


def planted(tmp_path, backend, factor):
    import json
    run = json.loads((REAL / "run.json").read_text())
    for m in run["measurements"]:
        if m["backend"] == backend:
            m["client_ttft_s"] *= factor
    run["cells"] = cell_table(run["measurements"])
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / "run.json").write_text(json.dumps(run))
    return str(tmp_path / "planted")


def test_a_real_run_compared_with_itself_passes(capsys):
    assert main(["compare", str(REAL), str(REAL)]) == 0
    assert "UNDECIDED" not in capsys.readouterr().out


@pytest.mark.parametrize("factor, code", [(1.12, 1), (1.25, 1), (1.0, 0)])
def test_a_slowdown_planted_in_one_backend_of_a_real_run(tmp_path, capsys, factor, code):
    assert main(["compare", str(REAL), planted(tmp_path, "kvoffload-disk", factor)]) == code
    out = capsys.readouterr()
    if code == 1:
        assert "MISSED: kvoffload-disk tier-hit over 4 cell(s)" in out.out and "gpu-only" not in out.err


def bench_shaped_run(rng, name, sigma, factor=1.0, planted=None):
    """make bench's shape: five backends, 512 to 2,048 tokens, cold, engine and tier hits, 3 rounds a cell."""
    ms = []
    for b in ("gpu-only", "native-cpu", "native-disk", "lmcache-disk", "kvoffload-disk"):
        for length, cold in ((512, 0.4), (1024, 0.9), (2048, 2.3)):
            for fraction, state, t in ((0.0, "cold", cold), (0.5, "engine-hit", cold * 0.6),
                                       (1.0, "engine-hit", 0.03 + length / 1e5), (0.5, "tier-hit", cold * 0.6),
                                       (1.0, "tier-hit", 0.04 + length / 1e5)):
                if state == "tier-hit" and b == "gpu-only":
                    continue
                for _ in range(3):
                    ms.append({"backend": b, "length": length, "fraction": fraction, "state": state,
                               "client_ttft_s": t * (factor if b == planted else 1.0) * float(np.exp(rng.normal(0, sigma)))})
    cells = [{k: m[k] for k in ("backend", "length", "fraction", "state")} | {"ttft": {"p50": m["client_ttft_s"]}}
             for m in ms[::3]]
    return {"run_id": name, "measurements": ms, "cells": cells}


def test_two_runs_of_one_commit_pass_and_a_12_percent_slower_backend_is_missed():
    """Simulated A/A of make bench's shape (69 cells) at 5% noise a round, this VM's idle level: no cell fails
    the gate through sheer number (its lower bound is split over the cells) and no unresolved cell holds it
    open; the same runs with one backend 12% slower are missed. Measured over 100 draws: 82 pass and 18 are
    undecided (a group's bound past 10%), where per-cell bounds at 95% passed 15, failed 18 and left 67
    undecided; at 3% noise 100 pass, at 8% 90 are undecided and 3 fail (docs/comparing.md)."""
    from pytest_kvoffload.analysis.run_gate import compare
    rng = np.random.default_rng(11)
    passed = missed = 0
    for _ in range(30):
        same = compare(bench_shaped_run(rng, "a", 0.05), bench_shaped_run(rng, "b", 0.05), 0.10)
        passed += not same.failures() and not same.open()
        slower = compare(bench_shaped_run(rng, "a", 0.05), bench_shaped_run(rng, "b", 0.05, 1.12, "kvoffload-disk"), 0.10)
        missed += any(v.what.startswith("kvoffload-disk") for v in slower.failures())
    assert passed >= 20 and missed >= 27, (passed, missed)

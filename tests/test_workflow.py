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

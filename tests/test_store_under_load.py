"""scripts/store_under_load.py, the measurement behind the connector's write figure: it must not rot."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "store_under_load.py"


def test_prints_idle_and_loaded_figures_and_leaves_nothing(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--rounds", "1", "--mib", "4"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert [line.split(" write")[0].strip() for line in lines] == [
        "probe idle", "store idle", "probe beside torch", "store beside torch"]
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "no")], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "not a folder" in result.stderr


def test_bad_cpus_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--cpus", "999"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "--cpus 999" in result.stderr

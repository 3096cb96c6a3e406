"""scripts/gpu_check.py, the prepared script for a lent GPU, on this machine's CPU path: it must not rot."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_round_trips_are_byte_exact_without_vllm(tmp_path):
    out = tmp_path / "gpu_check.json"
    # As on the lent machine: vLLM cannot be imported, so the script stubs its two base classes.
    code = ("import runpy, sys; sys.modules['vllm'] = None; "
            f"sys.argv = ['gpu_check.py', '--out', {str(out)!r}, '--quick', '--device', 'cpu', '--store', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["ok"] and figures["vllm_stubbed"] and figures["device"] == "cpu"
    trip = figures["round_trips"][0]
    assert trip["byte_exact"] and trip["byte_exact_partial_chunk"] and trip["load_gbps"] > 0
    assert figures["drive"]["read_gbps"] > 0 and figures["copy"][str(figures["chunk_bytes"])] == {}
    assert "byte-exact yes" in result.stdout

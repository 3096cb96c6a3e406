"""scripts/trace_reads.py, the kernel-side look at a run's reads: its parser on a few tracefs lines (no root)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_reads.py"
spec = importlib.util.spec_from_file_location("trace_reads", SCRIPT)
trace_reads = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_reads)

# A load thread opens its chunk file, waits 2 ms for a read slot, reads; a raw probe thread reads beside it;
# a pytest thread opens and reads at once (the store's code); a small metadata read is left out. The raw
# thread's own open a second before (another pass's) does not make its read the store's.
TRACE = """\
          python-11400   [001] ..... 99.000000: sys_openat -> 0x6
  kvoffload-load-11306   [000] ..... 100.000000: sys_openat -> 0x18
  kvoffload-load-11306   [000] ..... 100.002000: block_bio_queue: 254,0 RS 524083200 + 2056 [kvoffload-load]
  kvoffload-load-11306   [000] ..... 100.002010: block_rq_issue: 254,0 RS 1052672 () 524083200 + 2056 be,0,4 [kvoffload-load]
          python-11400   [001] ..... 100.002100: block_bio_queue: 254,0 RS 600000000 + 2056 [python]
          python-11400   [001] ..... 100.002110: block_rq_issue: 254,0 RS 1052672 () 600000000 + 2056 be,0,4 [python]
          <idle>-0       [001] ..s1. 100.002910: block_rq_complete: 254,0 RS () 524083200 + 2056 be,0,4 [0]
          <idle>-0       [001] ..s1. 100.003010: block_rq_complete: 254,0 RS () 600000000 + 2056 be,0,4 [0]
          python-11500   [001] ..... 100.010000: sys_openat -> 0x6
          python-11500   [001] ..... 100.010020: block_bio_queue: 254,0 RS 700000000 + 2056 [python]
          python-11500   [001] ..... 100.010030: block_rq_issue: 254,0 RS 1052672 () 700000000 + 2056 be,0,4 [python]
          <idle>-0       [001] ..s1. 100.010530: block_rq_complete: 254,0 RS () 700000000 + 2056 be,0,4 [0]
          python-11500   [001] ..... 100.020000: block_bio_queue: 254,0 RA 169883448 + 8 [python]
"""


def test_reads_are_split_by_who_submitted_them_with_their_device_time_and_wait_for_a_slot():
    reads = {r["kind"]: r for r in trace_reads.parse(TRACE.splitlines())}
    assert set(reads) == {"kvoffload-load", "raw", "store"}
    load = reads["kvoffload-load"]
    assert abs(load["queued"] - load["opened"] - 0.002) < 1e-9  # from its open to its read's submission
    assert abs(load["completed"] - load["issued"] - 0.0009) < 1e-9
    assert reads["raw"]["opened"] is None
    lines = trace_reads.summary(list(reads.values()))
    row = next(line for line in lines if "kvoffload-load" in line)
    assert "beside 0.900 (1)" in row and "open to submission 2.000, 2.000" in row  # the raw read was in flight too
    assert "alone 0.500 (1)" in next(line for line in lines if "store" in line)


def test_no_command_is_one_line():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 2 and "give the command to trace" in result.stderr

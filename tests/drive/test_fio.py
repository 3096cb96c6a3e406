"""fio beside the drive probe: its command mirrors the probe's pattern and its report is read right.
No speed is asserted (speeds are printed, never asserted); the figures of this machine are in docs/."""

import json
import shutil

import pytest

from pytest_kvoffload.drive.fio import FioError, bandwidth_gbps, fio_command, run_fio


def test_command_mirrors_the_probe_pattern(tmp_path):
    argv = fio_command(tmp_path / "f", 1 << 20, 64 << 20, threads=2, write=True)
    assert "--bs=1048576" in argv and "--numjobs=2" in argv and "--size=33554432" in argv
    assert "--offset_increment=33554432" in argv and "--direct=1" in argv and "--ioengine=psync" in argv
    assert "--end_fsync=1" in argv and "--rw=write" in argv
    assert "--end_fsync=1" not in fio_command(tmp_path / "f", 1 << 20, 64 << 20, 2, write=False)


def test_report_bandwidth_and_a_report_that_is_not_one():
    report = "note: a warning first\n" + json.dumps({"jobs": [{"read": {"bw_bytes": 950_000_000}, "write": {}}]})
    assert bandwidth_gbps(report, write=False) == 0.95
    with pytest.raises(FioError, match="no JSON report"):
        bandwidth_gbps("fio: unknown option", write=False)


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_runs_with_the_probe_pattern_and_cleans_up(tmp_path):
    result = run_fio(tmp_path, 1 << 20, 8 << 20, repeats=1, threads=2)
    assert result.read_gbps > 0 and result.write_gbps > 0
    assert "--rw=read" in result.command and list(tmp_path.iterdir()) == []

"""probe_store_bursts: the store alone in the connector's save pattern, timed as the connector times saves."""

import time

import pytest

from pytest_kvoffload.probe import probe_store_bursts


def test_bursts_are_timed_without_the_gaps_between_them_and_leave_nothing(tmp_path):
    file_bytes, burst, gap_s = 64 << 10, 3, 0.1
    started = time.perf_counter()
    result = probe_store_bursts(tmp_path, file_bytes, burst, gap_s, total_bytes=4 * burst * file_bytes, repeats=1,
                                threads=2)
    elapsed = time.perf_counter() - started
    assert elapsed >= 4 * gap_s  # four bursts, each followed by its gap
    moved = 4 * burst * result.file_bytes
    # The control: the same bytes over the whole time, gaps included, is what a probe that counted the idle
    # time would report; the bursts' own walls are a small part of it here.
    assert result.write_gbps > 2 * moved / elapsed / 1e9
    assert result.burst == burst and result.gap_s == gap_s and "bursts of 3 chunks 100 ms apart" in result.describe()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_is_a_one_line_error(tmp_path):
    with pytest.raises(NotADirectoryError, match="not a folder"):
        probe_store_bursts(tmp_path / "nowhere", 4096, 2, 0.0)

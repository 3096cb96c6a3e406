"""The probes beside the connector: the store in bursts, writes over free files, the write reference for a mix."""

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


def test_writes_are_referred_to_the_drive_figure_for_what_they_did():
    from pytest_kvoffload.probe import ProbeResult, write_reference

    probe = ProbeResult("x", 1 << 20, 1 << 28, True, write_gbps=1.0, read_gbps=1.0, overwrite_gbps=4.0)
    assert write_reference(probe, 0.0) == 1.0 and write_reference(probe, 1.0) == 4.0
    # Half the bytes at each speed: the time adds (0.5 / 1 + 0.5 / 4), not the speeds.
    assert write_reference(probe, 0.5) == pytest.approx(1.6)
    unmeasured = ProbeResult("x", 1 << 20, 1 << 28, True, write_gbps=1.0, read_gbps=1.0)
    assert write_reference(unmeasured, 1.0) == 1.0


def test_the_drive_probe_also_writes_over_its_file_and_the_store_over_free_files(tmp_path):
    from pytest_kvoffload.probe import probe_disk, probe_store

    disk = probe_disk(tmp_path, request_bytes=64 << 10, total_bytes=1 << 20, repeats=1, threads=2)
    assert disk.overwrite_gbps > 0 and "write over it" in disk.describe()
    store = probe_store(tmp_path, 64 << 10, total_bytes=1 << 20, repeats=1, threads=2, over_share=1.0)
    assert store.write_gbps > 0
    assert list(tmp_path.iterdir()) == []


def test_leave_free_leaves_as_many_free_files_as_asked(tmp_path):
    from pytest_kvoffload.connector.store import ChunkStore, Layout
    from pytest_kvoffload.probe import leave_free

    store = ChunkStore(tmp_path, "probe", Layout(1, 1, 4096), keep_free=10)
    leave_free(store, 5)
    # Written one after another and each removed at once, every write would take the previous one's file
    # and one free file would be left: the control this count would catch.
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".free-")]) == 5
    assert not list(tmp_path.glob("*.kv"))
    store.drop_free()

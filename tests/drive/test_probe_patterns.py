"""The probes beside the connector: the drive and the connector's own save and load paths in its bursts, writes over
free files, the write reference for a mix."""

import os
import time
from pathlib import Path

import pytest


def test_writes_are_referred_to_the_drive_figure_for_what_they_did():
    from pytest_kvoffload.drive.probe import ProbeResult, write_reference
    from pytest_kvoffload.drive.rate import Rate

    probe = ProbeResult("x", 1 << 20, 1 << 28, True, write=Rate(1.0, 1.0, 1.0), read=Rate(1.0, 1.0, 1.0),
                        overwrite=Rate(4.0, 4.0, 4.0))
    assert write_reference(probe, 0.0) == 1.0 and write_reference(probe, 1.0) == 4.0
    # Half the bytes at each speed: the time adds (0.5 / 1 + 0.5 / 4), not the speeds.
    assert write_reference(probe, 0.5) == pytest.approx(1.6)
    unmeasured = ProbeResult("x", 1 << 20, 1 << 28, True, write=Rate(1.0, 1.0, 1.0), read=Rate(1.0, 1.0, 1.0))
    assert write_reference(unmeasured, 1.0) == 1.0


def test_the_drive_probe_also_writes_over_its_file_and_the_store_over_free_files(tmp_path):
    from pytest_kvoffload.drive.probe import probe_disk, probe_store

    disk = probe_disk(tmp_path, request_bytes=64 << 10, total_bytes=1 << 20, repeats=1, threads=2)
    assert disk.overwrite_gbps > 0 and "write over it" in disk.describe()
    store = probe_store(tmp_path, 64 << 10, total_bytes=1 << 20, repeats=1, threads=2, over_share=1.0)
    assert store.write_gbps > 0
    assert list(tmp_path.iterdir()) == []


def test_leave_free_leaves_as_many_free_files_as_asked(tmp_path):
    from pytest_kvoffload.connector.chunk_format import Layout
    from pytest_kvoffload.connector.store import ChunkStore
    from pytest_kvoffload.drive.probe import leave_free

    store = ChunkStore(tmp_path, "probe", Layout(1, 1, 4096), keep_free=10)
    leave_free(store, 5)
    # Written one after another and each removed at once, every write would take the previous one's file
    # and one free file would be left: the control this count would catch.
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".free-")]) == 5
    assert not list(tmp_path.glob("*.kv"))
    store.drop_free()


def test_the_drive_alone_in_bursts_is_timed_without_the_gaps_both_ways_and_leaves_nothing(tmp_path):
    from pytest_kvoffload.drive.probe import probe_disk_bursts, write_reference

    request_bytes, burst, gap_s = 64 << 10, 3, 0.05
    started = time.perf_counter()
    result = probe_disk_bursts(tmp_path, request_bytes, burst, gap_s, total_bytes=4 * burst * request_bytes,
                               repeats=1, threads=2, read_burst=2 * burst)
    elapsed = time.perf_counter() - started
    assert elapsed >= 10 * gap_s  # four bursts for each write (a fresh file, then over it), two reads
    # The control, as for the store: a figure counting the gaps would be below this.
    moved = 4 * burst * request_bytes
    assert min(result.write_gbps, result.overwrite_gbps, result.read_gbps) > 2 * 3 * moved / elapsed / 1e9
    assert "over it" in result.describe() and "bursts of 3 chunks; read" in result.describe()
    assert "in bursts of 6, 50 ms apart" in result.describe()
    assert probe_disk_bursts(tmp_path, request_bytes, burst, 0.0, total_bytes=moved, repeats=1).read_gbps == 0.0
    # Held to what the connector did, as the continuous probe is: its share over old blocks at the second figure.
    assert write_reference(result, 1.0) == pytest.approx(result.overwrite_gbps)
    assert write_reference(result, 0.0) == result.write_gbps
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NotADirectoryError, match="not a folder"):
        probe_disk_bursts(tmp_path / "nowhere", 4096, 2, 0.0)


def test_the_connectors_save_path_alone_in_bursts_is_timed_by_its_own_counters_and_leaves_nothing(tmp_path):
    from pytest_kvoffload.connector.io_memory import padded
    from pytest_kvoffload.connector.chunk_format import HEADER_SIZE
    from pytest_kvoffload.drive.worker_probe import probe_worker_bursts

    burst, gap_s, chunk_tokens, per_token = 3, 0.05, 32, 512
    import torch

    affinity, torch_threads = os.sched_getaffinity(0), torch.get_num_threads()
    started = time.perf_counter()
    result = probe_worker_bursts(tmp_path, {"chunk_tokens": chunk_tokens, "io_threads": 2}, layers=2, block_size=16,
                                 kv_bytes_per_token=per_token, element_bytes=2, burst=burst, gap_s=gap_s,
                                 total_bytes=4 * burst * (chunk_tokens * per_token + HEADER_SIZE), repeats=1,
                                 over_share=1.0, cpus={min(os.sched_getaffinity(0))}, read_burst=2 * burst)
    elapsed = time.perf_counter() - started
    assert result.file_bytes == padded(HEADER_SIZE + chunk_tokens * per_token)  # the model's chunk file
    assert elapsed >= 6 * gap_s  # four steps' saves, then their chunks loaded back two loads
    # The control, as for the other burst probes: a figure counting the gaps would be below this.
    assert min(result.write_gbps, result.read_gbps) > 2 * 4 * burst * result.file_bytes / elapsed / 1e9
    assert "bursts of 3 chunks, 100% over free files; read" in result.describe()
    assert "in loads of 6 chunks, 50 ms apart" in result.describe()
    # The caller's binding and torch threads back as they were.
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == torch_threads
    assert list(tmp_path.iterdir()) == []
    # Writes alone (read_burst 0, the default): no loads, and no read figure.
    writes_only = probe_worker_bursts(tmp_path, {"chunk_tokens": chunk_tokens, "io_threads": 2}, 2, 16, per_token, 2,
                                      burst, 0.0, total_bytes=burst * result.file_bytes, repeats=1)
    assert writes_only.write_gbps > 0 and "; read" not in writes_only.describe()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NotADirectoryError, match="not a folder"):
        probe_worker_bursts(tmp_path / "nowhere", {}, 2, 16, per_token, 2, 2, 0.0)


def test_the_drive_beside_the_rounds_sums_bytes_over_busy_time_and_leaves_nothing(tmp_path):
    from pytest_kvoffload.drive.round_reference import DriveBeside, chunks_of
    from pytest_kvoffload.drive.probe import BurstResult
    from pytest_kvoffload.drive.rate import Rate

    beside = DriveBeside(tmp_path, 64 << 10, threads=2)
    for chunks in (1, 3):
        began = time.perf_counter()
        measured = beside.after_round(chunks, idle_s=0.05)
        # The drive's rest before each burst, as before the connector's saves: once first, then after each way.
        assert time.perf_counter() - began >= 4 * 0.05
        assert measured.burst == chunks and measured.read_burst == chunks
        assert min(measured.write_gbps, measured.overwrite_gbps, measured.read_gbps) > 0
    assert list(tmp_path.iterdir()) == []
    assert beside.to_dict()["rounds"] == 2 and "2 rounds" in beside.describe()

    # Summed as the connector's counters are: bytes over busy seconds. One chunk at 1 GB/s and three at 2 GB/s
    # are 4 chunks in 2.5 chunk-seconds (1.6 GB/s); a mean or median of the rounds' rates (1.5) is the near miss.
    def round_of(chunks, gbps, over=4.0):
        return BurstResult("x", 1 << 20, chunks, 0.0, 2, Rate(gbps, gbps, gbps), Rate(over, over, over), chunks,
                           Rate(gbps, gbps, gbps))
    beside.rounds = [round_of(1, 1.0), round_of(3, 2.0)]
    assert beside.gbps("read") == pytest.approx(1.6)
    assert beside.spread("read") == Rate(1.5, 1.0, 2.0)
    # The connector's mix of new and recycled files: half its bytes at 1.6, half at 4 GB/s.
    assert beside.write_reference(0.5) == pytest.approx(1.0 / (0.5 / 4.0 + 0.5 / 1.6))
    assert beside.write_reference(0.0) == pytest.approx(1.6)

    # A prompt's chunk files: its whole blocks, the last one too, two blocks a file (the last may hold one).
    assert chunks_of(512, 128, 256) == 2 and chunks_of(384, 128, 256) == 2 and chunks_of(4096, 128, 256) == 16
    assert chunks_of(511, 128, 256) == 2 and chunks_of(100, 128, 256) == 0


def test_the_codes_share_is_the_median_of_paired_passes_not_a_ratio_of_medians():
    from pytest_kvoffload.drive.round_reference import paired_median, passes
    from pytest_kvoffload.drive.probe import BurstResult
    from pytest_kvoffload.drive.rate import Rate

    def drive(gbps):
        return BurstResult("x", 1 << 20, 6, 0.1, 2, Rate(gbps, gbps, gbps), Rate(), 8, Rate(gbps, gbps, gbps))
    # The drive moved between passes (1, 2, then 1 GB/s); the code kept 0.9 of it in every pass.
    drives = [drive(1.0), drive(2.0), drive(1.0)]
    workers = [drive(0.9), drive(1.8), drive(0.9)]
    assert paired_median(drives, workers, "read", 0.0) == pytest.approx(0.9)
    # The near miss, medians taken apart: 0.9 / 1.0 by luck here; with the drive fast in two passes of three
    # the unpaired ratio reads 0.9 / 2 = 0.45 where the paired one still reads 0.9.
    drives, workers = [drive(2.0), drive(2.0), drive(1.0)], [drive(1.8), drive(0.9), drive(0.9)]
    merged_drive, merged_worker = passes(drives), passes(workers)
    assert merged_worker.read_gbps / merged_drive.read_gbps == pytest.approx(0.45)
    assert paired_median(drives, workers, "read", 0.0) == pytest.approx(0.9)
    assert merged_drive.read == Rate(2.0, 1.0, 2.0)
    assert paired_median(drives, [], "read", 0.0) is None


def test_each_round_is_paired_with_the_drive_right_after_it_with_its_own_mix_of_writes():
    from pytest_kvoffload.drive.round_reference import DriveBeside, CountersMoved
    from pytest_kvoffload.drive.probe import BurstResult
    from pytest_kvoffload.drive.rate import Rate

    def drive(gbps, over):
        return BurstResult("x", 1 << 20, 4, 0.0, 2, Rate(gbps, gbps, gbps), Rate(over, over, over), 4,
                           Rate(gbps, gbps, gbps))
    # The counters' deltas over a round: 4 MB read in 4 ms (1 GB/s), 8 MB written in 4 ms (2 GB/s), 3 of
    # 4 chunks over recycled files.
    start = {"bytes_read": 10.0, "load_wall_seconds": 1.0, "bytes_written": 5.0, "save_wall_seconds": 1.0,
             "chunks_written": 2.0, "chunks_written_over_free": 0.0}
    end = {"bytes_read": 10.0 + 4e6, "load_wall_seconds": 1.004, "bytes_written": 5.0 + 8e6,
           "save_wall_seconds": 1.004, "chunks_written": 6.0, "chunks_written_over_free": 3.0}
    moved = CountersMoved.between(start, end)
    assert moved.gbps("read") == pytest.approx(1.0) and moved.gbps("write") == pytest.approx(2.0)
    assert moved.over_share == pytest.approx(0.75)
    assert CountersMoved().gbps("read") == 0.0

    beside = DriveBeside(Path("."), 1 << 20, threads=2)
    # The drive was slow right after the first round and fast after the second; the connector kept 0.9 of it
    # each time. Paired round by round the ratio is 0.9 in both; pairs off by one round (the near miss) would
    # read 0.9 / 2 = 0.45 and 1.8 / 1 = 1.8.
    beside.rounds = [drive(1.0, 1.0), drive(2.0, 4.0)]
    beside.connector = [CountersMoved(0.9e6, 1e-3, 0.9e6, 1e-3, 0.0), CountersMoved(1.8e6, 1e-3, 2.4e6, 1e-3, 0.5)]
    assert beside.round_ratios("read") == pytest.approx([0.9, 0.9])
    # Writes against that round's own mix: half over recycled files at 4, half fresh at 2 GB/s is 8/3 GB/s;
    # against the fresh write alone (the run's mix of the first round, 0) the near miss reads 1.2.
    assert beside.round_ratios("write") == pytest.approx([0.9, 2.4 / (1.0 / (0.5 / 4.0 + 0.5 / 2.0))])
    assert beside.to_dict()["read_round_ratios"] == {"median": pytest.approx(0.9), "low": pytest.approx(0.9),
                                                     "high": pytest.approx(0.9), "rounds": 2,
                                                     "each": pytest.approx([0.9, 0.9])}
    assert "read 0.90 (0.90 to 0.90, 2 rounds)" in beside.describe_pairs()
    # A round where the connector moved nothing (a miss) has no pair.
    beside.rounds.append(drive(1.0, 1.0))
    beside.connector.append(CountersMoved())
    assert len(beside.round_ratios("read")) == 2


def test_groups_are_handed_over_at_once_and_timed_without_the_gaps():
    from concurrent.futures import ThreadPoolExecutor

    from pytest_kvoffload.drive.probe import in_bursts, timed_groups

    handed = []

    def move(item):
        handed.append((item, time.perf_counter()))
        time.sleep(0.02)
        return time.perf_counter()

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=4) as pool:
        busy, moved = timed_groups(pool, move, [[1], [2, 3, 4]], gap_s=0.1)
    elapsed = time.perf_counter() - started
    assert moved == 4 and elapsed >= 0.2 + 0.04
    # Each group at once: two 20 ms requests, however many in the group; the control, the gaps counted, is 0.24.
    assert 0.04 <= busy < 0.1
    assert [item for item, _ in handed] == [1, 2, 3, 4]
    assert in_bursts([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_the_drive_reads_a_rounds_own_loads_and_counts_every_request_of_them(tmp_path, monkeypatch):
    from pytest_kvoffload.drive import probe

    request_bytes = 64 << 10
    groups_of = {}
    real = probe.timed_groups

    def recorded(pool, move, groups, gap_s):
        busy, moved = real(pool, move, groups, gap_s)
        groups_of[len(groups_of)] = [list(g) for g in groups]
        return 0.5, moved  # a fixed busy time: the figure is then what was counted over it

    monkeypatch.setattr(probe, "timed_groups", recorded)
    result = probe.probe_disk_bursts(tmp_path, request_bytes, 3, 0.0, total_bytes=3 * request_bytes, repeats=1,
                                     threads=2, read_burst=3, read_loads=(1, 3))
    write, read, over = groups_of[0], groups_of[1], groups_of[2]
    offsets = [0, request_bytes, 2 * request_bytes]
    assert write == over == [offsets]
    # The last chunk's file beside the engine hit, then the whole prompt's: the near misses are the prompt's
    # files at once (the reference before 2026-12-02) and the last load alone.
    assert read == [[offsets[-1]], offsets]
    assert result.read_gbps == pytest.approx(4 * request_bytes / 0.5 / 1e9)
    assert result.write_gbps == pytest.approx(3 * request_bytes / 0.5 / 1e9)
    assert "read" in result.describe() and "in loads of 1 and 3 chunks" in result.describe()
    # Loads of nothing (a round whose engine hit read nothing from the drive) are left out.
    assert probe.probe_disk_bursts(tmp_path, request_bytes, 3, 0.0, total_bytes=3 * request_bytes, repeats=1,
                                   read_loads=(0, 3)).read_loads == (3,)
    assert list(tmp_path.iterdir()) == []


def test_a_rounds_loads_are_the_files_its_hits_read_from_the_drive(tmp_path):
    from pytest_kvoffload.drive.round_reference import DriveBeside, files_spanned, round_loads

    # 512 tokens, blocks of 128, files of 256: the engine hit's last block is in the second file, the tier
    # hit reads both.
    assert round_loads({"device": 384, "disk": 128}, {"disk": 512}, 256) == (1, 2)
    # A last block that starts a file (640 tokens: blocks 0 to 4, the fifth alone in the third file).
    assert round_loads({"device": 512, "disk": 128}, {"disk": 640}, 256) == (1, 3)
    # Two blocks beside the engine that straddle a file boundary read two files: counted from where the engine
    # stops, not from the prompt's start (the near miss, one file).
    assert round_loads({"device": 384, "disk": 256}, {"disk": 640}, 256) == (2, 3)
    # Nothing from the drive beside the engine: no load.
    assert round_loads({"device": 512}, {"disk": 512}, 256) == (0, 2)
    assert files_spanned(200, 300, 256) == 2 and files_spanned(0, 0, 256) == 0 and files_spanned(0, 257, 256) == 2
    # The drive beside the rounds replays them; without loads, one load of the round's files (the control).
    beside = DriveBeside(tmp_path, 64 << 10, threads=2)
    assert beside.after_round(2, 0.0, loads=(1, 2)).read_loads == (1, 2)
    assert "in the round's own loads (1 then 2 chunks" in beside.describe()
    assert beside.after_round(2, 0.0).read_loads == () and beside.rounds[-1].read_burst == 2
    # Written as the connector wrote the round: a prefill of two steps saved its chunks in two batches.
    from pytest_kvoffload.drive.round_reference import CountersMoved
    assert beside.after_round(4, 0.0, CountersMoved(save_batches=2.0)).burst == 2
    assert beside.after_round(5, 0.0, CountersMoved(save_batches=2.0)).burst == 3
    assert beside.after_round(4, 0.0, CountersMoved()).burst == 4  # no saves counted: one burst
    assert CountersMoved.between({"save_batches": 3.0}, {"save_batches": 5.0}).save_batches == 2.0
    assert list(tmp_path.iterdir()) == []


def test_the_targets_ratios_print_three_places_so_a_near_miss_does_not_read_as_the_target():
    from pytest_kvoffload.drive.round_reference import DriveBeside, pattern_lines
    from pytest_kvoffload.drive.probe import BurstResult
    from pytest_kvoffload.drive.rate import Rate

    beside = DriveBeside(Path("."), 1 << 20, threads=2)
    beside.rounds = [BurstResult("x", 1 << 20, 4, 0.0, 2, Rate(2.0, 2.0, 2.0), Rate(2.0, 2.0, 2.0), 4,
                                 Rate(1.6216, 1.6216, 1.6216))]
    figures: dict = {}
    # make bench b75's figures: 1,456 MB/s delivered against 1,622 is 0.898, which two places print as 0.90.
    text = pattern_lines(figures, beside, {}, None, None, 0.0, {}, {"read": 1.4556, "write": 1.8}, None)
    assert "READ 0.898 (1,456 against 1,622 MB/s)" in text and "WRITE 0.900" in text
    assert figures["read_vs_drive_in_pattern"] == pytest.approx(1.4556 / 1.6216)

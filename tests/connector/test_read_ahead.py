"""Reads ahead for queued requests (read_ahead_mb: scheduler.on_new_request, read_ahead.py): decided once on
arrival, read into staging before the request has cache blocks, taken by its load (which then needs no drive),
freed when no load will take it, bounded in memory; off by default."""

import time
from concurrent.futures import wait
from types import SimpleNamespace

import pytest
import torch

from test_index import finish, worker
from test_scheduler_side import Recorder, StoresEverything, request, step

from pytest_kvoffload.connector.config import ConnectorConfig, ConnectorConfigError
from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob, ReadAheadJob, SaveJob
from pytest_kvoffload.connector.scheduler import SchedulerSide
from pytest_kvoffload.drive.worker_probe import wait_done


def scheduler(tmp_path, admit=None, **extra):
    config = ConnectorConfig.from_extra({"store_dir": str(tmp_path), "chunk_tokens": 256, **extra}, 128)
    return SchedulerSide(config, 128, b"root", StoresEverything(tmp_path, 1 << 30, 4096), admit=admit)


def test_off_by_default_and_a_bad_size_is_one_line(tmp_path):
    s = scheduler(tmp_path)
    s.on_new_request(request("p", 1100))
    assert s.build_connector_meta(step()).read_aheads == []
    with pytest.raises(ConnectorConfigError, match=r"^kvoffload connector: read_ahead_mb -1.0 must be 0 \(off\)"):
        ConnectorConfig.from_extra({"store_dir": str(tmp_path), "read_ahead_mb": -1}, 128)


def test_decided_once_on_arrival_and_sent_with_the_next_step(tmp_path):
    admit = Recorder()
    s = scheduler(tmp_path, admit, read_ahead_mb=64)
    s.on_new_request(request("p", 1100))
    meta = s.build_connector_meta(step())
    [job] = meta.read_aheads
    assert job.req_id == "p" and len(job.chunks) == 8 and job.arrived <= time.time()  # 1,024 tokens in 128-token files
    assert s.build_connector_meta(step()).read_aheads == []  # sent once
    # At the head of the queue the rule is not asked again: one decision a request.
    assert s.get_num_new_matched_tokens(request("p", 1100), 0) == (1024, True)
    assert len(admit.calls) == 1


def test_a_declined_load_is_not_read_ahead(tmp_path):
    s = scheduler(tmp_path, lambda *a, **k: False, read_ahead_mb=64)
    s.on_new_request(request("p", 1100))
    assert s.build_connector_meta(step()).read_aheads == []
    assert s.get_num_new_matched_tokens(request("p", 1100), 0) == (0, False)


def test_staging_no_load_takes_is_dropped(tmp_path):
    s = scheduler(tmp_path, read_ahead_mb=64)
    for req_id in ("gone", "computed", "loaded"):
        s.on_new_request(request(req_id, 1100))
    s.build_connector_meta(step())
    s.request_finished(request("gone", 1100), [])  # aborted while queued
    # "loaded" gets its blocks; "computed" is scheduled without a load (the engine had its prefix).
    s.get_num_new_matched_tokens(request("loaded", 1100), 0)
    s.update_state_after_alloc(request("loaded", 1100), SimpleNamespace(get_block_ids=lambda: (list(range(9)),)), 1100)
    meta = s.build_connector_meta(step(new=[("computed", 1100, 1024, list(range(9)))]))
    assert sorted(meta.drops) == ["computed", "gone"] and [j.req_id for j in meta.loads] == ["loaded"]
    s.request_finished(request("loaded", 1100), [])
    assert s.build_connector_meta(step()).drops == []  # its load took (and freed) its staging


def saved(tmp_path, n=4, **extra):
    """A worker with `n` two-block chunks saved (CHUNK tokens a file), the cache then zeroed: (worker, chunks,
    the cache's expected contents)."""
    side = worker(tmp_path, 2 * n + 2, read_ahead_mb=64, **extra)
    keys = [f"{i + 1:032x}" for i in range(n)]
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", k, [2 * i, 2 * i + 1], i) for i, k in enumerate(keys)]))
    finish(side, "p")
    expected = [layer.clone() for layer in side.layers]
    for layer in side.layers:
        layer.zero_()
    return side, [ChunkBlocks(k, [(0, 2 * i), (1, 2 * i + 1)]) for i, k in enumerate(keys)], expected


def read_ahead(side, chunks, arrived=None):
    side.start_load_kv(KVOffloadMetadata(read_aheads=[ReadAheadJob("r", [(c.key, 2) for c in chunks],
                                                                   arrived or time.time())]))
    done, pending = wait(side.read_ahead.staged("r"), timeout=30)
    assert not pending


def load(side, chunks):
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("r", chunks)]))
    wait_done(side, "r", loading=True)


@pytest.mark.parametrize("load_io", ["aio", "threads"])
def test_a_load_takes_its_chunks_from_staging_and_needs_no_drive(tmp_path, load_io):
    side, chunks, expected = saved(tmp_path, load_io=load_io)
    read_ahead(side, chunks)
    for path in (tmp_path / "rank0").glob("*.kv"):
        path.unlink()  # only staging can serve the load now
    load(side, chunks)
    assert all(torch.equal(a[:8], b[:8]) for a, b in zip(side.layers, expected))
    counts = side.counters.drain()
    assert counts["read_ahead_chunks_read"] == 4 and counts["read_ahead_chunks_used"] == 4
    assert "blocks_load_failed" not in counts and side.read_ahead.held_bytes == 0
    side.shutdown()


def test_the_control_without_staging_fails_those_blocks(tmp_path):
    side, chunks, _ = saved(tmp_path)
    for path in (tmp_path / "rank0").glob("*.kv"):
        path.unlink()
    load(side, chunks)  # no read ahead: the files are gone, and so are the blocks
    assert len(side.block_ids_with_load_errors()) == 8
    side.shutdown()


def test_a_failed_read_ahead_is_read_again_by_the_load(tmp_path, monkeypatch):
    side, chunks, expected = saved(tmp_path)
    read = side.store.read
    monkeypatch.setattr(side.store, "read", lambda key, *a, **k: False if key == chunks[1].key else read(key, *a, **k))
    read_ahead(side, chunks)
    monkeypatch.setattr(side.store, "read", read)
    load(side, chunks)
    assert all(torch.equal(a[:8], b[:8]) for a, b in zip(side.layers, expected))
    assert side.counters.drain()["read_ahead_chunks_used"] == 3 and not side.block_ids_with_load_errors()
    side.shutdown()


def test_staging_is_bounded_and_what_does_not_fit_is_read_by_the_load(tmp_path):
    side, chunks, expected = saved(tmp_path)
    side.read_ahead.limit = 2 * side.layout.file_bytes
    read_ahead(side, chunks)
    assert side.read_ahead.held_bytes == 2 * side.layout.file_bytes
    load(side, chunks)
    assert all(torch.equal(a[:8], b[:8]) for a, b in zip(side.layers, expected))
    counts = side.counters.drain()
    assert counts["read_ahead_chunks_skipped"] == 2 and counts["read_ahead_chunks_used"] == 2
    side.shutdown()


def test_a_drop_frees_the_staging(tmp_path):
    side, chunks, _ = saved(tmp_path)
    read_ahead(side, chunks)
    assert side.read_ahead.held_bytes == 4 * side.layout.file_bytes
    side.start_load_kv(KVOffloadMetadata(drops=["r"]))
    assert side.read_ahead.held_bytes == 0
    side.shutdown()


def test_the_first_read_is_issued_before_the_request_is_scheduled_and_timed_from_arrival(tmp_path, monkeypatch):
    """Arrival (on_new_request) to the first read ahead: the metadata's next step, then the read-ahead thread.
    The bound stated in docs/connector.md: within the engine step in progress when the request arrived, plus
    that thread's wait; here no step runs, so the delay is what the hand-over and the thread cost."""
    side, chunks, _ = saved(tmp_path)
    issued = []
    read = side.store.read
    monkeypatch.setattr(side.store, "read", lambda *a, **k: (issued.append(time.time()), read(*a, **k))[1])
    arrived = time.time()
    read_ahead(side, chunks, arrived)
    handed_over = time.time()  # the earliest a load could start: the request has no blocks yet
    [delay] = side.counters.drain()["read_ahead_issue_seconds"]
    assert arrived <= min(issued) <= handed_over and 0 <= delay <= handed_over - arrived
    side.shutdown()

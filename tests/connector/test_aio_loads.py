"""Loads on native AIO (aio_loads.py, load_io=aio): at most io_threads reads queued, the next queued before a
completed chunk is scattered, a load's last read queued alone once the reads before it are reported, and a
missing, damaged or unreadable chunk a counted miss whose blocks are recomputed, as with threads."""

import os
import time

import pytest

from test_index import finish, worker

from pytest_kvoffload.connector import aio_loads
from pytest_kvoffload.connector.io_memory import aligned_buffer
from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob, SaveJob
from pytest_kvoffload.drive.worker_probe import wait_done

pytestmark = pytest.mark.skipif(not aio_loads.available(), reason="no native AIO on this kernel")


def saved(tmp_path, n=8, **extra):
    """A worker (load_io=aio by default) with `n` two-block chunks saved, and a load of them all."""
    side = worker(tmp_path, 2 * n + 2, **extra)
    keys = [f"{i + 1:032x}" for i in range(n)]
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", k, [2 * i, 2 * i + 1], i) for i, k in enumerate(keys)]))
    finish(side, "p")
    load = KVOffloadMetadata(loads=[LoadJob("r", [ChunkBlocks(k, [(0, 2 * i), (1, 2 * i + 1)])
                                                  for i, k in enumerate(keys)], sync=True)])
    return side, keys, load


def slow_drive(side, monkeypatch, latency_s=0.005):
    """The ring's reads are reported `latency_s` after their submission (a drive far slower than the scatter of
    the test's small chunks, as a real drive is against a real model's), all at the drive together once the
    last of them is due, as the 2-core VM's drive reports reads when its queue empties (aio_loads.py)."""
    ring, state = side._aio.ring, {"now": 0, "most": 0, "at_scatter": [], "at_submit": [], "batches": [],
                                  "at_open": []}
    submit, wait, held, due, open_chunk = ring.submit, ring.wait, [], {}, side.store.open_chunk

    def slow_submit(reads):
        queued = submit(reads)
        for tag, *_ in reads[:queued]:
            due[tag] = time.monotonic() + latency_s
            state["at_submit"].append(state["now"])  # reads at the drive, not yet reported, as this one was queued
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        state["batches"].append(queued)
        return queued

    def slow_wait(least):
        while len(held) < state["now"]:
            got = wait(1 if least else 0)
            held.extend(got)
            if not got:
                return []
        last = max((due[tag] for tag, _ in held), default=0.0)
        if time.monotonic() < last:
            if not least:
                return []
            time.sleep(last - time.monotonic())
        ready = list(held)
        held.clear()
        state["now"] -= len(ready)
        return ready

    monkeypatch.setattr(side.store, "open_chunk",
                        lambda *a: (state["at_open"].append(state["now"]), open_chunk(*a))[1])
    monkeypatch.setattr(ring, "submit", slow_submit)
    monkeypatch.setattr(ring, "wait", slow_wait)
    scatter = side._scatter
    monkeypatch.setattr(side, "_scatter", lambda *a: (state["at_scatter"].append(state["now"]), scatter(*a)))
    return state


def test_reads_stay_at_io_threads_and_the_next_is_queued_before_a_chunk_is_scattered(tmp_path, monkeypatch):
    side, keys, load = saved(tmp_path)
    assert side.counters.drain()["loads_on_aio"] == 1.0
    expected = [layer.clone() for layer in side.layers]
    for layer in side.layers:
        layer.zero_()
    state = slow_drive(side, monkeypatch)
    side.start_load_kv(load)
    assert side.counters.drain()["chunks_read"] == 8
    assert all(torch_equal(a, b) for a, b in zip(side.layers, expected))
    # io_threads (2) queued at most, two at a time in one call; while each of the first four chunks was
    # scattered the next two reads were queued (the control: the next reads queued only after the completed
    # chunks were handled, fewer were).
    assert state["most"] == 2
    assert state["at_scatter"][:4] == [2] * 4, state["at_scatter"]
    # The last read was queued alone, once every read before it was reported (0 at the drive), and was in
    # flight while the seventh chunk was scattered; the seventh too was queued alone (the eighth held back).
    assert state["at_submit"] == [0, 1, 0, 1, 0, 1, 0, 0], state["at_submit"]
    assert state["batches"] == [2, 2, 2, 1, 1], state["batches"]
    assert state["at_scatter"][4:] == [1, 1, 1, 0], state["at_scatter"]
    # Every file after the first two was opened while two reads were at the drive: ready when they are reported.
    assert state["at_open"] == [0, 0, 2, 2, 2, 2, 2, 2], state["at_open"]
    side.shutdown()


def torch_equal(a, b):
    return bool((a[:16] == b[:16]).all())


def test_a_missing_a_damaged_and_an_unreadable_chunk_are_counted_misses_recomputed(tmp_path, monkeypatch):
    side, keys, load = saved(tmp_path)
    os.unlink(side.store.path(keys[1]))
    with open(side.store.path(keys[2]), "r+b") as fh:  # a payload byte flipped
        fh.seek(side.store.layout.file_bytes // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    ring, wait, seen = side._aio.ring, side._aio.ring.wait, {"n": 0}

    def one_error(least):
        done = wait(least)
        for i, (tag, result) in enumerate(done):
            seen["n"] += 1
            if seen["n"] == 4:
                done[i] = (tag, -5)  # EIO
        return done

    monkeypatch.setattr(ring, "wait", one_error)
    side.start_load_kv(load)
    counters = side.counters.drain()
    assert (counters["chunks_missing"], counters["chunks_corrupt"], counters["read_errors"]) == (1, 1, 1), counters
    assert counters["chunks_read"] == 5
    failed = side.block_ids_with_load_errors()
    assert len(failed) == 6 and {2, 3, 4, 5} <= failed
    assert set(side.worker_meta().dropped) >= {keys[1], keys[2]}
    side.shutdown()


def test_a_read_the_kernel_did_not_queue_is_a_counted_failure_recomputed(tmp_path, monkeypatch):
    side, keys, load = saved(tmp_path, 4)
    ring = side._aio.ring
    submit = ring.submit
    monkeypatch.setattr(ring, "submit", lambda reads: submit(reads[:1]))  # the kernel queues one read a call
    load.loads[0].sync = False  # waited for below with a deadline: a read wrongly taken as queued never ends
    side.start_load_kv(load)
    wait_done(side, "r", loading=True, deadline_s=10)
    counters = side.counters.drain()
    # The first call queued chunk 1 of 1 and 2; 3 went on its own beside 1; 4, the last, alone.
    assert (counters["read_errors"], counters["chunks_read"]) == (1, 3), counters
    assert side.block_ids_with_load_errors() == {2, 3}
    side.shutdown()


def test_without_native_aio_loads_run_on_threads(tmp_path, monkeypatch):
    from pytest_kvoffload.connector import worker as worker_module

    monkeypatch.setattr(worker_module, "aio_available", lambda: False)
    side, keys, load = saved(tmp_path, 4)
    assert side.counters.drain()["loads_on_aio"] == 0.0
    side.start_load_kv(load)
    assert side.counters.drain()["chunks_read"] == 4
    side.shutdown()


def test_the_ring_reads_a_files_bytes_with_o_direct(tmp_path):
    data = os.urandom(3 << 20)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    ring, buffer = aio_loads.ReadRing(2), aligned_buffer(2 << 20)
    try:
        assert ring.wait(0) == []  # nothing queued: at once
        assert ring.submit([(1, fd, buffer.ctypes.data, 2 << 20)]) == 1
        assert ring.wait(1) == [(1, 2 << 20)]
        assert buffer.tobytes() == data[:2 << 20]
    finally:
        os.close(fd)
        ring.close()

"""Loads by load_threads threads (load_io=threads) with io_threads reads in flight (worker.py): the drive never
gets more reads at once than the reference it is held to, and a chunk's check and scatter run beside the next
read."""

import os
import threading
import time

import pytest

from test_index import finish, worker

from pytest_kvoffload.connector.config import ConnectorConfig, ConnectorConfigError
from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob, SaveJob
from pytest_kvoffload.connector.store import ChunkStore


def test_reads_in_flight_stay_at_io_threads_while_more_threads_load(tmp_path, monkeypatch):
    side = worker(tmp_path, 16, load_io="threads")
    assert side.load_pool._max_workers == 4  # twice io_threads by default
    keys = [f"{i:032x}" for i in range(8)]
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", k, [2 * i, 2 * i + 1], i) for i, k in enumerate(keys)]))
    finish(side, "p")

    real, lock, state = os.preadv, threading.Lock(), {"now": 0, "most": 0, "threads": set()}

    def slow_preadv(fd, buffers, offset):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["threads"].add(threading.get_ident())
        time.sleep(0.02)
        try:
            return real(fd, buffers, offset)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(os, "preadv", slow_preadv)
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("r", [
        ChunkBlocks(k, [(0, 2 * i), (1, 2 * i + 1)]) for i, k in enumerate(keys)], sync=True)]))
    # The bound holds (the control: without the semaphore four threads read at once), and more threads than
    # that took part.
    assert state["most"] == 2
    assert len(state["threads"]) > 2
    assert side.counters.drain()["chunks_read"] == 8
    side.shutdown()


def test_load_threads_below_io_threads_is_one_line(tmp_path):
    with pytest.raises(ConnectorConfigError, match="load_threads 1 must be at least io_threads"):
        ConnectorConfig.from_extra({"store_dir": str(tmp_path), "io_threads": 2, "load_threads": 1}, 16)
    assert ConnectorConfig.from_extra({"store_dir": str(tmp_path), "io_threads": 3}, 16).load_threads == 6


def test_a_short_read_inside_the_slot_is_a_damaged_chunk(tmp_path, monkeypatch):
    from pytest_kvoffload.connector.chunk_format import Layout

    store = ChunkStore(tmp_path, "probe", Layout(1, 1, 4096))
    buffer = store.new_buffer()
    assert store.write("ab" * 16, buffer)
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)
    slot = threading.Semaphore(1)
    assert store.read("ab" * 16, buffer, io_slot=slot) is False
    assert store.counters.drain()["chunks_corrupt"] == 1
    assert slot.acquire(blocking=False)  # given back


def test_a_load_thread_leaving_its_read_slot_yields_the_core_to_a_waiting_reader(tmp_path, monkeypatch):
    """ReadSlots (io_threads.py): the slot is free before the yield, so a waiter can issue its read at once."""
    from pytest_kvoffload.connector import io_threads

    side = worker(tmp_path, 16, load_io="threads")
    keys = [f"{i:032x}" for i in range(4)]
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", k, [2 * i, 2 * i + 1], i) for i, k in enumerate(keys)]))
    finish(side, "p")
    slots_free_at_yield = []
    real_yield = os.sched_yield

    def counted_yield():
        slots_free_at_yield.append(side._read_slots._value)
        real_yield()

    monkeypatch.setattr(io_threads.os, "sched_yield", counted_yield)
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("r", [
        ChunkBlocks(k, [(0, 2 * i), (1, 2 * i + 1)]) for i, k in enumerate(keys)], sync=True)]))
    assert side.counters.drain()["chunks_read"] == 4
    # One yield per read, each with a slot free (the control: a plain semaphore yields never).
    assert len(slots_free_at_yield) >= 4 and all(v >= 1 for v in slots_free_at_yield)
    side.shutdown()

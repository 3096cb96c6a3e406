"""A load's first reads on AIO (aio_loads.AioLoads.start): where the loader has no load in hand, the thread that
hands the load over (the step's, in start_load_kv) opens and queues its first io_threads reads itself, and the
loader's thread queues the rest; where the loader is busy, or the reads must wait out an emulated access
latency, the loader queues them all. On the 2-core VM the step's thread is warm where the loader wakes cold:
READ 1.09, 1.16 and 0.97 of the drive against 0.86, 0.97 and 0.94, paired (notes/2026-12-04-first-reads.md)."""

import threading
import time

import pytest

from test_aio_loads import saved

from pytest_kvoffload.connector import aio_loads
from pytest_kvoffload.connector.metadata import KVOffloadMetadata, LoadJob

pytestmark = pytest.mark.skipif(not aio_loads.available(), reason="no native AIO on this kernel")


def submitters(side, monkeypatch):
    """The names of the threads that queued each read, in order."""
    ring, names = side._aio.ring, []
    submit = ring.submit
    monkeypatch.setattr(ring, "submit", lambda *a: (names.append(threading.current_thread().name), submit(*a))[1])
    return names


def wait_loaded(side, *req_ids, deadline_s=30.0):
    """Until the worker has reported every one of `req_ids` loaded (get_finished, as vLLM learns it)."""
    end, seen = time.monotonic() + deadline_s, set()
    while time.monotonic() < end:
        _, received = side.get_finished(set())
        seen |= received or set()
        if seen >= set(req_ids):
            return
        time.sleep(0.002)
    raise AssertionError(f"loads {set(req_ids) - seen} never finished")


def later(load, req_id):
    """`load` (saved's) again, as a load the step does not wait for."""
    return KVOffloadMetadata(loads=[LoadJob(req_id, load.loads[0].chunks, sync=False)])


def test_the_caller_queues_the_first_io_threads_reads_where_the_loader_is_idle_every_load(tmp_path, monkeypatch):
    side, keys, load = saved(tmp_path, 4)
    names = submitters(side, monkeypatch)
    caller = threading.current_thread().name
    for req_id in ("a", "b"):  # the second too: the first load, finished, left the loader idle
        names.clear()
        side.start_load_kv(later(load, req_id))
        wait_loaded(side, req_id)
        assert names[:2] == [caller] * 2 and len(names) == 4, names
        assert all(name.startswith("kvoffload-load") for name in names[2:]), names
    assert side.counters.drain()["chunks_read"] == 8
    side.shutdown()


def test_a_busy_loader_queues_all_of_the_next_loads_reads(tmp_path, monkeypatch):
    side, keys, load = saved(tmp_path, 4)
    names = submitters(side, monkeypatch)
    ring, held, release = side._aio.ring, threading.Event(), threading.Event()
    wait = ring.wait

    def held_wait(least):  # the loader is held in the first load's first wait
        held.set()
        release.wait(10)
        return wait(least)

    monkeypatch.setattr(ring, "wait", held_wait)
    side.start_load_kv(later(load, "first"))
    assert held.wait(10)
    names.clear()
    side.start_load_kv(later(load, "second"))  # handed over while the loader holds "first"
    assert names == []  # the caller queued nothing: the ring is the loader's
    release.set()
    wait_loaded(side, "first", "second")
    # the first load's last two reads and the second's four, all queued by the loader
    assert len(names) == 6 and all(name.startswith("kvoffload-load") for name in names), names
    side.shutdown()


def test_reads_held_for_an_emulated_access_latency_are_all_the_loaders(tmp_path, monkeypatch):
    side, keys, load = saved(tmp_path, 4, read_latency_ms=20)
    names = submitters(side, monkeypatch)
    started = time.perf_counter()
    side.start_load_kv(later(load, "r"))
    assert names == []
    wait_loaded(side, "r")
    assert time.perf_counter() - started >= 0.02
    assert len(names) == 4 and all(name.startswith("kvoffload-load") for name in names), names
    side.shutdown()

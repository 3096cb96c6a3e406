"""The CPU build's hand-overs (worker.py): once a step's saves (wait_for_save) or its loads not waited for in
the step (start_load_kv) are submitted, the step's thread yields its core, so the I/O threads that share
it, and the GIL, take their chunks and start their I/O before the step's thread runs on into vLLM's Python
(a step's first write waited 0.10 to 0.25 ms for its thread instead of 0.44 to 1.24:
docs/notes/2026-12-04-save-handover.md)."""

import os

from test_index import finish, worker

from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob, SaveJob


def saves(n, first=1, req="p"):
    return KVOffloadMetadata(saves=[SaveJob(req, f"{first + i:032x}", [2 * i, 2 * i + 1], i) for i in range(n)])


def test_the_step_yields_once_after_submitting_its_saves_and_not_without_saves(tmp_path, monkeypatch):
    side = worker(tmp_path, 16)
    events = []
    submit = side.save_pool.submit
    monkeypatch.setattr(side.save_pool, "submit", lambda *a, **k: (events.append("submit"), submit(*a, **k))[1])
    monkeypatch.setattr(os, "sched_yield", lambda: events.append("yield"))
    side.wait_for_save(saves(3))
    assert events == ["submit"] * 3 + ["yield"]
    side.wait_for_save(KVOffloadMetadata())  # the control: a step with nothing to save keeps its core
    assert events == ["submit"] * 3 + ["yield"]
    finish(side, "p")
    side.shutdown()


def test_the_step_yields_once_after_submitting_loads_it_does_not_wait_for(tmp_path, monkeypatch):
    side = worker(tmp_path, 16)
    side.wait_for_save(saves(2))
    finish(side, "p")
    events = []
    pool = side._aio_pool or side.load_pool  # load_io=aio where the kernel has it
    submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda *a, **k: (events.append("submit"), submit(*a, **k))[1])
    monkeypatch.setattr(os, "sched_yield", lambda: events.append("yield"))
    load = [ChunkBlocks(f"{i + 1:032x}", [(0, 8 + 2 * i), (1, 9 + 2 * i)]) for i in range(2)]
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("r", load, sync=False)]))
    assert events[-1] == "yield" and events.count("yield") == 1 and "submit" in events
    events.clear()
    # The controls: a load the step waits for releases the core as it waits, and a step without loads keeps it.
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("s", load, sync=True)]))
    side.start_load_kv(KVOffloadMetadata())
    assert "yield" not in events and "submit" in events
    side.shutdown()

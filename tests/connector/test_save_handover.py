"""The CPU build's save hand-over (worker.py, wait_for_save): once a step's saves are submitted, the step's
thread yields its core, so the save threads that share it, and the GIL, take their chunks and start their
writes before the step's thread runs on into vLLM's Python (a step's first write waited 0.10 to 0.25 ms
for its thread instead of 0.44 to 1.24: docs/notes/2026-12-04-save-handover.md)."""

import os

from test_index import finish, worker

from pytest_kvoffload.connector.metadata import KVOffloadMetadata, SaveJob


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

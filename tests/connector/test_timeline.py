"""The connector's step timeline (option `timeline`: timeline.py): off by default, whole lines from both halves
and the I/O threads, a mark at every hook with the step's number, each load's reads timed by the worker."""

import json
import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest

from test_read_ahead import saved
from test_scheduler_side import step

from pytest_kvoffload.analysis.request_phases import request_phases
from pytest_kvoffload.connector.config import ConnectorConfig, ConnectorConfigError
from pytest_kvoffload.connector.connector import KVOffloadDiskConnector
from pytest_kvoffload.connector.metadata import KVOffloadMetadata, LoadJob, SaveJob
from pytest_kvoffload.connector.timeline import NoTimeline, Timeline, timeline_for


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_by_default_and_a_missing_folder_is_one_line(tmp_path):
    config = ConnectorConfig.from_extra({"store_dir": str(tmp_path)}, 128)
    assert config.timeline is None and isinstance(timeline_for(config.timeline, "worker"), NoTimeline)
    with pytest.raises(ConnectorConfigError, match=r"^kvoffload connector: timeline '/no/such/t.jsonl' must be a file "
                                                   r"in a folder that exists"):
        ConnectorConfig.from_extra({"store_dir": str(tmp_path), "timeline": "/no/such/t.jsonl"}, 128)


def test_both_halves_and_their_threads_append_whole_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    scheduler, worker = Timeline(path, "scheduler"), Timeline(path, "worker")

    def mark(timeline, n):
        for i in range(n):
            timeline.mark("load_read", f"r{i}", bytes=i, chunks=[1] * 50)
            if i % 7 == 0:
                timeline.flush()
    threads = [threading.Thread(target=mark, args=(t, 200)) for t in (scheduler, worker, worker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    scheduler.close()
    worker.close()
    found = events(path)  # every line whole JSON
    assert len(found) == 600 and {e["side"] for e in found} == {"scheduler", "worker"}
    assert all(found[i]["t"] > 0 for i in range(600))


def test_a_failed_write_stops_the_timeline_not_the_server(tmp_path, caplog):
    timeline = Timeline(tmp_path / "t.jsonl", "worker")
    os.close(timeline._fd)  # the file's descriptor gone under it (EBADF), as a vanished drive would
    timeline.mark("bind", step=1)
    with caplog.at_level(logging.WARNING, logger="pytest_kvoffload.connector"):
        timeline.flush()
    assert "no more events written" in caplog.text
    timeline.mark("bind", step=2)
    timeline.flush()  # a no-op now, no second warning
    assert caplog.text.count("no more events written") == 1


def test_the_worker_times_each_load_with_the_bytes_it_moved(tmp_path):
    side, chunks, _ = saved(tmp_path / "store")
    path = tmp_path / "t.jsonl"
    side.timeline = Timeline(path, "worker")
    before = time.perf_counter()
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("r", chunks)]))
    deadline = time.time() + 30
    while time.time() < deadline and not (side.get_finished(set())[1] or set()):
        time.sleep(0.005)
    side.timeline.close()
    [read] = [e for e in events(path) if e["event"] == "load_read"]
    assert read["req"] == "r" and read["chunks"] == 4 and read["bytes"] == 4 * side.layout.file_bytes_for(2)
    assert before <= read["started"] <= read["t"] <= time.perf_counter()


class FakeWorker:
    """Hands each load back at the step after it started, as the asynchronous loads do."""

    def __init__(self):
        # step_buffers as the CPU build's: a step's saves are gathered at the next step's bind
        self.step_buffers, self.loading, self.timeline = object(), set(), NoTimeline()

    def start_load_kv(self, meta):
        for job in meta.loads:
            self.timeline.mark("load_read", job.req_id, started=time.perf_counter(), bytes=1000, chunks=1)
        self.loading |= {job.req_id for job in meta.loads}

    def wait_for_save(self, meta):
        return

    def get_finished(self, finished, idle=False):
        received, self.loading = self.loading, set()
        return None, received or None


def connector(tmp_path, role_scheduler: bool, scheduler=None):
    """A connector half without vLLM: the hooks' wiring under test, its halves stand-ins."""
    c = KVOffloadDiskConnector.__new__(KVOffloadDiskConnector)
    c.config = ConnectorConfig.from_extra({"store_dir": str(tmp_path), "timeline": str(tmp_path / "t.jsonl")}, 128)
    c.timeline = timeline_for(c.config.timeline, "scheduler" if role_scheduler else "worker", str(tmp_path))
    c._steps, c._zeroes_blocks, c._deferred_saves = 0, False, []
    c._scheduler, c._worker = (scheduler, None) if role_scheduler else (None, FakeWorker())
    if c._worker is not None:
        c._worker.timeline = c.timeline
    return c


def test_every_hook_marks_its_step_and_the_phases_add_up(tmp_path):
    prompt = list(range(1024))
    loads = []
    scheduler_half = SimpleNamespace(
        on_new_request=lambda r: None, get_num_new_matched_tokens=lambda r, n: (768, True),
        update_state_after_alloc=lambda r, b, n: loads.append(LoadJob(r.request_id, [])),
        build_connector_meta=lambda out: KVOffloadMetadata(
            loads=[loads.pop()] if loads else [], saves=[SaveJob("r", "k", [0])] if out.num_scheduled_tokens else []),
        request_finished=lambda r, b: (False, None))
    s, w = connector(tmp_path, True, scheduler_half), connector(tmp_path, False)
    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt)

    def run(output):
        meta = s.build_connector_meta(output)
        w.bind_connector_metadata(meta)
        time.sleep(0.002)  # the forward
        w.wait_for_save()
        w.get_finished(set())
        w.clear_connector_metadata()
        return meta

    s.on_new_request(request)
    assert s.get_num_new_matched_tokens(request, 0) == (768, True)
    s.update_state_after_alloc(request, None, 768)
    first = run(step())  # the load starts
    second = run(step())  # nothing to compute: the load reported at its end
    third = run(step(cached=[("r", 768)], scheduled={"r": 256}))
    run(step())  # its saves gathered at this step's start
    s.request_finished(request, [])
    s.timeline.close()
    w.timeline.close()
    assert (first.step, second.step, third.step) == (0, 1, 2)
    found = events(tmp_path / "t.jsonl")
    kinds = [e["event"] for e in found]
    for kind in ("arrived", "lookup", "load_planned", "step", "bind", "load_read", "forward_end", "step_end", "finished",
                 "saves_gathered"):
        assert kind in kinds, kind
    assert [e["step"] for e in found if e["event"] == "bind"] == [0, 1, 2, 3]
    assert [(e["step"], e["chunks"]) for e in found if e["event"] == "saves_gathered"] == [(3, 1)]
    assert {e["server"] for e in found} == {str(tmp_path)}  # the store folder tells servers apart
    assert [e["loaded"] for e in found if e["event"] == "step_end"] == [["r"], [], [], []]
    [phases] = request_phases(found)
    assert phases.req == "r" and phases.prompt == 1024 and phases.loaded_tokens == 768 and phases.steps == 1
    assert phases.phases["computing"] >= 0.002 and phases.load_bytes == 1000
    ends = {e["step"]: e["t"] for e in found if e["event"] == "forward_end"}
    arrived = next(e["t"] for e in found if e["event"] == "arrived")
    assert phases.total == pytest.approx(ends[2] - arrived, abs=1e-6)  # the phases tile its time, no gap, no overlap

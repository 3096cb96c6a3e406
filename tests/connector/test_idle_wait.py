"""An idle step's wait (worker.WorkerSide.get_finished, idle_wait_ms): a step with nothing to compute waits
for a load in flight instead of returning at once, and a step with work never waits. How long it waits once
loads have been timed: test_idle_wait_bound.py."""

import time

import pytest
import torch

from test_index import BLOCK, CHUNK, compute, new_step, prompt, scheduler

from pytest_kvoffload.rigged.knobs import split
from pytest_kvoffload.rigged.rigged_connector import RiggedWorkerSide
from pytest_kvoffload.connector.metadata import ChunkBlocks, KVOffloadMetadata, LoadJob, SaveJob

# An emulated access latency: a load of one small chunk takes about this long.
LATENCY_MS = 300.0


def side_with_a_chunk(tmp_path, **extra):
    # The latency is the test-only connector's knob (rigged/): its worker is the product's with a read delay.
    config, rig = split({"store_dir": str(tmp_path), "chunk_tokens": CHUNK, "io_threads": 2,
                         "read_latency_ms": LATENCY_MS, **extra}, BLOCK)
    side = RiggedWorkerSide(config, rig, "model=test", tmp_path / "rank0", BLOCK)
    side.register_kv_caches({f"layer{i}": torch.randn(8, 2, BLOCK, 2, 8) for i in range(2)})
    side.wait_for_save(KVOffloadMetadata(saves=[SaveJob("p", f"{1:032x}", [0, 1], 0)]))
    deadline = time.time() + 30
    while not (side.get_finished({"p"})[0] or time.time() > deadline):
        time.sleep(0.01)
    return side


def start_load(side):
    side.start_load_kv(KVOffloadMetadata(loads=[LoadJob("r", [ChunkBlocks(f"{1:032x}", [(0, 4), (1, 5)])])]))


def test_an_idle_step_waits_for_the_load_and_a_busy_one_returns_at_once(tmp_path):
    side = side_with_a_chunk(tmp_path, idle_wait_ms=1000)
    began = time.perf_counter()
    start_load(side)
    busy = time.perf_counter()
    assert side.get_finished(set())[1] is None  # a step with work: no wait, nothing finished yet
    assert time.perf_counter() - busy < 0.05
    _, received = side.get_finished(set(), idle=True)
    # Seen as soon as it finished: after the drive's latency, long before the option's full second.
    assert received == {"r"} and LATENCY_MS / 1e3 <= time.perf_counter() - began < 0.8
    assert side.counters.drain()["idle_wait_seconds"] > 0
    side.shutdown()


@pytest.mark.parametrize("wait_ms", [0, 20])
def test_before_any_load_has_finished_the_wait_is_the_options_and_off_at_zero(tmp_path, wait_ms):
    side = side_with_a_chunk(tmp_path, idle_wait_ms=wait_ms)
    start_load(side)
    began = time.perf_counter()
    assert side.get_finished(set(), idle=True)[1] is None  # the load takes 300 ms: not done after the wait
    waited = time.perf_counter() - began
    # The control: a wait that ignored the option (or one that never waited) fails one of the two cases.
    assert (waited < 0.01) if wait_ms == 0 else (wait_ms / 1e3 * 0.8 < waited < 0.2)
    side.shutdown()


def test_the_scheduler_marks_a_step_idle_only_when_it_computes_nothing(tmp_path):
    side, _, _ = scheduler(tmp_path, 16)
    assert compute(side, "a", prompt(1), list(range(20))).idle is False
    idle = new_step("b", prompt(2), list(range(20, 40)))
    idle.num_scheduled_tokens = {"b": 0}
    assert side.build_connector_meta(idle).idle is True


def test_a_load_expected_to_outlast_the_option_is_seen_in_the_step_it_ends(tmp_path):
    # The worker's first load timed the drive (300 ms of latency, then the read); the second is waited for
    # until it ends, in one idle step, where the option alone (20 ms) would have left it to later steps.
    side = side_with_a_chunk(tmp_path, idle_wait_ms=20)
    start_load(side)
    deadline = time.time() + 30
    while not (side.get_finished(set(), idle=True)[1] or time.time() > deadline):
        pass
    start_load(side)
    began = time.perf_counter()
    assert side.get_finished(set(), idle=True)[1] == {"r"}
    assert time.perf_counter() - began < 2.0
    side.shutdown()

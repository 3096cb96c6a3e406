"""How long an idle step waits for a load (connector/idle_wait.py): until the load nearest its end is
expected to be done, at the slowest rate of this worker's recent loads after the drive's access latency,
and idle_wait_ms beyond; a load running late is left to the next step, not waited for without end."""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from pytest_kvoffload.connector.idle_wait import RECENT_LOADS, IdleWait

MB = 1e6


def test_the_wait_runs_to_the_loads_expected_end_at_the_slowest_recent_rate():
    wait = IdleWait(0.005, latency_s=0.010)
    wait.observe(2 * MB, 0.010 + 0.002)  # 1 GB/s once the latency has passed
    wait.observe(2 * MB, 0.010 + 0.004)  # 0.5 GB/s: the slowest
    # 16 MB at 0.5 GB/s after 10 ms of latency: 42 ms from its start, 30 of them still ahead at 12 ms; and
    # the option's 5 ms beyond.
    assert wait.timeout(16 * MB, elapsed=0.012) == pytest.approx(0.035)
    assert wait.timeout(16 * MB, elapsed=0.050) == pytest.approx(0.005)  # past its expected end: the option


def test_the_option_alone_before_any_load_is_timed_and_zero_never_waits():
    wait = IdleWait(0.005)
    assert wait.timeout(16 * MB, elapsed=0.0) == 0.005  # nothing measured yet: the option
    wait.observe(16 * MB, 0.001)
    assert wait.timeout(2 * MB, elapsed=0.0) == pytest.approx(0.005 + 0.000125)
    assert IdleWait(0.0).timeout(16 * MB, elapsed=0.0) == 0.0
    off = IdleWait(0.0)
    assert off.wait_for_a_load([(load(1), [Future()], time.perf_counter())], chunk_bytes) is None


def test_only_recent_loads_set_the_rate():
    wait = IdleWait(0.001)
    wait.observe(1 * MB, 1.0)  # one slow load, long ago
    for _ in range(RECENT_LOADS):
        wait.observe(1 * MB, 0.001)
    assert wait.timeout(1 * MB, elapsed=0.0) == pytest.approx(0.002)


def load(chunks):
    return SimpleNamespace(chunks=[SimpleNamespace(bytes=1 * MB)] * chunks)


def chunk_bytes(chunk):
    return chunk.bytes


def finish_after(future, seconds):
    threading.Timer(seconds, future.set_result, ((True, 0.0),)).start()


def test_a_load_running_late_is_left_to_the_next_step():
    wait = IdleWait(0.005)
    wait.observe(1 * MB, 0.050)  # 20 MB/s: a 1 MB load is expected to take 50 ms
    late = Future()
    finish_after(late, 1.0)
    waited = wait.wait_for_a_load([(load(1), [late], time.perf_counter())], chunk_bytes)
    # Back 5 ms after the expected end, neither at the option's 5 ms nor at the load's end a second later.
    assert 0.05 < waited < 0.5 and not late.done()


def test_it_waits_for_the_load_with_fewest_chunks_in_flight_and_not_when_one_is_done():
    wait = IdleWait(2.0)
    now = time.perf_counter()
    near, far = Future(), Future()
    finish_after(near, 0.05)
    finish_after(far, 1.0)
    waited = wait.wait_for_a_load([(load(3), [far, Future(), Future()], now), (load(1), [near], now)], chunk_bytes)
    assert waited < 0.5 and near.done()
    assert wait.wait_for_a_load([(load(1), [near], now), (load(1), [Future()], now)], chunk_bytes) is None

"""The I/O threads' short scheduler slice (connector/sched.py), with the control that turns it off."""

import sys
import threading

import pytest

from pytest_kvoffload.connector.config import ConnectorConfig, ConnectorConfigError
from pytest_kvoffload.connector.io_threads import MIN_SLICE_US, current_slice_ns, request_slice
from pytest_kvoffload.connector.worker import LOAD_THREADS, SAVE_THREADS, WorkerSide

needs_slices = pytest.mark.skipif(current_slice_ns() is None, reason="sched_getattr is not available here")


def in_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@needs_slices
def test_a_thread_gets_the_slice_it_asks_for_and_no_other_thread_does():
    before = in_new_thread(current_slice_ns)
    if not in_new_thread(lambda: request_slice(250)):
        pytest.skip("this kernel keeps one slice for every normal task (custom slices: Linux 6.12)")
    assert in_new_thread(lambda: (request_slice(250), current_slice_ns())[1]) == 250_000
    assert in_new_thread(current_slice_ns) == before  # per thread: the engine's threads keep theirs


@needs_slices
@pytest.mark.parametrize("slice_us", [MIN_SLICE_US, 0])
def test_the_connector_io_threads_run_with_the_configured_slice(slice_us, tmp_path):
    default = in_new_thread(current_slice_ns)
    if not in_new_thread(lambda: request_slice(MIN_SLICE_US)):
        pytest.skip("this kernel keeps one slice for every normal task (custom slices: Linux 6.12)")
    config = ConnectorConfig.from_extra({"store_dir": str(tmp_path), "io_slice_us": slice_us}, 16)
    side = WorkerSide(config, "model=test", tmp_path / "rank0", 16)
    try:
        for pool in (side.load_pool, side.save_pool):
            got = pool.submit(current_slice_ns).result()
            # 0 is the control: the kernel's default slice, which this check must tell apart.
            assert got == (slice_us * 1000 if slice_us else default)
        moved = side.counters.drain().get("io_threads_short_slice", 0)  # one thread per pool so far
        assert moved == (2 if slice_us else 0)
    finally:
        side.shutdown()


def kernel_name() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as fh:
        return fh.read().strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc: Linux only")
def test_the_connector_io_threads_carry_names_the_kernel_shows(tmp_path):
    config = ConnectorConfig.from_extra({"store_dir": str(tmp_path)}, 16)
    side = WorkerSide(config, "model=test", tmp_path / "rank0", 16)
    try:
        # The suites find the I/O threads by these names (cpu_use.thread_times); a plain thread is the
        # control: it keeps the name it inherited.
        assert side.load_pool.submit(kernel_name).result() == LOAD_THREADS
        assert side.save_pool.submit(kernel_name).result() == SAVE_THREADS
        assert in_new_thread(kernel_name) not in (LOAD_THREADS, SAVE_THREADS)
    finally:
        side.shutdown()


@pytest.mark.parametrize("value", ["50", "100001", "-1", "soon"])
def test_a_slice_outside_the_kernel_range_is_a_one_line_error(value, tmp_path):
    with pytest.raises(ConnectorConfigError, match="io_slice_us"):
        ConnectorConfig.from_extra({"store_dir": str(tmp_path), "io_slice_us": value}, 16)


@pytest.mark.parametrize("key", ["load_cpus", "save_cpus"])
def test_io_threads_move_onto_every_cpu_only_when_asked_and_the_other_pool_stays(key, tmp_path):
    import os

    first = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {first})  # as vLLM binds its worker: threads started later inherit it
    way, other = ("load", "save") if key == "load_cpus" else ("save", "load")
    try:
        for choice, want in (("worker", {first}), ("all", set(range(os.cpu_count())) & saved | {first})):
            config = ConnectorConfig.from_extra({"store_dir": str(tmp_path / choice), key: choice}, 16)
            side = WorkerSide(config, "model=test", tmp_path / choice, 16)
            pools = {"load": side.load_pool, "save": side.save_pool}
            moved = pools[way].submit(lambda: os.sched_getaffinity(0)).result()
            kept = pools[other].submit(lambda: os.sched_getaffinity(0)).result()
            # The control: the other pool keeps the worker's binding either way.
            assert moved == want and kept == {first}, choice
            counted = side.counters.drain()
            assert counted.get(f"{way}_threads_on_all_cpus", 0) == (choice == "all")
            assert counted.get(f"{other}_threads_on_all_cpus", 0) == 0
            side.load_pool.shutdown()
            side.save_pool.shutdown()
    finally:
        os.sched_setaffinity(0, saved)

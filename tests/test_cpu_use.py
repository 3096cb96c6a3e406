"""cpu_use: a process group's CPU time and the CPUs its processes are bound to, read from /proc."""

import os
import subprocess
import sys
import time

import pytest

from pytest_kvoffload.cpu_use import describe, group_members, narrowest_affinity, sample, usage

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc only")

SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass\n"
SLEEP = "import time; time.sleep(30)"


def group(code: str, cpus: set[int] | None = None) -> subprocess.Popen:
    """A process in a group of its own, optionally bound to `cpus`, as the server's worker is."""
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, preexec_fn=preexec)


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_a_spinning_process_counts_about_one_core_and_a_sleeping_one_none():
    busy, idle = group(SPIN), group(SLEEP)
    try:
        time.sleep(0.3)
        assert group_members(busy.pid) == [busy.pid]
        first = {pid: sample(pid) for pid in (busy.pid, idle.pid)}
        time.sleep(1.0)
        used = {pid: usage(first[pid], sample(pid)) for pid in (busy.pid, idle.pid)}
    finally:
        stop(busy)
        stop(idle)
    # One spinning thread: near one core (the machine's other work may take a little of it). The sleeper
    # is the control: a count that could not tell them apart would fail here.
    assert 0.3 < used[busy.pid]["server_cores"] <= 1.05, used[busy.pid]
    assert used[idle.pid]["server_cores"] < 0.05, used[idle.pid]
    assert used[busy.pid]["machine_busy"] >= used[busy.pid]["server_cores"] / os.cpu_count() * 0.9
    assert "python" in describe(used[busy.pid])


def test_the_narrowest_binding_in_the_group_is_found_and_none_when_nothing_is_bound():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to bind a process to fewer than this one has")
    one = {min(os.sched_getaffinity(0))}
    bound, free = group(SLEEP, one), group(SLEEP)
    try:
        time.sleep(0.3)
        assert narrowest_affinity(bound.pid) == one
        assert narrowest_affinity(free.pid) is None
    finally:
        stop(bound)
        stop(free)


def test_no_group_no_figures():
    assert sample(None) is None and narrowest_affinity(None) is None

"""cpu_use: a process group's CPU time and the CPUs its processes are bound to, read from /proc."""

import os
import subprocess
import sys
import time

import pytest

from pytest_kvoffload.drive.cpu_use import describe, group_members, narrowest_affinity, sample, thread_times, usage

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


# Two spinning threads named "spin-pair" on one core, a sleeping one named "idle-one", the main thread unnamed.
NAMED = """
import os, threading, time
from pytest_kvoffload.connector.io_threads import name_thread
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
def spin():
    name_thread("spin-pair")
    end = time.time() + 30
    while time.time() < end:
        pass
def rest():
    name_thread("idle-one")
    time.sleep(30)
for target in (spin, spin, rest):
    threading.Thread(target=target, daemon=True).start()
time.sleep(30)
"""


def test_named_threads_sharing_one_core_wait_for_it_and_a_sleeping_one_does_not():
    proc = group(NAMED)
    try:
        time.sleep(0.5)
        first = {name: thread_times(proc.pid, name) for name in ("spin-pair", "idle-one")}
        time.sleep(1.0)
        later = {name: thread_times(proc.pid, name) for name in ("spin-pair", "idle-one")}
    finally:
        stop(proc)
    spinning = later["spin-pair"].since(first["spin-pair"])
    resting = later["idle-one"].since(first["idle-one"])
    assert spinning.threads == 2 and resting.threads == 1  # found by the name the kernel shows
    # Two threads on one core for a second: at most that second on it, and one runnable while the other
    # runs (they also take turns at the GIL, asleep). How much of the core they get depends on what else
    # runs there (under xdist, another worker: 0.48 s on it and 1.23 waiting was seen), but the two times
    # together cover most of the time they were runnable. The sleeper is the control: neither time may
    # move for it.
    assert 0.2 < spinning.on_cpu_s <= 1.1, spinning
    assert spinning.waiting_s > 0.15 and spinning.on_cpu_s + spinning.waiting_s > 0.8, spinning
    assert resting.on_cpu_s < 0.05 and resting.waiting_s < 0.05, resting
    assert thread_times(proc.pid, "no-such-thread") is None

"""No vLLM process outlives the pytest session, nor the LMCache server beside one, nor their shared memory:
not after a failing test, not after Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_kvoffload.serve.processes import group_has_live_members

INNER = """
import os, pathlib, time
import pytest

from pytest_kvoffload.serve.processes import shared_memory_files

# lmcache-disk: a vLLM server and LMCache's, two process groups sharing the engine's KV in /dev/shm.
pytestmark = pytest.mark.parametrize("kv_backend", ["lmcache-disk"], indirect=True, scope="session")

def test_fails_while_the_server_runs(kv_server):
    groups = [kv_server.pgid, kv_server.companion.proc.pid]
    shared = sorted(set().union(*(shared_memory_files(pgid) for pgid in groups)))
    pathlib.Path("server.json").write_text(__import__("json").dumps(
        {"pgid": kv_server.pgid, "pid": kv_server.proc.pid, "groups": groups, "shared": shared,
         "temp": kv_server.temp_dir, "temp_files": os.listdir(kv_server.temp_dir)}))
    assert False, "planned failure"

def test_still_running_when_interrupted(kv_server):
    pathlib.Path("ready").write_text("ready")
    time.sleep(600)
"""


@pytest.mark.server
@pytest.mark.kv_servers("lmcache-disk~inner")  # the inner session's own server
def test_failed_test_then_ctrl_c_leaves_no_server_process(pytester):
    pytester.makepyfile(test_inner=INNER)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        # No compile (--enforce-eager): what is tested is the processes, not their speed (4 to 5 s a start).
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--kv-lengths=256", "--kv-cpu-gib=0.5",
         "--kv-server-arg=--enforce-eager", "test_inner.py"],
        cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
        # A shell that runs a job in the background (CI often does) leaves SIGINT ignored, and an ignored
        # signal stays ignored across exec; restore it so the inner pytest sees Ctrl-C as a user would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 600
        while not (pytester.path / "ready").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the inner session never got its server"
            time.sleep(1)
        server = json.loads((pytester.path / "server.json").read_text())
        assert all(group_has_live_members(pgid) for pgid in server["groups"])
        assert any("lmcache" in path for path in server["shared"]), server["shared"]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "planned failure" in out
    assert not any(group_has_live_members(pgid) for pgid in server["groups"]), "processes outlived the session"
    assert not os.path.exists(f"/proc/{server['pid']}")
    assert not [path for path in server["shared"] if os.path.exists(path)], "shared memory outlived the session"
    # vLLM's ZMQ socket files and torch's rendezvous file: the server's own folder held them (the control),
    # and went with it.
    assert any(name.startswith("vllm_dist_") for name in server["temp_files"]), server
    assert len(server["temp_files"]) > 1 and not os.path.exists(server["temp"]), server
    runs = list((pytester.path / "results").glob("*/run.json"))
    assert len(runs) == 1 and json.loads(runs[0].read_text())["status"] == "partial"


def test_a_stopped_servers_shared_memory_region_is_removed(tmp_path):
    # vLLM's offloading tier lives in a /dev/shm file that outlives its server (seen: 6 GB per start).
    import uuid
    from pytest_kvoffload.serve.server import remove_shared_regions
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    region = shm / f"vllm_offload_{uuid.uuid4()}.mmap"
    region.write_bytes(b"x")
    other = tmp_path / "vllm_offload_not-in-shm.mmap"
    other.write_bytes(b"x")
    log = tmp_path / "native-disk.log"
    log.write_text(f"(Worker pid=1) INFO [shared_offload_region.py:150] Created mmap file {region} (6.33 GB)\n"
                   f"Created mmap file {other} (1.00 GB)\n")
    assert remove_shared_regions(log) == [str(region)]
    assert not region.exists() and other.exists()
    assert remove_shared_regions(log) == []  # already gone: nothing to do, no error
    assert remove_shared_regions(tmp_path / "missing.log") == []


HOLDER = """
import ctypes, os, pathlib, sys, time
mapped, opened, ready = sys.argv[1:]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(mapped, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
assert libc.mmap(None, 4096, 3, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)  # shared, read-write
os.close(fd)  # mapped, no descriptor: only /proc/PID/maps shows it
held = open(opened, "wb")  # open, not mapped: only /proc/PID/fd shows it
pathlib.Path(ready).write_text("ready")
time.sleep(60)
"""


def test_shared_memory_a_killed_server_group_left_is_removed_and_nothing_else(tmp_path):
    # vLLM's message queues are SharedMemory segments in /dev/shm; a group killed with its resource tracker
    # leaves them behind (160 MiB each seen).
    import uuid
    from pytest_kvoffload.serve.processes import remove_left_shared_memory, shared_memory_files
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    mine, opened, held, unrelated = (shm / f"kvoffload-test-{name}-{uuid.uuid4()}"
                                     for name in ("mapped", "opened", "held", "other"))
    unrelated.write_bytes(b"x")
    ready = tmp_path / "ready"
    group = subprocess.Popen([sys.executable, "-c", HOLDER, str(mine), str(opened), str(ready)],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and group.poll() is None, "the holder never started"
            time.sleep(0.05)
        found = shared_memory_files(group.pid)
        assert {str(mine), str(opened)} <= found and str(unrelated) not in found
        # The control: a file still in use by a live process outside the group is kept, though listed.
        with open(held, "w+b") as keep:
            assert remove_left_shared_memory(found | {str(held)}) == []  # the group still lives: nothing goes
            os.killpg(group.pid, signal.SIGKILL)
            group.wait(timeout=10)
            assert remove_left_shared_memory(found | {str(held)}) == sorted([str(mine), str(opened)])
            assert not mine.exists() and not opened.exists() and held.exists() and unrelated.exists()
            keep.write(b"x")
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
        for path in (mine, opened, held, unrelated):
            path.unlink(missing_ok=True)


def test_a_servers_temporary_folder_goes_with_it_and_a_users_own_settings_win(tmp_path):
    from pytest_kvoffload.serve.server import VllmServer

    # The fake server reports where its temporary files would go.
    command = [sys.executable, "-c", "import os, tempfile, time; open(os.environ['REPORT'], 'w').write("
               "tempfile.gettempdir() + ' ' + os.environ.get('TORCHINDUCTOR_CACHE_DIR', '-')); time.sleep(60)"]
    report = tmp_path / "report"
    server = VllmServer("fake", command, dict(os.environ, REPORT=str(report)), 1, tmp_path / "log", "m")
    try:
        server.start()
        folder = server.temp_dir
        assert server.env["VLLM_RPC_BASE_PATH"] == folder and os.path.isdir(folder)
        deadline = time.monotonic() + 30
        while (not report.exists() or not report.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        temp, inductor = report.read_text().split()
        # Inductor's cache stays where torch puts it by default, shared by the servers.
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        assert temp == folder and inductor == default_cache_dir(), (temp, inductor)
        Path(folder, "socket-left-by-vllm").touch()
    finally:
        server.stop(grace=5)  # a failed check above leaves no folder behind either
    assert not os.path.exists(folder)
    own = tmp_path / "own"
    own.mkdir()
    env = dict(os.environ, REPORT=str(tmp_path / "report2"), VLLM_RPC_BASE_PATH=str(own),
               TORCHINDUCTOR_CACHE_DIR=str(own))
    server = VllmServer("fake", command, env, 1, tmp_path / "log", "m")
    try:
        server.start()
        assert server.env["VLLM_RPC_BASE_PATH"] == server.env["TORCHINDUCTOR_CACHE_DIR"] == str(own)
    finally:
        server.stop(grace=5)
    assert server.temp_dir is None and own.is_dir()


def test_a_server_finds_the_shared_precompiled_headers_and_its_stop_leaves_them(tmp_path):
    from pytest_kvoffload.serve.server import VllmServer

    # Torch puts precompiled headers under its default folder in TMPDIR, whatever TORCHINDUCTOR_CACHE_DIR says.
    command = [sys.executable, "-c", "import os, time; from torch._inductor.codecache import _HEADER_DIR; "
               "open(os.environ['REPORT'], 'w').write(os.path.realpath(_HEADER_DIR)); time.sleep(60)"]
    shared, report = tmp_path / "shared", tmp_path / "report"
    env = dict(os.environ, REPORT=str(report), TORCHINDUCTOR_CACHE_DIR=str(shared))
    server = VllmServer("fake", command, env, 1, tmp_path / "log", "m")
    try:
        server.start()
        deadline = time.monotonic() + 60
        while (not report.exists() or not report.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert report.read_text() == str(shared / "precompiled_headers")
        (shared / "precompiled_headers").mkdir()
        (shared / "precompiled_headers" / "header.h.gch").touch()
    finally:
        server.stop(grace=5)
    assert (shared / "precompiled_headers" / "header.h.gch").exists()

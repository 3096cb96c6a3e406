"""No vLLM process outlives the pytest session: not after a failing test, not after Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pytest_kvoffload.server import _group_has_live_members

INNER = """
import os, pathlib, time
import pytest

pytestmark = pytest.mark.parametrize("kv_backend", ["gpu-only"], indirect=True, scope="session")

def test_fails_while_the_server_runs(kv_server):
    pathlib.Path("server.json").write_text(__import__("json").dumps({"pgid": kv_server.pgid, "pid": kv_server.proc.pid}))
    assert False, "planned failure"

def test_still_running_when_interrupted(kv_server):
    pathlib.Path("ready").write_text("ready")
    time.sleep(600)
"""


@pytest.mark.server
def test_failed_test_then_ctrl_c_leaves_no_server_process(pytester):
    pytester.makepyfile(test_inner=INNER)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--kv-lengths=256", "test_inner.py"],
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
        assert _group_has_live_members(server["pgid"])
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "planned failure" in out
    assert not _group_has_live_members(server["pgid"]), "vLLM processes outlived the session"
    assert not os.path.exists(f"/proc/{server['pid']}")
    runs = list((pytester.path / "results").glob("*/run.json"))
    assert len(runs) == 1 and json.loads(runs[0].read_text())["status"] == "partial"

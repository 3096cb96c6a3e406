"""A backend's companion process (serve/companion.py) on a stand-in: ready on its log line, its counters
read, its group stopped; an exit or a missed deadline reported with its log tail. No vLLM."""

import sys
import time

from pytest_kvoffload.serve.companion import Companion, CompanionSpec
from pytest_kvoffload.serve.processes import free_port, group_has_live_members

STAND_IN = """
import http.server, sys, time
port = int(sys.argv[1])
class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"# TYPE lmcache_mp_l2_prefetch_load_completed_chunks counter\\n" \\
               b"lmcache_mp_l2_prefetch_load_completed_chunks_total 5.0\\nother_total 1.0\\n"
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Metrics)
print("serving", flush=True)
server.serve_forever()
"""


def spec(argv, timeout=30.0, port=1):
    return CompanionSpec(name="the stand-in", argv=argv, env={}, metrics_url=f"http://127.0.0.1:{port}/metrics",
                         metric_prefixes=("lmcache_mp_",), ready_line=b"serving", start_timeout_s=timeout)


def wait(until, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_companion_is_ready_on_its_log_line_its_counters_are_read_and_its_group_stopped(tmp_path):
    port = free_port()
    companion = Companion(spec([sys.executable, "-c", STAND_IN, str(port)], port=port), tmp_path / "c.log")
    companion.start()
    try:
        wait(companion.ready)
        assert companion.failure("during start-up") is None
        assert companion.metrics().extra == {"lmcache_mp_l2_prefetch_load_completed_chunks_total": 5.0}
    finally:
        companion.stop(grace=5)
    assert not group_has_live_members(companion.proc.pid)


def test_a_companion_that_exits_or_never_gets_ready_is_reported_with_its_log_tail(tmp_path):
    dying = Companion(spec([sys.executable, "-c", "print('bad flag --l2-adapter'); raise SystemExit(3)"]),
                      tmp_path / "dying.log")
    dying.start()
    wait(lambda: dying.exit_code() is not None)
    message = dying.failure("during start-up")
    assert message.startswith(f"the stand-in exited with code 3 during start-up; log {tmp_path / 'dying.log'}")
    assert message.endswith("last lines:\nbad flag --l2-adapter\n")
    silent = Companion(spec([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.2), tmp_path / "s.log")
    silent.start()
    try:
        time.sleep(0.3)
        assert silent.failure("during start-up").startswith("the stand-in not ready after 0 s")
    finally:
        silent.stop(grace=5)
    assert not group_has_live_members(silent.proc.pid)

"""The session's server pool, with stand-in servers (no vLLM): what happens around each stop."""

from pytest_kvoffload.serve.server import ServerPool


class Proc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


class Server:
    def __init__(self, code=None):
        self.proc, self.stopped = Proc(code), False

    def start(self):
        pass

    def wait_healthy(self, timeout, progress, expected_s=None):
        return 1.0

    def stop(self):
        self.stopped = True


def test_each_running_server_is_read_before_it_stops_and_stops_even_if_reading_fails():
    seen = []

    def before_stop(key, server):
        seen.append(key)
        raise OSError("metrics unreachable")

    pool = ServerPool(max_running=1, before_stop=before_stop)
    first, second = Server(), Server()
    pool.get("a", lambda: first, 10)
    try:
        pool.get("b", lambda: second, 10)  # a is released to make room
    except OSError:
        pass
    assert first.stopped and seen == ["a"]


def test_an_exited_server_is_not_read():
    seen = []
    pool = ServerPool(before_stop=lambda key, server: seen.append(key))
    dead = Server(code=1)
    pool.get("a", lambda: dead, 10)
    pool.stop_all()
    assert dead.stopped and seen == []

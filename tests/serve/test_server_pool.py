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

    def failure(self, during):
        return None


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


def test_a_kept_server_stays_up_while_the_others_take_turns():
    """Ours is kept (session.py): each other backend's server makes room by stopping the last other one,
    so that close calls run on the two servers that measured the grid; with only kept servers left, the
    least recently used goes."""
    pool = ServerPool(max_running=2)
    pool.keep = frozenset({"ours"})
    servers = {name: Server() for name in ("ours", "a", "b", "c")}
    pool.get("ours", lambda: servers["ours"], 10)
    pool.get("a", lambda: servers["a"], 10)
    pool.get("ours", lambda: servers["ours"], 10)  # used since: a is now the least recently used
    pool.get("a", lambda: servers["a"], 10)  # ... and now ours is
    pool.get("b", lambda: servers["b"], 10)
    assert servers["a"].stopped and not servers["ours"].stopped
    pool.get("c", lambda: servers["c"], 10)
    assert servers["b"].stopped and not servers["ours"].stopped and pool.has("ours") and pool.has("c")
    solo = ServerPool(max_running=1)
    solo.keep = frozenset({"ours"})
    first = Server()
    solo.get("ours", lambda: first, 10)
    solo.get("a", lambda: Server(), 10)  # one at a time (a GPU): even a kept server makes room
    assert first.stopped and solo.has("a")


def test_among_the_servers_not_kept_the_least_recently_used_makes_room():
    pool = ServerPool(max_running=3)
    pool.keep = frozenset({"ours"})
    servers = {name: Server() for name in ("ours", "a", "b", "c")}
    for name in ("ours", "a", "b"):
        pool.get(name, lambda name=name: servers[name], 10)
    pool.get("c", lambda: servers["c"], 10)
    assert servers["a"].stopped and not servers["b"].stopped and not servers["ours"].stopped

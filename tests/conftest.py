import os

import pytest

from pytest_kvoffload.serve.weights import cache_dir

pytest_plugins = ["pytester"]

# pytester points HOME at a temporary folder; without this every pytester run would write the test
# model's random weights (220 MB) anew instead of reusing the cached ones.
os.environ.setdefault("KVOFFLOAD_CACHE", str(cache_dir()))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The output oracle's fault servers first, then kvoffload-disk's own tests (the self A/B first).

    At most two servers run at once on a CPU (server.ServerPool), and pytest groups the tests of each
    backend: the oracle's tests belong to kvoffload-disk's group but start two servers of their own, so
    in file order they evicted kvoffload-disk's server in the middle of its group, costing a start-up
    (about 40 s on 2 cores, more on slower CPUs). Run before that group's other tests, they cost nothing.
    """
    oracle = [item for item in items if item.nodeid.startswith("tests/measure/test_output_oracle.py")]
    rest = [item for item in items if not item.nodeid.startswith("tests/measure/test_output_oracle.py")]
    # The first test of kvoffload-disk's group that keeps its server (the self A/B, then the connector's).
    group = ("tests/measure/test_ab_method.py::test_a_backend_against_itself", "tests/connector/test_connector_server.py")
    first = next((i for i, item in enumerate(rest) if item.nodeid.startswith(group)), None)
    if oracle and first is not None:
        items[:] = rest[:first] + oracle + rest[first:]


@pytest.fixture
def store_twin(kv_session, kv_backend):
    """kv_backend's twin (`NAME~b`, as `--kv-ab NAME,NAME` names it): the same configuration on a second
    server, on the same store. The connector's tests start it after the first server wrote chunks (a
    fresh process must serve them: its index comes from the files), and the self A/B compares the two;
    one start-up serves both (make test's budget, docs/servers.md)."""
    import dataclasses

    from pytest_kvoffload.serve.backend import twin_name
    name = twin_name(kv_backend.name)
    if name not in kv_session.registry:
        first = kv_session.context(kv_backend)

        def configure(ctx):
            return kv_backend.configure(dataclasses.replace(ctx, scratch=first.scratch))

        kv_session.registry.register(dataclasses.replace(kv_backend, name=name, configure=configure,
                                                         user_facing=False))
    return kv_session.registry.get(name)

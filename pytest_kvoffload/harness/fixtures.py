"""The fixtures suites use. The plugin registers this module; the logic lives in the modules it calls."""

from __future__ import annotations

import pytest

from pytest_kvoffload.serve.backend import Backend
from pytest_kvoffload.measure.cells import Cell
from pytest_kvoffload.measure.runner import CellOutcome, CellRunner
from pytest_kvoffload.serve.client import Endpoint
from pytest_kvoffload.serve.server import ServerStartError
from pytest_kvoffload.harness.session import KVSession
from pytest_kvoffload.core.settings import Settings

SESSION_KEY = pytest.StashKey[KVSession]()


@pytest.fixture(scope="session")
def kv_session(pytestconfig) -> KVSession:
    return pytestconfig.stash[SESSION_KEY]


@pytest.fixture(scope="session")
def kv_settings(kv_session) -> Settings:
    return kv_session.settings


@pytest.fixture(scope="session")
def kv_backend(request, kv_session) -> Backend:
    """The backend under test; parametrized by --kv-backend (or by a test's own indirect parametrize)."""
    name = getattr(request, "param", None) or kv_session.settings.backends[0]
    if name not in kv_session.registry:
        pytest.fail(f"unknown backend {name!r}; registered: {', '.join(kv_session.registry.names())}", pytrace=False)
    backend = kv_session.registry.get(name)
    reason = backend.unavailable_reason()
    if reason and not kv_session.settings.server_url:
        kv_session.skip(backend, reason)
        pytest.skip(reason)
    return backend


@pytest.fixture
def kv_server(kv_session, kv_backend) -> Endpoint:
    """A healthy vLLM server for kv_backend, shared by every test of that backend in the session.

    The session's server pool does the sharing; asking it per test means a test that restarts a
    server (or a server that died) never leaves later tests holding a stale endpoint.
    """
    try:
        return kv_session.endpoint(kv_backend)
    except ServerStartError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def kv_measure(kv_session, kv_backend, kv_server, request):
    """Measure a cell over --kv-rounds rounds through pytest-benchmark when it is active.

    Returns a CellOutcome; a round whose cached tokens came from the wrong place fails the test.
    """
    try:
        # Requested here, so suites get --benchmark-json and pytest-benchmark compare without asking.
        benchmarks = [request.getfixturevalue("benchmark")]
    except pytest.FixtureLookupError:
        benchmarks = []

    def run(cell: Cell, rounds: int | None = None, check: bool = True) -> CellOutcome:
        if cell.length not in kv_session.lengths:
            pytest.skip(f"{cell.length} tokens left out: cold prefill predicted above the "
                        f"{kv_session.settings.max_prefill_s:g} s budget on this machine (--kv-max-prefill)")
        # Tier hits carry their server's engine hit of each round: the tier's limit (analysis/tier_limit.py).
        runner = CellRunner(kv_session.recorder, kv_backend, kv_server, cell, paired_engine=True)
        # pytest-benchmark times one measurement per test: the first cell of a test goes through it.
        outcome = runner.run(rounds or kv_session.settings.rounds, benchmarks.pop() if benchmarks else None)
        if check and outcome.failures:
            pytest.fail(f"{kv_backend.name} {cell.id}: " + "; ".join(outcome.failures), pytrace=False)
        return outcome

    return run

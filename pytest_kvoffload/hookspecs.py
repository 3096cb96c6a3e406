"""Hooks pytest-kvoffload calls, for a user's conftest.py or plugin to implement."""

import pytest

hookspec = pytest.hookspec


@hookspec
def pytest_kvoffload_register_backends(registry):
    """Add backends to `registry` (a BackendRegistry) before --kv-backend is checked.

    Example, in conftest.py::

        from pytest_kvoffload.backends import Backend, ServerSpec

        def pytest_kvoffload_register_backends(registry):
            registry.register(Backend(
                name="my-connector", description="our connector", tier="disk",
                configure=lambda ctx: ServerSpec(args=["--kv-transfer-config", "..."]),
            ))
    """


@hookspec
def pytest_kvoffload_measurement(record):
    """Called with each measurement record (a dict) as soon as it is taken; may add keys to it."""

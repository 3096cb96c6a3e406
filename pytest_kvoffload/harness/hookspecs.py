"""Hooks pytest-kvoffload calls, for a user's conftest.py or plugin to implement."""

import pytest

hookspec = pytest.hookspec


@hookspec
def pytest_kvoffload_register_backends(registry):
    """Add backends to `registry` (a BackendRegistry) before --kv-backend is checked.

    Example, in conftest.py::

        from pytest_kvoffload.serve.backend import Backend, ServerSpec

        def pytest_kvoffload_register_backends(registry):
            registry.register(Backend(
                name="my-connector", description="our connector", tier="disk",
                configure=lambda ctx: ServerSpec(args=["--kv-transfer-config", "..."]),
            ))
    """


@hookspec
def pytest_kvoffload_measurement(record):
    """Called with each measurement record (a dict) as soon as it is taken; may add keys to it."""


@hookspec
def pytest_kvoffload_environment(environment):
    """Called once with the run's environment (a dict: machine, CPU flags, versions, drive) before it is
    recorded in run.json; may add keys to it (a lab's machine id, a rack, a firmware version)."""


@hookspec
def pytest_kvoffload_run_finished(run, run_dir):
    """Called once the run's record is complete and its files are written: `run` is run.json's content (a
    dict), `run_dir` the run's folder (a Path). Post it, check it, archive it."""

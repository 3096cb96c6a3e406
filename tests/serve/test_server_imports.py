"""A server's Python is asked to import what its backend loads into vLLM before the server starts, and a
module that fails stops the run in one line naming it and the versions (serve/server_imports.py)."""

import sys

import pytest

from pytest_kvoffload.serve import server_imports
from pytest_kvoffload.serve.builtin import default_registry


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module that fails as a compiled op built for another torch does, on the children's path."""
    (tmp_path / "planted_cuda_ops.py").write_text(
        "raise ImportError('planted_cuda_ops.so: undefined symbol: _ZN3c104cuda9SetDeviceEa')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(server_imports, "_checked", {})
    return "planted_cuda_ops"


def test_a_module_that_fails_to_import_is_one_line_with_the_versions(planted):
    import torch
    problem = server_imports.import_problem("lmcache-disk", sys.executable, ("json", planted))
    assert "\n" not in problem
    assert problem.startswith("lmcache-disk: its server's Python cannot import planted_cuda_ops (ImportError: "
                              "planted_cuda_ops.so: undefined symbol: _ZN3c104cuda9SetDeviceEa) with torch "
                              f"{torch.__version__.split('+')[0]}")


def test_a_missing_submodule_names_its_package_version_beside_torchs(planted):
    from importlib.metadata import version
    problem = server_imports.import_problem("lmcache-disk", sys.executable, ("lmcache.no_such_ops",))
    assert "cannot import lmcache.no_such_ops (ModuleNotFoundError:" in problem
    assert f"and lmcache {version('lmcache')}" in problem and "--kv-backend-python lmcache-disk=PATH" in problem


def test_modules_that_import_pass_and_are_asked_once(planted, monkeypatch):
    assert server_imports.import_problem("x", sys.executable, ("json", "pytest_kvoffload.core.models")) is None
    monkeypatch.setattr(server_imports, "_probe", lambda *a: pytest.fail("asked twice"))
    assert server_imports.import_problem("x", sys.executable, ("json", "pytest_kvoffload.core.models")) is None
    assert server_imports.import_problem("x", sys.executable, ()) is None


def test_an_interpreter_that_cannot_run_is_one_line(tmp_path):
    problem = server_imports.import_problem("gpu-only", str(tmp_path / "no-python"), ("json",))
    assert problem.startswith("gpu-only: ") and "could not be asked" in problem and "\n" not in problem


@pytest.mark.parametrize("cuda", [True, False])
def test_each_backend_names_what_it_loads_into_vllm(monkeypatch, cuda):
    from pytest_kvoffload.core import machine
    monkeypatch.setattr(machine, "has_cuda", lambda: cuda)
    registry = default_registry()
    imports = {name: registry.get(name).server_imports() for name in registry.names()}
    assert imports["kvoffload-disk"] == ("pytest_kvoffload.connector.connector",
                                         "pytest_kvoffload.rigged.rigged_connector")
    assert imports["gpu-only"] == ()
    ops = "lmcache.cuda_ops" if cuda else "lmcache.lmcache_native"
    assert imports["lmcache-disk"][0] == ops and imports["lmcache-inproc-disk"][0] == ops
    assert imports["native-cpu"] == imports["native-disk"] == (() if cuda else ("pytest_kvoffload.cpu_copy_worker",))


def test_lmcache_compiled_ops_of_the_cpu_build_import_here():
    pytest.importorskip("lmcache")
    problem = server_imports.import_problem("lmcache-disk", sys.executable, ("lmcache.lmcache_native",))
    assert problem is None


PLANTED_BACKEND = """
import sys
from pytest_kvoffload.serve.backend import Backend

def pytest_kvoffload_register_backends(registry):
    registry.register(Backend(name="planted-ops", description="loads a module built for another torch",
                              python=sys.executable, server_imports=lambda: ("planted_cuda_ops",)))
"""
USES_A_SERVER = """
def test_uses_a_server(kv_server):
    raise AssertionError("a server was started")
"""


def test_the_run_stops_in_one_line_before_the_first_server(pytester, planted, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_DEVICE", "cpu")
    pytester.makeconftest(PLANTED_BACKEND)
    pytester.makepyfile(test_planted=USES_A_SERVER)
    result = pytester.runpytest_subprocess("--kv-backend=planted-ops", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = result.stdout.str() + result.stderr.str()
    assert "planted-ops: its server's Python cannot import planted_cuda_ops (ImportError:" in output
    assert "a server was started" not in output and "starting vLLM" not in output

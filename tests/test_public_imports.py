"""What users and vLLM name keeps working after the package moved into folders: the pytest entry point,
the connector's module path, the CPU spec module path and the README's `Backend`/`ServerSpec` import."""

import importlib
from importlib import metadata


def test_the_pytest_entry_point_loads_the_plugin():
    (entry,) = [e for e in metadata.entry_points(group="pytest11") if e.name == "kvoffload"]
    assert entry.load() is importlib.import_module("pytest_kvoffload.harness.plugin")


def test_the_readme_import_of_backend_types():
    from pytest_kvoffload.backends import Backend, ServerSpec
    from pytest_kvoffload.serve import backend

    assert Backend is backend.Backend and ServerSpec is backend.ServerSpec
    # A plugin's ServerSpec(args, env, companion) still builds one, the new fields defaulted.
    assert ServerSpec(["--x"], {"A": "1"}, None).tier_folders == ()


def test_the_module_paths_vllm_loads():
    from pytest_kvoffload.serve.command_line import CPU_PLATFORM_SPEC_MODULE
    from pytest_kvoffload.serve.builtin.kvoffload_disk import transfer_config

    assert transfer_config({})["kv_connector_module_path"] == "pytest_kvoffload.connector"

    assert CPU_PLATFORM_SPEC_MODULE == "pytest_kvoffload.cpu_copy_worker"
    assert hasattr(importlib.import_module("pytest_kvoffload.connector"), "KVOffloadDiskConnector")
    assert importlib.util.find_spec(CPU_PLATFORM_SPEC_MODULE) is not None

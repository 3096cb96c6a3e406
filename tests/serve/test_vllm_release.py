"""Every backend's CUDA command line against what vLLM 0.33 (the gpu extra's release) accepts, as recorded from
its own wheel by scripts/vllm_source_facts.py (tests/serve/golden/vllm-0.33.0.json): flags, connector names,
KVTransferConfig fields and the kv_connector_extra_config keys its offloading specs read."""

import json
from pathlib import Path

import pytest

from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.harness.backend_options import parse_variant
from pytest_kvoffload.serve.backend import LaunchContext
from pytest_kvoffload.serve.command_line import server_command
from pytest_kvoffload.serve.builtin import default_registry

GOLDEN = Path(__file__).parent / "golden" / "vllm-0.33.0.json"
BACKENDS = ["gpu-only", "native-cpu", "lmcache-disk", "native-disk", "kvoffload-disk", "lmcache-inproc-disk"]


@pytest.fixture(scope="module")
def release():
    facts = json.loads(GOLDEN.read_text())
    assert facts["vllm"] == "0.33.0" and len(facts["flags"]) > 300, "regenerate with scripts/vllm_source_facts.py"
    return facts


def problems(argv: list[str], facts: dict) -> list[str]:
    """What vLLM 0.33 would refuse in a server's arguments (after `python -m vllm...`), one line each."""
    found, flags, i = [], facts["flags"], 0
    while i < len(argv):
        token = argv[i]
        flag = token.partition("=")[0]
        if not token.startswith("--"):
            found.append(f"{token!r} follows a flag that takes no value")
        elif flag not in flags:
            found.append(f"unknown flag {flag}")
        elif flags[flag] and "=" not in token:
            i += 1
        i += 1
    if "--kv-transfer-config" in argv:
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        found += [f"KVTransferConfig has no field {k!r}" for k in config if k not in facts["kv_transfer_config_fields"]]
        if "kv_connector_module_path" not in config and config["kv_connector"] not in facts["kv_connectors"]:
            found.append(f"vLLM registers no connector {config['kv_connector']!r}")
        if config["kv_connector"] == "OffloadingConnector":
            extra = config.get("kv_connector_extra_config", {})
            read = facts["offloading_spec_keys"].get(extra.get("spec_name", "CPUOffloadingSpec"))
            if read is None:
                found.append(f"vLLM's offloading has no spec {extra['spec_name']!r}")
            else:
                found += [f"{extra.get('spec_name')} reads no key {k!r}" for k in extra if k not in read]
    return found


def cuda_command(backend, tmp_path, **kw):
    settings = Settings(**{"backends": ("gpu-only",), "model": load_model("tiny-llama"), "lengths": (512,),
                           "fractions": (1.0,), "rounds": 1, "results_dir": tmp_path, "block_size": 128, **kw})
    return server_command(backend, LaunchContext(settings, tmp_path), 8123)[0]


@pytest.fixture
def on_a_gpu(monkeypatch):
    from pytest_kvoffload.core import machine
    monkeypatch.setattr(machine, "has_cuda", lambda: True)


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_cuda_command_line_is_one_vllm_033_accepts(release, on_a_gpu, tmp_path, name):
    argv = cuda_command(default_registry().get(name), tmp_path, tensor_parallel=2, engine_tokens=4096,
                        server_args=("--max-num-batched-tokens", "2048"))
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert problems(argv[3:], release) == []


@pytest.mark.parametrize("name", ["native-cpu", "native-disk"])  # ours: its own ConnectorConfig checks them
def test_every_option_key_a_backend_accepts_reaches_a_config_vllm_033_reads(release, on_a_gpu, tmp_path, name):
    registry = default_registry()
    keys = sorted(registry.get(name).option_keys)
    assert keys, name
    samples = {"eviction_policy": "arc", "cache_policy_module_path": "x.y", "offload_prompt_only": "false",
               "backpressure": "{}", "cpu_bytes_to_use": 2**30, "store_threshold": 2}
    for key in keys:
        from pytest_kvoffload.serve.backend import BackendConfigError
        try:
            variant = parse_variant(f"{name}[{key}={samples.get(key, 4)}]", registry)
        except BackendConfigError as exc:  # refused with one line before a server: allowed, but say so here
            assert "\n" not in str(exc)
            continue
        assert problems(cuda_command(variant, tmp_path)[3:], release) == [], key


def test_store_threshold_is_refused_for_native_disk_before_a_server(release):
    from pytest_kvoffload.serve.backend import BackendConfigError
    # vLLM's TieringOffloadingSpec raises "store_threshold is not supported" (tiering/spec.py).
    assert "store_threshold" in release["offloading_spec_keys"]["TieringOffloadingSpec"]
    with pytest.raises(BackendConfigError, match="native-disk has no option 'store_threshold'"):
        parse_variant("native-disk[store_threshold=2]", default_registry())


def test_a_planted_unknown_flag_key_or_connector_is_found(release, on_a_gpu, tmp_path):
    argv = cuda_command(default_registry().get("gpu-only"), tmp_path, server_args=("--no-such-flag", "1"))
    # An unknown flag's value cannot be told from a stray one: both are reported.
    assert problems(argv[3:], release) == ["unknown flag --no-such-flag", "'1' follows a flag that takes no value"]
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "no_such_key": 1}}
    assert problems(["--kv-transfer-config", json.dumps(config)], release) == [
        "TieringOffloadingSpec reads no key 'no_such_key'"]
    assert problems(["--kv-transfer-config", json.dumps({"kv_connector": "Nope"})], release) == [
        "vLLM registers no connector 'Nope'"]
    assert problems(["--enable-prefix-caching", "yes"], release) == ["'yes' follows a flag that takes no value"]

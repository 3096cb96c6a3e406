import json
from pathlib import Path

import pytest

from pytest_kvoffload.backends import (Backend, LaunchContext, default_registry, server_command,
                                       with_connector_options)
from pytest_kvoffload.models import load_model
from pytest_kvoffload.settings import Settings


def settings(**kw):
    base = dict(backends=("gpu-only",), model=load_model("tiny-llama"), lengths=(512,), fractions=(1.0,), rounds=1,
                results_dir=Path("/tmp/r"), block_size=128)
    base.update(kw)
    return Settings(**base)


def command(name, tmp_path, **kw):
    registry = default_registry()
    return server_command(registry.get(name), LaunchContext(settings(**kw), tmp_path), 8123)


def test_common_arguments(tmp_path):
    argv, env = command("gpu-only", tmp_path)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--skip-tokenizer-init", "--enable-prompt-tokens-details", "--enable-per-request-metrics",
                 "--enable-prefix-caching"):
        assert flag in argv
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert argv[argv.index("--block-size") + 1] == "128"
    assert argv[argv.index("--port") + 1] == "8123"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--kv-transfer-config" not in argv


def test_kvoffload_disk_loads_our_connector_by_module_path(tmp_path):
    argv, _ = command("kvoffload-disk", tmp_path)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVOffloadDiskConnector"
    assert config["kv_connector_module_path"] == "pytest_kvoffload.connector"
    assert config["kv_role"] == "kv_both"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {"store_dir": str(tmp_path / "kv-store"), "chunk_tokens": 256}


def test_kvoffload_disk_options_pass_through(tmp_path):
    argv, _ = command("kvoffload-disk", tmp_path, extra={"kvoffload_disk": {"store_dir": "/nvme/kv", "read_gbps": 6}})
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"store_dir": "/nvme/kv", "read_gbps": 6, "chunk_tokens": 256}


def test_native_cpu_uses_vllm_offloading_flags(tmp_path):
    argv, _ = command("native-cpu", tmp_path, extra={"cpu_offload_gib": 32})
    assert argv[argv.index("--kv-offloading-size") + 1] == "32"
    assert argv[argv.index("--kv-offloading-backend") + 1] == "native"


def test_lmcache_disk_environment(tmp_path):
    argv, env = command("lmcache-disk", tmp_path)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert env["LMCACHE_LOCAL_DISK"] == f"file://{tmp_path / 'lmcache-disk'}/"
    assert float(env["LMCACHE_MAX_LOCAL_DISK_SIZE"]) > 0 and float(env["LMCACHE_MAX_LOCAL_CPU_SIZE"]) > 0


def test_extra_server_arguments_come_last(tmp_path):
    argv, _ = command("gpu-only", tmp_path, server_args=("--max-num-seqs", "4"))
    assert argv[-2:] == ["--max-num-seqs", "4"]


def test_registry_refuses_duplicates_and_reserved_names():
    registry = default_registry()
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Backend(name="gpu-only", description="again"))
    with pytest.raises(ValueError, match="reserved"):
        registry.register(Backend(name="all", description="no"))


def test_cuda_backends_know_why_they_cannot_run(monkeypatch):
    from pytest_kvoffload import machine
    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    registry = default_registry()
    assert registry.get("gpu-only").unavailable_reason() is None
    assert registry.get("kvoffload-disk").unavailable_reason() is None
    assert "needs an NVIDIA GPU" in registry.get("native-cpu").unavailable_reason()
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    assert registry.get("native-cpu").unavailable_reason() is None


def test_connector_variant_gets_its_own_name_store_and_options(tmp_path):
    registry = default_registry()
    slow = with_connector_options(registry.get("kvoffload-disk"), "slow", read_gbps=0.025)
    assert slow.name == "kvoffload-disk[slow]" and slow.tier == "disk"
    argv, _ = server_command(slow, LaunchContext(settings(), tmp_path), 8123)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["read_gbps"] == 0.025 and extra["store_dir"] == str(tmp_path / "kv-store") + "-slow"
    with pytest.raises(ValueError, match="configures no KV connector"):
        server_command(with_connector_options(registry.get("gpu-only"), "x"), LaunchContext(settings(), tmp_path), 1)


def test_native_disk_uses_vllm_tiering_with_an_fs_tier(tmp_path):
    argv, _ = command("native-disk", tmp_path)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] == 2**30
    assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": str(tmp_path / "native-disk")}]


def test_native_disk_spec_and_tier_exist_in_the_installed_vllm():
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.tiering import factory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: F401
    assert "\"fs\"" in Path(factory.__file__).read_text()

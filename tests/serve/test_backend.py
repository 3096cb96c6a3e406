import json
from pathlib import Path

import pytest

from pytest_kvoffload.serve.backend import Backend, LaunchContext, with_connector_options
from pytest_kvoffload.serve.command_line import server_command

from pytest_kvoffload.serve.builtin import default_registry
from pytest_kvoffload.core.models import load_model
from pytest_kvoffload.core.settings import Settings


def settings(**kw):
    base = dict(backends=("gpu-only",), model=load_model("tiny-llama"), lengths=(512,), fractions=(1.0,), rounds=1,
                results_dir=Path("/tmp/r"), block_size=128)
    base.update(kw)
    return Settings(**base)


def registry_needs_cuda(name):
    return default_registry().get(name).needs_cuda


def command(name, tmp_path, **kw):
    registry = default_registry()
    return server_command(registry.get(name), LaunchContext(settings(**kw), tmp_path), 8123)


def test_the_engine_cache_in_whole_blocks_for_every_backend_and_vllms_own_sizing_by_default(tmp_path):
    for name in ("gpu-only", "native-cpu", "kvoffload-disk"):
        argv, _ = command(name, tmp_path, engine_tokens=32_769)
        assert argv[argv.index("--num-gpu-blocks-override") + 1] == "257", name  # 32,769 / 128, rounded up
    assert "--num-gpu-blocks-override" not in command("gpu-only", tmp_path)[0]


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
    assert config["kv_connector_extra_config"] == {"store_dir": str(tmp_path / "kv-store"), "chunk_tokens": 256,
                                                   "capacity_gb": 64.0}


def test_kvoffload_disk_options_pass_through(tmp_path):
    argv, _ = command("kvoffload-disk", tmp_path, disk_opts={"store_dir": "/nvme/kv", "read_gbps": 6})
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"store_dir": "/nvme/kv", "read_gbps": 6, "chunk_tokens": 256, "capacity_gb": 64.0}


def test_native_cpu_on_a_gpu_is_what_vllms_offloading_flags_expand_to_so_variants_reach_it(tmp_path, monkeypatch):
    from pytest_kvoffload.core import machine
    from pytest_kvoffload.harness.backend_options import parse_variant
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    argv, _ = command("native-cpu", tmp_path, cpu_gib=32.0)
    assert "--kv-offloading-size" not in argv
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert (config["kv_connector"], config["kv_role"]) == ("OffloadingConnector", "kv_both")
    assert config["kv_connector_extra_config"] == {"cpu_bytes_to_use": 32 * 2**30, "spec_name": "CPUOffloadingSpec"}
    variant = parse_variant("native-cpu[eviction_policy=arc]", default_registry())
    argv, _ = server_command(variant, LaunchContext(settings(cpu_gib=32.0), tmp_path), 8123)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"][
        "eviction_policy"] == "arc"


def test_native_cpu_uses_the_cpu_platform_spec_without_a_gpu(tmp_path, monkeypatch):
    from pytest_kvoffload.core import machine
    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    argv, _ = command("native-cpu", tmp_path, cpu_gib=1.0)
    assert "--kv-offloading-backend" not in argv
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "OffloadingConnector" and config["kv_role"] == "kv_both"
    assert config["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 2**30, "spec_name": "CPUPlatformOffloadingSpec",
        "spec_module_path": "pytest_kvoffload.cpu_copy_worker"}


def test_cpu_platform_spec_names_match_the_module():
    pytest.importorskip("vllm")
    import importlib
    from pytest_kvoffload.serve.command_line import CPU_PLATFORM_SPEC_MODULE, CPU_PLATFORM_SPECS
    from vllm.v1.kv_offload import factory
    module = importlib.import_module(CPU_PLATFORM_SPEC_MODULE)
    for original, twin in CPU_PLATFORM_SPECS.items():
        assert issubclass(getattr(module, twin), factory.OffloadingSpecFactory.get_spec_cls({"spec_name": original}))


@pytest.mark.parametrize("cuda, args, message", [
    (False, ["--kv-offloading-size", "1", "--kv-offloading-backend", "native"],
     "native-cpu: --kv-offloading-backend native uses vLLM's CPUOffloadingSpec, which needs a CUDA or XPU GPU"),
    (False, ["--kv-transfer-config", json.dumps({"kv_connector": "OffloadingConnector",
                                                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec"}})],
     "native-cpu: vLLM's TieringOffloadingSpec needs a CUDA or XPU GPU; this is the CPU platform"),
    (False, ["--kv-transfer-config", json.dumps({"kv_connector": "OffloadingConnector"})],
     "native-cpu: vLLM's CPUOffloadingSpec needs a CUDA or XPU GPU"),
    (True, ["--kv-transfer-config", json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "spec_name": "CPUPlatformOffloadingSpec"}})],
     "native-cpu: CPUPlatformOffloadingSpec is the CPU-platform copy worker; this is a CUDA GPU: use vLLM's own CPUOffloadingSpec"),
    (False, ["--kv-transfer-config", "{not json"], "native-cpu: --kv-transfer-config is not valid JSON"),
])
def test_offloading_spec_on_the_wrong_platform_is_one_line(cuda, args, message):
    from pytest_kvoffload.serve.command_line import offloading_spec_problem
    problem = offloading_spec_problem("native-cpu", ["vllm", *args], cuda)
    assert problem.startswith(message) and "\n" not in problem


def test_offloading_spec_on_its_platform_passes():
    from pytest_kvoffload.serve.command_line import offloading_spec_problem
    shim = json.dumps({"kv_connector": "OffloadingConnector",
                       "kv_connector_extra_config": {"spec_name": "CPUPlatformTieringSpec"}})
    assert offloading_spec_problem("native-disk", ["--kv-transfer-config", shim], cuda=False) is None
    assert offloading_spec_problem("native-cpu", ["--kv-offloading-size", "1"], cuda=True) is None
    # On the CPU platform the native-cpu command carries both: the transfer config's spec wins in vLLM.
    both = ["--kv-offloading-size", "1", "--kv-transfer-config", shim]
    assert offloading_spec_problem("native-cpu", both, cuda=False) is None
    assert offloading_spec_problem("x", ["--kv-transfer-config", json.dumps({"kv_connector": "Other"})], False) is None


def test_a_server_argument_that_asks_for_vllms_spec_on_cpu_stops_the_run(pytester):
    from pytest_kvoffload.core import machine
    if machine.has_cuda():
        pytest.skip("checks the CPU platform")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--kv-backend=gpu-only", "--kv-server-arg=--kv-offloading-size",
                                          "--kv-server-arg=1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*gpu-only: --kv-offloading-backend native uses vLLM's CPUOffloadingSpec, which needs*"])
    assert "Traceback" not in result.stderr.str()


def test_lmcache_inproc_disk_environment(tmp_path):
    argv, env = command("lmcache-inproc-disk", tmp_path)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert env["LMCACHE_LOCAL_DISK"] == f"file://{tmp_path / 'lmcache-inproc-disk'}/"
    assert float(env["LMCACHE_MAX_LOCAL_DISK_SIZE"]) > 0 and float(env["LMCACHE_MAX_LOCAL_CPU_SIZE"]) > 0
    argv, env = command("lmcache-inproc-disk", tmp_path, cpu_gib=8.0, disk_gb=500.0)
    assert (env["LMCACHE_MAX_LOCAL_CPU_SIZE"], env["LMCACHE_MAX_LOCAL_DISK_SIZE"]) == ("8.0", "500.0")
    assert env["LMCACHE_LOCAL_CPU"] == "False" and env["LMCACHE_CHUNK_SIZE"] == "256"


def lmcache_launch(tmp_path, **kw):
    from pytest_kvoffload.serve.command_line import server_launch
    return server_launch(default_registry().get("lmcache-disk"), LaunchContext(settings(**kw), tmp_path), 8123)


def test_lmcache_disk_runs_lmcache_server_beside_vllm_with_its_files_as_the_only_tier(tmp_path, monkeypatch):
    from pytest_kvoffload.core import machine
    from pytest_kvoffload.serve.builtin import lmcache_disk as lmcache
    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    launch = lmcache_launch(tmp_path, cpu_gib=0.5)
    server = launch.companion.argv
    flag = lambda name: server[server.index(name) + 1]  # noqa: E731
    assert server[1:3] == ["-m", "lmcache.v1.multiprocess.server"]
    # L1 only stages: room for 8 prompts of max-model-len (8,320 x 4,096 bytes: 0.254 GiB), at most --kv-cpu-gib.
    assert flag("--l2-store-policy") == "skip_l1" and flag("--l1-size-gb") == "0.253906"
    assert lmcache.l1_gib(0.1, 8320, 4096) == 0.1 and lmcache.l1_gib(16, 131072, 114688) == 16
    assert flag("--chunk-size") == str(lmcache.CHUNK_TOKENS) and flag("--supported-transfer-mode") == "lmcache_driven"
    adapter = json.loads(flag("--l2-adapter"))
    assert adapter["type"] == "fs" and adapter["base_path"] == str(tmp_path / "lmcache-disk")
    assert adapter["use_odirect"] is True  # tmp_path's filesystem takes O_DIRECT here
    assert launch.companion.metrics_url == f"http://127.0.0.1:{flag('--prometheus-port')}/metrics"
    config = json.loads(launch.argv[launch.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "LMCacheMPConnector" and "--disable-hybrid-kv-cache-manager" in launch.argv
    assert config["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1",
                                                   "lmcache.mp.port": int(flag("--port")),
                                                   "lmcache.mp.mp_transfer_mode": "lmcache_driven"}
    # No usage telemetry from either process.
    assert launch.companion.env["LMCACHE_TRACK_USAGE"] == launch.env["LMCACHE_TRACK_USAGE"] == "false"
    # The same command line on a GPU.
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    again = lmcache_launch(tmp_path, cpu_gib=0.5).companion.argv
    ports = lambda argv: [a for i, a in enumerate(argv) if argv[i - 1] not in ("--port", "--prometheus-port")]  # noqa: E731
    assert ports(again) == ports(server)


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_lmcache_server_command_parses_with_the_installed_lmcache(tmp_path, monkeypatch, cuda):
    pytest.importorskip("lmcache")
    import argparse
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.mp_observability.config import add_observability_args
    from lmcache.v1.multiprocess.config import add_mp_server_args, parse_args_to_mp_server_config
    from pytest_kvoffload.core import machine
    monkeypatch.setattr(machine, "has_cuda", lambda: cuda)
    argv = lmcache_launch(tmp_path, cpu_gib=0.5).companion.argv
    parser = argparse.ArgumentParser()
    add_mp_server_args(parser)
    add_storage_manager_args(parser)
    add_observability_args(parser)
    args = parser.parse_args(argv[3:])
    mp = parse_args_to_mp_server_config(args)
    assert (mp.host, mp.chunk_size) == ("127.0.0.1", 256)
    assert mp.supported_transfer_mode == "lmcache_driven"
    storage = parse_args_to_config(args)
    assert storage.l1_manager_config.memory_config.size_in_bytes == int(0.253906 * 2**30)


def test_lmcache_tier_hits_count_only_if_its_server_read_the_chunks_from_disk():
    from pytest_kvoffload.serve.builtin import lmcache_disk as lmcache
    assert default_registry().get("lmcache-disk").load_proof is lmcache.load_proof
    assert lmcache.load_proof({lmcache.L2_LOADED_CHUNKS: 5}, 1279, 4096) is None
    # A near miss: one chunk short of 1,279 tokens (the last one partial) fails, naming the bytes.
    assert lmcache.load_proof({lmcache.L2_LOADED_CHUNKS: 4}, 1279, 4096) == (
        "LMCache's server loaded 4 chunks (4,194,304 bytes at most) from its disk tier, less than the "
        "5,238,784 that 1279 tokens need")
    assert lmcache.load_proof({}, 256, 4096) is not None


def test_which_lmcache_connector_vllm_loaded_is_read_from_its_log(tmp_path):
    from pytest_kvoffload.serve.builtin import lmcache_disk as lmcache
    log = tmp_path / "lmcache-disk.log"
    log.write_text("[2026-12-01 18:09:26,468] LMCache INFO: Using external LMCacheMPConnector from "
                   "lmcache.integration.vllm.lmcache_mp_connector (lmcache_mp_connector.py:1203:vllm...)\n")
    assert lmcache.started_facts(log) == {
        "connector_class": "lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector"}
    log.write_text("INFO Force use builtin LMCacheMPConnectorUpstream in vLLM.\n")
    assert lmcache.started_facts(log)["connector_class"].endswith("LMCacheMPConnectorUpstream")
    log.write_text("nothing\n")
    assert lmcache.started_facts(log) == {"connector_class": "not logged"}
    assert lmcache.started_facts(tmp_path / "missing.log") == {"connector_class": "not logged"}


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
    from pytest_kvoffload.core import machine
    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    registry = default_registry()
    assert registry.get("gpu-only").unavailable_reason() is None
    assert registry.get("kvoffload-disk").unavailable_reason() is None
    assert registry.get("native-cpu").unavailable_reason() is None
    assert registry.get("native-disk").unavailable_reason() is None
    assert registry.get("lmcache-disk").unavailable_reason() is None
    assert "needs an NVIDIA GPU" in registry.get("lmcache-inproc-disk").unavailable_reason()
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    assert registry.get("lmcache-inproc-disk").unavailable_reason() is None


def test_a_backend_whose_package_is_missing_skips_with_one_line_naming_it(monkeypatch):
    import dataclasses
    import importlib.util
    lm = default_registry().get("lmcache-disk")
    assert lm.unavailable_reason() is None  # installed by the cpu extra
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lmcache" else real(name, *a))
    assert lm.unavailable_reason() == (
        "lmcache-disk needs the Python package lmcache, not installed here (make installs it; or "
        "--kv-backend-python lmcache-disk=PATH to a Python that has it)")
    assert dataclasses.replace(lm, python="/other/python").unavailable_reason() is None


def test_connector_variant_gets_its_own_name_store_and_options(tmp_path):
    registry = default_registry()
    slow = with_connector_options(registry.get("kvoffload-disk"), "slow", read_gbps=0.025)
    assert slow.name == "kvoffload-disk[slow]" and slow.tier == "disk"
    argv, _ = server_command(slow, LaunchContext(settings(), tmp_path), 8123)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["read_gbps"] == 0.025 and extra["store_dir"] == str(tmp_path / "kv-store") + "-slow"
    with pytest.raises(ValueError, match="configures no KV connector"):
        server_command(with_connector_options(registry.get("gpu-only"), "x"), LaunchContext(settings(), tmp_path), 1)


@pytest.mark.parametrize("cuda, spec", [(True, "TieringOffloadingSpec"), (False, "CPUPlatformTieringSpec")])
def test_native_disk_uses_vllm_tiering_with_an_fs_tier(tmp_path, monkeypatch, cuda, spec):
    from pytest_kvoffload.core import machine
    monkeypatch.setattr(machine, "has_cuda", lambda: cuda)
    argv, _ = command("native-disk", tmp_path, cpu_gib=1.0)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == spec and extra["cpu_bytes_to_use"] == 2**30
    assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": str(tmp_path / "native-disk")}]


def test_native_disk_spec_and_tier_exist_in_the_installed_vllm():
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.tiering import factory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: F401
    assert "\"fs\"" in Path(factory.__file__).read_text()


def test_tier_labels_and_tier_only_recipes_follow_vllm():
    registry = default_registry()
    # vLLM counts hits by the connector's _cache_hit_source; LMCacheConnectorV1 sets none.
    assert {n: registry.get(n).tier for n in registry.names()} == {
        "gpu-only": None, "native-cpu": "host", "lmcache-disk": "external_unspecified", "native-disk": "disk",
        "kvoffload-disk": "disk", "lmcache-inproc-disk": "external_unspecified"}
    assert registry.get("native-cpu").prime_requests == 2
    assert registry.get("native-disk").evict_connector and not registry.get("native-cpu").evict_connector
    assert registry.get("lmcache-disk").reset_tier and registry.get("native-disk").reset_tier


def test_reset_tier_empties_nested_folders(tmp_path):
    folder = tmp_path / "native-disk"
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "a" / "b" / "block.bin").write_bytes(b"x")
    (folder / "top.bin").write_bytes(b"x")
    default_registry().get("native-disk").reset_tier(LaunchContext(settings(), tmp_path))
    assert folder.is_dir() and not any(folder.iterdir())


def test_cuda_servers_get_memory_utilization_and_tensor_parallelism(tmp_path, monkeypatch):
    from pytest_kvoffload.core import machine
    argv, _ = command("gpu-only", tmp_path, tensor_parallel=2)
    assert "--gpu-memory-utilization" not in argv  # the CPU build has no GPU memory to share
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    argv, _ = command("gpu-only", tmp_path, gpu_memory_utilization=0.8)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.8" and "--tensor-parallel-size" not in argv


@pytest.fixture(scope="module")
def vllm_parser():
    pytest.importorskip("vllm")
    try:  # vLLM 0.33 moved the server's parser (vllm/entrypoints/common/cli_args.py)
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def parse_or_fail(parser, argv):
    """vLLM's parse of a command line; an unknown flag or bad value fails the test in one line, not an error."""
    try:
        return parser.parse_args(argv)
    except SystemExit:
        known = {s for a in parser._actions for s in a.option_strings}
        unknown = [t.partition("=")[0] for t in argv if t.startswith("--") and t.partition("=")[0] not in known]
        pytest.fail(f"the installed vLLM refuses this command line (unknown: {unknown or 'none'}): {argv}")


def test_a_planted_unknown_flag_fails_the_parse_check(vllm_parser, tmp_path):
    argv, _ = command("gpu-only", tmp_path, server_args=("--no-such-flag", "1"))
    with pytest.raises(pytest.fail.Exception, match="unknown: \\['--no-such-flag'\\]"):
        parse_or_fail(vllm_parser, argv[3:])


@pytest.mark.parametrize("name", ["gpu-only", "native-cpu", "lmcache-disk", "native-disk", "kvoffload-disk",
                                  "lmcache-inproc-disk"])
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_every_backend_command_parses_with_the_installed_vllm(vllm_parser, tmp_path, monkeypatch, name, cuda):
    from pytest_kvoffload.core import machine
    monkeypatch.setattr(machine, "has_cuda", lambda: cuda)
    if not cuda and registry_needs_cuda(name):
        pytest.skip(f"{name} has no CPU-platform command line")
    argv, _ = command(name, tmp_path, tensor_parallel=2, server_args=("--max-num-batched-tokens", "2048"))
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = parse_or_fail(vllm_parser, argv[3:])
    assert args.tensor_parallel_size == 2 and (args.gpu_memory_utilization == 0.9 or not cuda)
    assert args.max_num_batched_tokens == 2048 and args.enable_prefix_caching
    if name != "gpu-only":
        assert args.kv_transfer_config.kv_role == "kv_both"


def test_a_native_tier_hit_counts_only_if_vllm_copied_its_bytes():
    from pytest_kvoffload.serve.builtin.vllm_offloading import native_load_proof
    registry = default_registry()
    assert registry.get("native-cpu").load_proof is native_load_proof
    assert registry.get("native-disk").load_proof is native_load_proof
    copied = {'vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}': 512 * 4096,
              'vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}': 10**9}
    assert native_load_proof(copied, 512, 4096) is None
    assert native_load_proof({"vllm:kv_offload_load_bytes_total": 512 * 4096}, 512, 4096) is None  # vLLM 0.33
    # Stores do not count: only bytes copied into the engine's cache prove a load.
    only_stores = {'vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}': 10**9}
    assert native_load_proof(only_stores, 512, 4096) == (
        "vLLM's offloading copied 0 bytes into the KV cache, less than the 2,097,152 that 512 tokens need")


def test_a_variant_from_the_command_line_is_the_backend_with_its_options(tmp_path):
    from pytest_kvoffload.harness.backend_options import parse_variant
    from pytest_kvoffload.harness.backend_options import split_backends
    registry = default_registry()
    assert split_backends("gpu-only, kvoffload-disk[io_threads=4,read_gbps=0.05],native-cpu") == [
        "gpu-only", "kvoffload-disk[io_threads=4,read_gbps=0.05]", "native-cpu"]
    variant = parse_variant("kvoffload-disk[io_threads=4,read_gbps=0.05,direct_io=false]", registry)
    assert variant.name == "kvoffload-disk[io_threads=4,read_gbps=0.05,direct_io=false]" and variant.tier == "disk"
    argv, _ = server_command(variant, LaunchContext(settings(), tmp_path), 8123)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert (extra["io_threads"], extra["read_gbps"], extra["direct_io"]) == (4, 0.05, False)
    # Chunk files of 512 tokens still match block by block, the prompt's last block included; a
    # synchronous variant leaves that block to the engine.
    chunked = parse_variant("kvoffload-disk[chunk_tokens=512]", registry)
    assert chunked.granularity(settings()) == settings().block_size and chunked.last_block_source == "disk"
    assert parse_variant("kvoffload-disk[load_mode=sync]", registry).last_block_source is None
    native = parse_variant("native-disk[eviction_policy=arc]", registry)
    argv, _ = server_command(native, LaunchContext(settings(), tmp_path), 8123)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"][
        "eviction_policy"] == "arc"


def test_another_python_runs_the_server_and_its_versions_are_read(tmp_path):
    import sys
    from pytest_kvoffload.serve.command_line import interpreter_versions
    from pytest_kvoffload.harness.backend_options import use_python
    registry = default_registry()
    use_python(registry, [f"gpu-only={sys.executable}"])
    argv, _ = server_command(registry.get("gpu-only"), LaunchContext(settings(), tmp_path), 8123)
    assert argv[0] == sys.executable and registry.get("kvoffload-disk").python is None
    versions = interpreter_versions(sys.executable)
    assert versions["vllm"] and versions["torch"]
    assert "error" in interpreter_versions(str(tmp_path / "no-python"))


def test_cpu_servers_share_what_the_first_one_compiled(tmp_path, monkeypatch):
    import pytest_kvoffload.core.machine as machine

    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vc"))
    for name in ("gpu-only", "kvoffload-disk"):
        _, env = command(name, tmp_path)
        assert env["VLLM_USE_AOT_COMPILE"] == "0"
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "vc" / "torch_compile_cache" / "inductor")


@pytest.mark.parametrize("name", ["gpu-only", "native-cpu", "lmcache-disk", "native-disk", "kvoffload-disk"])
def test_one_process_cpu_servers_get_vllms_uniprocess_executor_and_the_same_threads(vllm_parser, tmp_path,
                                                                                      monkeypatch, name):
    import pytest_kvoffload.core.machine as machine
    from pytest_kvoffload.serve import cpu_engine

    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(var, raising=False)
    argv, env = command(name, tmp_path, engine="one-process", server_args=("--max-num-seqs", "4"))
    assert parse_or_fail(vllm_parser, argv[3:]).distributed_executor_backend == "uni"
    assert argv[-2:] == ["--max-num-seqs", "4"]  # the user's arguments still come last
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == str(len(cpu_engine.compute_cpus(1)))
    # The default is vLLM's own executor: nothing added.
    argv, env = command(name, tmp_path)
    assert "--distributed-executor-backend" not in argv
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "OMP_NUM_THREADS" not in env
    # A user's own executor wins.
    argv, env = command(name, tmp_path, engine="one-process", server_args=("--distributed-executor-backend", "mp"))
    assert argv.count("--distributed-executor-backend") == 1 and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_a_backend_with_its_own_block_size_serves_and_is_expected_in_those_blocks(tmp_path):
    # The admission suite's servers use 32-token blocks in a 128-token session (grid_checks.admission_block).
    from pytest_kvoffload.suite_machinery.admission.grid_checks import admission_block, block_variant

    s = settings(engine_tokens=32_769)
    assert admission_block(s) == 32 and admission_block(settings(block_size=16)) == 16
    fine = block_variant(default_registry().get("kvoffload-disk"), "fine", admission_block(s))
    argv, _ = server_command(fine, LaunchContext(s, tmp_path), 8123)
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "1025"  # 32,769 / 32, rounded up
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["chunk_tokens"] == 32
    assert fine.kv_block(s) == fine.granularity(s) == 32
    assert default_registry().get("kvoffload-disk").kv_block(s) == 128

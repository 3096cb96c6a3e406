"""--kv-engine one-process: a CPU server's engine in one process, with the compute threads vLLM's own binding
would give its worker; vLLM's own executor otherwise."""

from types import SimpleNamespace

import pytest

from pytest_kvoffload.serve import cpu_engine


def fake_sysfs(tmp_path, nodes: dict[int, list[tuple[int, int]]]):
    """/sys/devices/system/{node,cpu}: node -> [(cpu id, physical core id)]."""
    cpu_root = tmp_path / "system" / "cpu"
    for node, cpus in nodes.items():
        folder = tmp_path / "system" / "node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(",".join(str(cpu) for cpu, _ in cpus) + "\n")
        for cpu, core in cpus:
            topology = cpu_root / f"cpu{cpu}" / "topology"
            topology.mkdir(parents=True)
            (topology / "core_id").write_text(f"{core}\n")
            (topology / "physical_package_id").write_text(f"{node}\n")
    return cpu_root


def vllms_own_choice(monkeypatch, nodes, allowed, reserved):
    """What vLLM 0.32's OMPProcessManager binds for rank 0 of one, on the same topology."""
    pytest.importorskip("vllm")
    from vllm.utils import cpu_resource_utils, ompmultiprocessing
    from vllm.platforms import CpuArchEnum, current_platform

    infos = [cpu_resource_utils.LogicalCPUInfo(id=cpu, physical_core=node * 100 + core, numa_node=node)
             for node, cpus in nodes.items() for cpu, core in cpus if cpu in allowed]
    monkeypatch.setattr(cpu_resource_utils, "get_allowed_cpu_list", lambda: infos)
    monkeypatch.setattr(cpu_resource_utils, "get_visible_memory_node", lambda: sorted({i.numa_node for i in infos}))
    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: CpuArchEnum.X86)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", str(reserved))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    config = SimpleNamespace(parallel_config=SimpleNamespace(local_world_size=1, data_parallel_rank_local=None,
                                                             _api_process_count=1), kv_transfer_config=None)
    return ompmultiprocessing.OMPProcessManager(config).cpu_lists[0]


TOPOLOGIES = {
    "2 cores": {0: [(0, 0), (1, 1)]},
    "4 cores with SMT": {0: [(0, 0), (1, 1), (2, 2), (3, 3), (4, 0), (5, 1), (6, 2), (7, 3)]},
    "two NUMA nodes": {0: [(0, 0), (1, 1), (2, 2)], 1: [(3, 0), (4, 1), (5, 2)]},
    "1 core": {0: [(0, 0)]},
}


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("reserved", [0, 1, 2])
def test_the_compute_cpus_are_the_ones_vllms_binding_picks(tmp_path, monkeypatch, name, reserved):
    nodes = TOPOLOGIES[name]
    allowed = {cpu for cpus in nodes.values() for cpu, _ in cpus}
    ours = cpu_engine.compute_cpus(reserved, allowed, sysfs=fake_sysfs(tmp_path, nodes))
    assert ours == vllms_own_choice(monkeypatch, nodes, allowed, reserved)


def test_cpus_outside_the_affinity_mask_are_not_counted(tmp_path, monkeypatch):
    nodes = TOPOLOGIES["two NUMA nodes"]
    allowed = {3, 4, 5}  # taskset to the second node: vLLM binds there
    ours = cpu_engine.compute_cpus(1, allowed, sysfs=fake_sysfs(tmp_path, nodes))
    assert ours == vllms_own_choice(monkeypatch, nodes, allowed, 1) == [3, 4]


def test_this_machines_count_matches_vllms_own_code(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    config = SimpleNamespace(parallel_config=SimpleNamespace(local_world_size=1, data_parallel_rank_local=None,
                                                             _api_process_count=1), kv_transfer_config=None)
    assert cpu_engine.compute_cpus(1) == OMPProcessManager(config).cpu_lists[0]


def test_a_cpu_server_with_one_rank_runs_one_engine_process():
    args, env = cpu_engine.server_settings("one-process", False, 1, (), {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    assert args == ["--distributed-executor-backend", "uni"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert int(env["OMP_NUM_THREADS"]) == len(cpu_engine.compute_cpus(1))
    assert "one process" in cpu_engine.describe("one-process", False, 1, (), {})


@pytest.mark.parametrize("cuda, ranks, server_args, environ", [
    (True, 1, (), {}),  # CUDA: vLLM's own uniprocess default for one GPU
    (False, 2, (), {}),  # more ranks need vLLM's multiprocess executor
    (False, 1, ("--distributed-executor-backend", "mp"), {}),
    (False, 1, (), {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
])
def test_cuda_more_ranks_and_a_users_choice_are_left_alone(cuda, ranks, server_args, environ):
    assert cpu_engine.server_settings("one-process", cuda, ranks, server_args, environ) == ([], {})
    assert "does not apply" in cpu_engine.describe("one-process", cuda, ranks, server_args, environ)


def test_vllms_own_executor_is_the_default():
    assert cpu_engine.server_settings("vllm", False, 1, (), {}) == ([], {})
    assert "vLLM's own executor (--kv-engine vllm)" in cpu_engine.describe("vllm", False, 1, (), {})


def test_a_users_thread_count_wins():
    _, env = cpu_engine.server_settings("one-process", False, 1, (), {"OMP_NUM_THREADS": "7"})
    assert "OMP_NUM_THREADS" not in env
    assert "7 compute thread" in cpu_engine.describe("one-process", False, 1, (), {"OMP_NUM_THREADS": "7"})

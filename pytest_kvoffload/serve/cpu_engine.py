"""How a server on vLLM's CPU build runs its engine: vLLM's own way (the default), or in one process (--kv-engine).

vLLM's CPU build forces its multiprocess executor (vllm/platforms/cpu.py) unless VLLM_ENABLE_V1_MULTIPROCESSING=0:
the engine-core process spawns one worker process, which imports torch and vLLM again and binds its OpenMP
threads to the cores vLLM picked (vllm/utils/ompmultiprocessing.py: one logical CPU per physical core of the
rank's NUMA node, less the reserved ones, which the scheduler and API server use). A start-up is one core
busy from end to end, and the worker's spawn and imports are a third of it. Measured on the 2-core EPYC
(tiny-llama, bf16, warm compile cache, 2026-12-01; the same gpu-only server three ways, cold server-side
TTFT, median of 3 after one, two passes):

| engine | start-up | 1,280 tokens | 4,096 tokens |
|---|---|---|---|
| vLLM's default (worker process, 1 bound thread) | 26.6 s | 216, 221 ms | 1,197, 1,221 ms |
| one process, OMP_NUM_THREADS=1 (--kv-engine=one-process) | 21.1 s | 212, 230 ms | 1,192, 1,221 ms |
| one process, torch's default threads (2) | 20.1 s | 114, 130 ms | 633, 660 ms |

The last row is faster only because it computes on every core, leaving none to the API server, the client or
a tier's I/O threads, which vLLM's default keeps one for; so one-process gets as many threads as vLLM's
binding would have given its worker. The same prefill, but not the same connectors: in one process a
connector's I/O threads share the engine's process and interpreter, and in make bench (b6 against b5,
docs/notes/2026-12-01-night.md) kvoffload-disk's 4,096-token tier hit went from 32 to 59 ms and its writes
from 0.45 to 0.20 of the drive in their pattern. So measuring runs keep vLLM's own engine; make test, whose
suites check rather than measure, runs one-process for its start-ups. Every server of a run gets the same.
A user's VLLM_ENABLE_V1_MULTIPROCESSING, OMP_NUM_THREADS or --distributed-executor-backend (in
--kv-server-arg) wins. Nothing changes on CUDA or with more ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

EXECUTOR_FLAG = "--distributed-executor-backend"
SYSFS_CPU = Path("/sys/devices/system/cpu")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpu_ids(text: str) -> list[int]:
    """ "0-3,8" -> [0, 1, 2, 3, 8] (the kernel's cpulist format)."""
    ids: list[int] = []
    for part in text.split(","):
        if "-" in part:
            low, high = part.split("-")
            ids += range(int(low), int(high) + 1)
        elif part:
            ids.append(int(part))
    return ids


def compute_cpus(reserved: int, allowed: set[int] | None = None, sysfs: Path = SYSFS_CPU) -> list[int]:
    """The CPUs vLLM's automatic binding gives rank 0's worker: one logical CPU (the highest-numbered) per
    physical core on the first NUMA node that has allowed CPUs, less the last `reserved` of them (kept
    when there would be none left). tests/serve/test_cpu_engine.py holds this to vLLM's own code."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    nodes = sorted(sysfs.parent.glob("node/node[0-9]*"), key=lambda p: int(p.name[4:]))
    node_cpus = [set(_cpu_ids(_read(node / "cpulist") or "")) & allowed for node in nodes]
    chosen = next((cpus for cpus in node_cpus if cpus), allowed)
    per_core: dict[tuple[str, str], int] = {}
    for cpu in sorted(chosen):
        topology = sysfs / f"cpu{cpu}" / "topology"
        core = (_read(topology / "physical_package_id") or "0", _read(topology / "core_id") or str(cpu))
        per_core[core] = max(per_core.get(core, cpu), cpu)
    cpus = sorted(per_core.values())
    return cpus[:-reserved] if 0 < reserved < len(cpus) else cpus


def server_settings(engine: str, cuda: bool, tensor_parallel: int, server_args: tuple[str, ...] | list[str],
                    environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The arguments and variables a server gets so that its engine runs in one process, for --kv-engine
    one-process (none where they do not apply or the user chose)."""
    env = os.environ if environ is None else environ
    if engine != "one-process" or cuda or tensor_parallel != 1 or EXECUTOR_FLAG in server_args or "VLLM_ENABLE_V1_MULTIPROCESSING" in env:
        return [], {}
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if "OMP_NUM_THREADS" not in env:
        reserved = int(env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or tensor_parallel)
        wanted["OMP_NUM_THREADS"] = str(len(compute_cpus(reserved)))
    return [EXECUTOR_FLAG, "uni"], wanted


def describe(engine: str, cuda: bool, tensor_parallel: int, server_args: tuple[str, ...] | list[str],
             environ: dict[str, str] | None = None) -> str:
    """One line for the run header and run.json: how this run's servers run their engine."""
    env = os.environ if environ is None else environ
    args, wanted = server_settings(engine, cuda, tensor_parallel, server_args, env)
    if not args:
        if engine != "one-process":
            return "engine: vLLM's own executor (--kv-engine vllm)"
        why = "CUDA" if cuda else "more than one rank" if tensor_parallel != 1 else "the user's settings win"
        return f"engine: vLLM's own executor (--kv-engine one-process does not apply: {why})"
    threads = wanted.get("OMP_NUM_THREADS") or env.get("OMP_NUM_THREADS")
    return (f"engine: one process (vLLM's uniprocess executor, no worker spawn), {threads} compute thread(s): "
            f"as many as vLLM's own binding gives its worker on this machine")

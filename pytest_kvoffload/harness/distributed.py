"""Running across pytest-xdist workers: one GPU group per worker, one server per backend, one run folder.

Each backend's tests form one xdist group, so a backend's server starts in exactly one worker; worker N
sees GPUs N*tp .. N*tp+tp-1 of the visible ones. Workers write their records under <run>/workers/<id>/
and the controller merges them into <run>/run.json when the session ends.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from pytest_kvoffload.harness.options import OptionError

RUN_ID_KEY = "kvoffload_run_id"
LOADGROUP_KEY = "kvoffload_loadgroup"
STATUS_RANK = {"selected": 0, "skipped": 1, "external": 2, "failed": 3, "running": 4, "measured": 5}


def worker_id(config) -> str | None:
    """'gw0', 'gw1', ... inside an xdist worker; None in the controller or without xdist."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput.get("workerid") if workerinput else None


def is_controller(config) -> bool:
    return worker_id(config) is None and bool(getattr(config.option, "numprocesses", None))


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else every one nvidia-smi lists."""
    configured = os.environ.get("CUDA_VISIBLE_DEVICES")
    if configured is not None:
        return [d.strip() for d in configured.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def devices_for(worker: str, tensor_parallel: int, gpus: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a worker's servers: its own group of tensor_parallel GPUs."""
    index = int(worker.lstrip("gw"))
    groups = len(gpus) // tensor_parallel
    if index >= groups:
        raise OptionError(
            f"pytest-xdist worker {worker} has no GPUs: {len(gpus)} visible GPU(s) in groups of {tensor_parallel} "
            f"(--kv-tensor-parallel) serve {groups} worker(s); run with -n {max(groups, 1)} or fewer")
    return ",".join(gpus[index * tensor_parallel:(index + 1) * tensor_parallel])


def group_node_ids(config, items) -> None:
    """Give each grouped item the '@group' node-id suffix that xdist's loadgroup schedules by.

    pytest-xdist 3.8 writes the suffix into Item._nodeid, which pytest 9.2 no longer reads (node ids
    became structured, Item._id), so the groups were silently ignored; this writes it where pytest reads.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names or "@" in item.nodeid:
            continue
        node_id = getattr(item, "_id", None)
        if node_id is not None and hasattr(type(node_id), "parse"):
            item._id = type(node_id).parse(f"{item.nodeid}@{'_'.join(names)}")


def merge_runs(runs: list[dict], base: dict) -> dict:
    """The controller's record: every worker's measurements and benchmarks; each backend's furthest status."""
    merged = dict(base)
    merged["measurements"] = [m for run in runs for m in run.get("measurements", [])]
    merged["workers"] = [run.get("worker") for run in runs]
    backends = {name: dict(entry) for name, entry in base.get("backends", {}).items()}
    for run in runs:
        for name, entry in run.get("backends", {}).items():
            have = backends.get(name, {})
            if STATUS_RANK.get(entry.get("status"), 0) >= STATUS_RANK.get(have.get("status"), 0):
                backends[name] = {**entry, "worker": run.get("worker")}
    merged["backends"] = backends
    benchmarks: dict = {}
    for run in runs:
        for name, bench in (run.get("benchmarks") or {}).items():
            if name in benchmarks:
                # Two workers measured the same benchmark: keep both tables, each under its worker.
                benchmarks[f"{name} ({run.get('worker')})"] = bench
            else:
                benchmarks[name] = bench
    if benchmarks:
        merged["benchmarks"] = benchmarks
    return merged


def worker_records(run_dir: Path) -> list[dict]:
    runs = []
    for path in sorted((run_dir / "workers").glob("*/run.json")):
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a worker killed mid-write left no usable record; the others still count
    return runs

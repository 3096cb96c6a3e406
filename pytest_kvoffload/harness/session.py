"""The state of one pytest session: settings, backends, servers and the run record."""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import requests

from pytest_kvoffload.harness import environment
from pytest_kvoffload.core import machine
from pytest_kvoffload.serve import page_cache
from pytest_kvoffload.core.vllm_releases import UnsupportedVllm
from pytest_kvoffload.serve.backend import Backend, BackendRegistry, LaunchContext
from pytest_kvoffload.serve.command_line import interpreter_versions, package_path, server_launch, server_release
from pytest_kvoffload.serve.client import Endpoint
from pytest_kvoffload.serve.companion import Companion
from pytest_kvoffload.measure.context import Recorder, Servers
from pytest_kvoffload.harness.distributed import merge_runs, worker_records
from pytest_kvoffload.serve.metrics import histograms, merge_histograms
from pytest_kvoffload.core.progress import Say, print_line
from pytest_kvoffload.record.run_record import RunWriter
from pytest_kvoffload.record.results import compute_results
from pytest_kvoffload.record.run_files import write_run_files
from pytest_kvoffload.serve.processes import free_port
from pytest_kvoffload.serve.server_imports import import_problem
from pytest_kvoffload.serve.server import ServerPool, VllmServer
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.measure.grid_lengths import GridLengths
from pytest_kvoffload.measure.prefill_speed import PrefillSpeed, measure_prefill
from pytest_kvoffload.analysis.cell_stats import cell_table


def make_run_id(model: str, when: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    host = re.sub(r"[^A-Za-z0-9.-]+", "-", machine.describe()["host"] or "host")[:32]
    # One folder name: a model given by path must not nest the run under results/.
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-.")[:48] or "model"
    return f"{stamp}-{model}-{host}"


class KVSession:
    def __init__(self, settings: Settings, registry: BackendRegistry, options: dict,
                 progress: Say = print_line, hook=None, run_id: str | None = None,
                 worker: str | None = None, devices: str | None = None, controller: bool = False) -> None:
        self.settings = settings
        self.registry = registry
        self.options = options
        self.progress = progress
        self.hook = hook
        self.replay_plan = None  # set by the plugin when --kv-trace is given
        self.run_id = run_id or make_run_id(settings.model.name)
        # Under pytest-xdist (harness/distributed.py): a worker's id and GPUs, or the controller that merges.
        self.worker = worker
        self.devices = devices
        self.controller = controller
        # Part of every prompt's key, so a rerun against a long-lived server cannot hit last run's cache.
        self.salt = self.run_id
        # An A/B run keeps its two servers up together (on a GPU each with half the memory, serve/command_line.py).
        self.pool = ServerPool(max_running=2 if settings.ab or not machine.has_cuda() else 1,
                               before_stop=self.keep_histograms)
        # Ours stays up while the other backends' cells run, so that each one's close calls (suites/test_ttft.py)
        # are settled right after its cells on the two servers that measured them, with no restart of either.
        self.pool.keep = frozenset({registry.ours()} - {None})
        self._writer: RunWriter | None = None
        # Each backend's prefill speed, measured at its server's start (measure/prefill_speed.py), and the grid's
        # lengths, decided from the first one (measure/grid_lengths.py).
        self.speeds: dict[str, PrefillSpeed] = {}
        self.grid = GridLengths(settings)
        # Seconds by phase (server start-ups, warm-ups, each test file), printed at the end of the run.
        self.phases: dict[str, float] = {}
        # Each server start-up's seconds: the next one's progress line, and a fresh salt per start.
        self.start_seconds: list[float] = []
        # Which servers started, with their seconds (the closing line), and the collected tests' plan of
        # servers (harness/server_plan.py; set by the plugin once collection is done).
        self.starts: list[tuple[str, float]] = []
        self.server_plan = None
        # Per backend with a disk tier: its folders and I/O mode (serve/page_cache.py), found at its start.
        self.tier_io: dict[str, tuple[list[Path], str]] = {}
        # What measuring code gets instead of the session (measure/context.py).
        self.recorder = Recorder(settings, self.salt, keep=self.record, progress=progress,
                                 before_tier_read=self.prepare_tier_read, lengths=lambda: self.lengths,
                                 cells=self.cells, environment=lambda: self.run_record().environment,
                                 run_dir=self.run_dir, add_benchmark=self.add_benchmark)
        self.servers = Servers(endpoint=self.endpoint, release=self.pool.release, room=self.room, running=self.pool.has)
        self._pool_size = self.pool.max_running

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def run_record(self) -> RunWriter:
        """The run's record, opened on first use: only then does the run folder appear (with a probe of
        its drive for the environment), so a session that measures nothing leaves no folder."""
        if self._writer is None:
            run_dir = self.settings.results_dir / self.run_id
            if self.worker:
                run_dir = run_dir / "workers" / self.worker
            env = environment.describe(self.settings)
            run_dir.mkdir(parents=True, exist_ok=True)
            env["drive"] = environment.drive(run_dir)
            env["host_copy"] = environment.host_copy()
            if self.devices is not None:
                env["cuda_visible_devices"] = self.devices
            if self.hook is not None:
                self.hook.pytest_kvoffload_environment(environment=env)
            self._writer = RunWriter(run_dir, self.run_id, self.options, env)
            if self.worker:
                self._writer.set("worker", self.worker)
            for name in self.settings.backends:
                backend = self.registry.get(name)
                note = backend.platform_note()
                self._writer.set_backend(name, "selected", description=backend.description, role=backend.role,
                                         **({"platform_note": note} if note else {}))
        return self._writer

    @property
    def has_record(self) -> bool:
        """Whether this session wrote a run record (it does once something is measured or started)."""
        return self._writer is not None

    def run_dir(self) -> Path:
        return self.run_record().run_dir

    def context(self, backend: Backend) -> LaunchContext:
        scratch = self.run_dir() / "scratch" / backend.name
        scratch.mkdir(parents=True, exist_ok=True)
        return LaunchContext(self.settings, scratch)

    def skip(self, backend: Backend, reason: str) -> None:
        self.run_record().set_backend(backend.name, "skipped", reason)

    def endpoint(self, backend: Backend) -> Endpoint:
        if self.settings.server_url:
            self.run_record().set_backend(backend.name, "external", url=self.settings.server_url)
            return Endpoint(self.settings.server_url, self.settings.model.name)

        def factory() -> VllmServer:
            port = free_port()
            context = self.context(backend)
            if backend.reset_tier is not None:
                backend.reset_tier(context)  # a tier that survives resets starts empty
            launch = server_launch(backend, context, port)
            tier_files[:] = [launch.tier_folders, launch.direct_io]
            if self.devices is not None:
                launch.env["CUDA_VISIBLE_DEVICES"] = self.devices
            logs = self.run_dir() / "logs"
            companion = (Companion(launch.companion, logs / f"{backend.name}.companion.log")
                         if launch.companion is not None else None)
            self.progress(f"starting vLLM for {backend.name} on port {port}"
                          + (f", with {launch.companion.name}" if companion else "") + f"; log {logs}")
            return VllmServer(backend.name, launch.argv, launch.env, port, logs / f"{backend.name}.log",
                              self.settings.model.name, companion)

        tier_files: list = []  # the started server's tier folders and O_DIRECT request (its backend's declaration)
        started = not self.pool.has(backend.name)
        if started:
            served_by = self.stop_if_unsupported(backend)
            self.stop_if_imports_fail(backend)
        clock = time.monotonic()
        try:
            server = self.pool.get(backend.name, factory, self.settings.server_timeout, self.progress,
                                   expected_s=self.start_seconds[-1] if self.start_seconds else None)
        except Exception as exc:
            self.run_record().set_backend(backend.name, "failed", str(exc).splitlines()[0])
            raise
        if started:
            server.release = served_by[0]
            self.start_seconds.append(time.monotonic() - clock)
            self.starts.append((backend.name, self.start_seconds[-1]))
            self.add_phase("server start-ups", self.start_seconds[-1])
            self.record_start(backend, server, served_by, tier_files)
        return server

    def record_start(self, backend: Backend, server: VllmServer, served_by, tier_files: list) -> None:
        """A started server as one fact in the run record: its command line, release, tier folders, prefill
        speed (the first one's fixes the grid's lengths) and the run's start-ups so far, written once."""
        info = {"argv": server.argv, "log": str(server.log_path), "user_facing": backend.user_facing,
                "role": backend.role,
                "vllm": served_by[1], "verification": served_by[0].verification}
        if server.companion is not None:
            info["companion"] = {"name": server.companion.spec.name, "argv": server.companion.spec.argv,
                                 "log": str(server.companion.log_path)}
        if backend.started_facts is not None:
            info.update(backend.started_facts(server.log_path))
        if backend.python:
            info.update(python=backend.python, versions=interpreter_versions(backend.python))
        folders, direct = tier_files or [(), True]
        folders = list(folders)
        if folders:
            mode = page_cache.io_mode(folders[-1], direct)
            self.tier_io[backend.name] = (folders, mode)
            info["tier_io"] = {"folders": [str(f) for f in folders], "mode": mode,
                               "page_cache": self.settings.page_cache if mode == "buffered" else "not used"}
        clock = time.monotonic()
        try:
            info["prefill"] = self.measure_speed(backend.name, server).to_dict()
        except Exception as exc:  # the record keeps what the start found, and why the warm-up failed
            self.run_record().set_backend(backend.name, "failed", str(exc).splitlines()[0] if str(exc) else
                                          type(exc).__name__, **info)
            raise
        self.add_phase("warm-ups and prefill-speed probes", time.monotonic() - clock)
        self.run_record().started(backend.name, info, [{"server": n, "seconds": round(t, 1)} for n, t in self.starts],
                                  list(self.grid.lengths))

    def stop_if_unsupported(self, backend: Backend):
        """Before a server: its vLLM is inside the declared range, or the run stops in one line."""
        try:
            return server_release(backend)
        except UnsupportedVllm as exc:
            self.run_record().set_backend(backend.name, "failed", str(exc))
            pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)

    def stop_if_imports_fail(self, backend: Backend) -> None:
        """Before a server: its Python imports what the backend loads into vLLM, or the run stops in one line
        (on a GPU for every server; on the CPU build for another interpreter: serve/server_imports.py)."""
        if not (machine.has_cuda() or backend.python):
            return
        problem = import_problem(backend.name, backend.python or sys.executable, backend.server_imports(),
                                 env=package_path(backend))
        if problem:
            self.run_record().set_backend(backend.name, "failed", problem)
            pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)

    def room(self, servers: int | None) -> None:
        """Servers kept running at once: at least `servers`, or the session's own limit again (None)."""
        self.pool.max_running = self._pool_size if servers is None else max(self._pool_size, servers)

    def prepare_tier_read(self, name: str) -> dict | None:
        """Before a tier-only round of a buffered disk tier: its files dropped from the page cache (or,
        with --kv-page-cache=warm, only looked at), and what was resident. None for O_DIRECT tiers."""
        folders, mode = self.tier_io.get(name, ([], ""))
        if mode != "buffered":
            return None
        if self.settings.page_cache == "warm":
            return {"mode": mode, "page_cache": "warm: served from memory", "after": page_cache.residency(folders)}
        return {"mode": mode, "page_cache": "dropped", **page_cache.drop(folders)}

    def measure_speed(self, name: str, endpoint: Endpoint) -> PrefillSpeed:
        """Warm a fresh server up and time its cold prefill; the first measurement fixes the grid."""
        s = self.settings
        # Fresh prompts for every start: a restarted server's tier may still hold the last start's.
        speed = measure_prefill(endpoint, max(self.lengths), s.max_model_len, s.max_prefill_s,
                                f"{self.salt}|{name}|start{len(self.start_seconds)}", s.model.vocab_size,
                                curve=self.grid.decided is None)
        self.speeds[name] = speed
        self.progress(f"{name}: warmed up; {speed.describe()} ({s.dtype})")
        if self.grid.decided is None:
            left_out = self.grid.decide(speed)
            if left_out:
                self.progress(left_out)
        return speed

    @property
    def lengths(self) -> tuple[int, ...]:
        """The grid's lengths (measure/grid_lengths.py)."""
        return self.grid.lengths

    def keep_histograms(self, name: str, server: VllmServer) -> None:
        """A server's load and save histograms (connector/counters.py), read just before it stops, added to
        what the backend's earlier servers in this run recorded."""
        try:
            found = histograms(server.metrics_text())
        except (OSError, ValueError, requests.RequestException):
            return  # a server that cannot answer any more has nothing to add
        if found and self._writer is not None and self._writer.backend(name):
            entry = self._writer.backend(name)
            self._writer.set_backend(name, entry["status"], entry.get("reason", ""),
                                     histograms=merge_histograms(entry.get("histograms") or {}, found))

    def record(self, measurement: dict) -> None:
        """One measurement: told to the pytest_kvoffload_measurement hook, then kept in the run record."""
        if self.hook is not None:
            self.hook.pytest_kvoffload_measurement(record=measurement)
        self.run_record().add_measurement(measurement)

    def measurements(self, backend: str | None = None, purpose: str | None = "measure") -> list[dict]:
        """The run's measurement records so far, of one backend and purpose (None: any)."""
        return [m for m in self.run_record().measurements
                if (backend is None or m["backend"] == backend) and (purpose is None or m.get("purpose") == purpose)]

    def cells(self, backend: str | None = None, purpose: str = "measure") -> list[dict]:
        """Per-cell statistics (stats.cell_table) of the measurements of one backend and purpose."""
        return cell_table([dict(m, purpose="measure") for m in self.measurements(backend, purpose)])

    def add_benchmark(self, name: str, text: str, data: dict) -> None:
        """A benchmark's figures: printed in the terminal summary and kept in run.json."""
        self.run_record().set_benchmark(name, {"text": text, **data})

    def benchmark(self, name: str) -> dict:
        """What a benchmark kept so far ({} before its first figures): a suite adds to it backend by backend."""
        return self.run_record().benchmark(name)

    def finish(self, interrupted: bool) -> None:
        """Stop the servers, complete the run's record (record/results.py), then write the files drawn from it
        (record/run_files.py) and tell the pytest_kvoffload_run_finished hook."""
        self.pool.stop_all()
        run = self.complete_record(interrupted)
        if run is None:
            return
        run_dir = self.run_dir()
        if not self.worker:
            # A worker's record is merged by the controller, which writes the run's files from the whole.
            write_run_files(run, self.settings, run_dir, self.progress)
            if self.hook is not None:
                self.hook.pytest_kvoffload_run_finished(run=run, run_dir=run_dir)
        shutil.rmtree(run_dir / "scratch", ignore_errors=True)

    def complete_record(self, interrupted: bool) -> dict | None:
        """The record with its status, cells and analysis, saved; None when this session recorded nothing."""
        if self.controller:
            runs = worker_records(self.settings.results_dir / self.run_id)
            if not runs:
                return None
            self.run_record().replace(merge_runs(runs, self.run_record().data))
            if any(run.get("status") != "complete" for run in runs):
                interrupted = True
        if self._writer is None:
            return None
        cells, analysis = compute_results(self._writer.measurements, self.registry.tiers(), self.settings,
                                          self.run_record().environment)
        self._writer.finish("partial" if interrupted else "complete", cells, analysis)
        return self._writer.data

"""pytest hooks and option wiring; every piece of logic lives in the modules this one calls."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import pytest

from . import distributed, fixtures, hookspecs, machine
from .backends import (BackendConfigError, LaunchContext, default_registry, register_ab, register_variants,
                       server_command, use_python)
from .cells import State, grid
from .fixtures import SESSION_KEY
from .records import RecordError, read_run
from .report import render
from .replay_plan import build_replay_plan
from .session import KVSession
from .settings import (OptionError, Settings, check_fits_model, parse_backends, split_backends, parse_dtype, parse_fractions,
                       parse_lengths, parse_admission, parse_disk_opts, parse_max_prefill, parse_model, parse_weights, parse_positive_float, parse_positive_int, parse_server_args, parse_server_url)

# (option, ini name, help); defaults come from the machine (see machine.py) or below.
OPTIONS = [
    ("--kv-backend", "kv_backend", "backends to measure: all, or a comma list (default: all); a variant "
                                   "NAME[KEY=VALUE,...] adds connector options, e.g. kvoffload-disk[io_threads=4]"),
    ("--kv-ab", "kv_ab", "A,B: compare two backends or variants in one run, both servers up, rounds interleaved, "
                         "a paired verdict per cell (suites/test_ab.py); B may equal A"),
    ("--kv-model", "kv_model", "a shipped model name or a folder with an HF config.json"),
    ("--kv-lengths", "kv_lengths", "prompt lengths in tokens, comma separated"),
    ("--kv-fractions", "kv_fractions", "cached-prefix fractions in (0, 1], comma separated"),
    ("--kv-rounds", "kv_rounds", "fresh-prompt repetitions of each cell"),
    ("--kv-max-prefill", "kv_max_prefill", "leave out default lengths whose cold prefill, measured when the first "
                                           "server starts, takes longer than this many seconds, or 'off' "
                                           "(default: 3 on a CPU, off on a GPU; --kv-lengths are always kept)"),
    ("--kv-results-dir", "kv_results_dir", "where run folders are written (default: results)"),
    ("--kv-server-url", "kv_server_url", "measure this running vLLM server instead of starting one"),
    ("--kv-server-timeout", "kv_server_timeout", "seconds to wait for a server's /health (default: 600)"),
    ("--kv-weights", "kv_weights", "weights of a model given without any: random (seeded, written once to a cache "
                                   "folder; outputs then depend on the KV, so output checks have teeth), dummy "
                                   "(vLLM's +-1e-3) or auto (random on a CPU, dummy on a GPU)"),
    ("--kv-dtype", "kv_dtype", "dtype of the model and its KV: auto (bfloat16 where the CPU computes it natively, "
                               "float32 otherwise; the model's own on a GPU), bfloat16, float16 or float32"),
    ("--kv-admission", "kv_admission", "the rule the admission suite guards: queue (default), static, online, "
                                       "or the controls always / never, with which the suite must fail"),
    ("--kv-block-size", "kv_block_size", "KV block size in tokens passed to vLLM (default: 128 on CPU, 16 on GPU)"),
    ("--kv-cpu-gib", "kv_cpu_gib", "CPU memory for CPU tiers (native-cpu, native-disk's first tier, LMCache's "
                                   "staging), GiB (default: a quarter of this machine's, at most 64)"),
    ("--kv-disk-gb", "kv_disk_gb", "capacity of disk tiers (lmcache-disk, kvoffload-disk), GB (default: half the "
                                   "free space under --kv-results-dir, at most 256)"),
    ("--kv-gpu-memory-utilization", "kv_gpu_memory_utilization",
     "share of GPU memory vLLM may use, passed on CUDA only (default 0.9)"),
    ("--kv-tensor-parallel", "kv_tensor_parallel", "GPUs per server (vLLM --tensor-parallel-size; default 1)"),
    ("--kv-trace", "kv_trace", "a Mooncake- or Bailian-style JSONL trace to replay (suites/test_trace_replay.py)"),
    ("--kv-trace-format", "kv_trace_format", "mooncake or bailian (default: detected from the first line)"),
    ("--kv-trace-tokens-per-block", "kv_trace_tokens_per_block",
     "tokens per trace block after scaling (default: the format's own, 512 or 16)"),
    ("--kv-trace-time-scale", "kv_trace_time_scale", "factor on arrival times, 0.1 = ten times faster (default 1)"),
    ("--kv-trace-limit", "kv_trace_limit", "replay at most this many requests"),
    ("--kv-trace-window", "kv_trace_window", "replay only requests arriving in START:END seconds"),
    ("--kv-trace-mode", "kv_trace_mode", "open (at arrival times, default) or closed (back to back)"),
    ("--kv-trace-concurrency", "kv_trace_concurrency", "requests in flight at most (default 4)"),
    ("--kv-trace-max-output", "kv_trace_max_output", "cap on output tokens per request (default 4)"),
]


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    # Under pytest-xdist each backend's tests must stay in one worker (its server, its GPUs): unless the
    # user chose a distribution, group them (the groups are set in pytest_collection_modifyitems).
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        config.option.dist = "loadgroup"
    return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: every worker records into this session's run folder."""
    kv = node.config.stash.get(SESSION_KEY, None)
    if kv is not None:
        node.workerinput[distributed.RUN_ID_KEY] = kv.run_id
    # Workers parse the original command line again, so a dist chosen here must be handed over.
    node.workerinput[distributed.LOADGROUP_KEY] = node.config.getvalue("dist") == "loadgroup"


def pytest_addoption(parser):
    group = parser.getgroup("kvoffload", "KV offload break-even measurements (pytest-kvoffload)")
    for option, ini, help_text in OPTIONS:
        group.addoption(option, dest=ini, default=None, help=help_text)
        parser.addini(ini, help=help_text, default=None)
    group.addoption("--kv-backend-python", dest="kv_backend_python", action="append", default=[],
                    help="NAME=/path/to/venv/bin/python: run that backend's server with another environment "
                         "(another vLLM or LMCache); its versions are recorded in run.json (repeatable)")
    group.addoption("--kv-server-arg", dest="kv_server_args", action="append", default=[],
                    help="extra vLLM server arguments, split like a shell (repeatable)")
    parser.addini("kv_server_args", type="args", help="extra vLLM server arguments", default=[])
    group.addoption("--kv-disk-opt", dest="kv_disk_opts", action="append", default=[],
                    help="kvoffload-disk connector option KEY=VALUE (repeatable), e.g. store_dir=/nvme/kv, read_gbps=6")
    parser.addini("kv_disk_opts", type="args", help="kvoffload-disk connector options KEY=VALUE", default=[])


def _value(config, name: str, fallback):
    value = config.getoption(name)
    if value is None:
        value = config.getini(name)
    return fallback if value in (None, "") else value


def build_settings(config, registry, ab: tuple[str, str] | None = None) -> Settings:
    d = machine.defaults()
    block_size = parse_positive_int("--kv-block-size", _value(config, "kv_block_size", d["block_size"]))
    model = parse_weights(str(_value(config, "kv_weights", "auto")),
                          parse_model(str(_value(config, "kv_model", d["model"]))), machine.has_cuda())
    lengths = parse_lengths(str(_value(config, "kv_lengths", d["lengths"])), block_size)
    check_fits_model(lengths, model)
    timeout = _value(config, "kv_server_timeout", "600")
    try:
        timeout = float(timeout)
        if timeout <= 0:
            raise ValueError
    except ValueError:
        raise OptionError(f"--kv-server-timeout {timeout!r}: expected a positive number of seconds") from None
    dtype, dtype_reason = parse_dtype(str(_value(config, "kv_dtype", "auto")), machine.native_dtype(model.dtype))
    results = Path(_value(config, "kv_results_dir", "results"))
    if not results.is_absolute():
        results = Path(config.rootpath) / results
    return Settings(
        # An A/B run measures its pair (in every suite); --kv-backend chooses otherwise.
        backends=ab if ab else parse_backends(str(_value(config, "kv_backend", "all")), registry.names()),
        ab=ab,
        model=model,
        lengths=lengths,
        fractions=parse_fractions(str(_value(config, "kv_fractions", d["fractions"]))),
        rounds=parse_positive_int("--kv-rounds", _value(config, "kv_rounds", d["rounds"])),
        results_dir=results,
        block_size=block_size,
        server_url=parse_server_url(_value(config, "kv_server_url", None)),
        server_args=parse_server_args(list(config.getini("kv_server_args")) + list(config.getoption("kv_server_args"))),
        server_timeout=timeout,
        cpu_gib=parse_positive_float("--kv-cpu-gib", _value(config, "kv_cpu_gib", machine.default_cpu_gib())),
        disk_gb=parse_positive_float("--kv-disk-gb", _value(config, "kv_disk_gb", machine.default_disk_gb(results))),
        gpu_memory_utilization=parse_positive_float(
            "--kv-gpu-memory-utilization", _value(config, "kv_gpu_memory_utilization", 0.9), upper=1.0),
        tensor_parallel=parse_positive_int("--kv-tensor-parallel", _value(config, "kv_tensor_parallel", 1)),
        dtype=dtype,
        dtype_reason=dtype_reason,
        max_prefill_s=parse_max_prefill(_value(config, "kv_max_prefill", d["max_prefill_s"])),
        lengths_given=_value(config, "kv_lengths", None) is not None,
        admission=parse_admission(str(_value(config, "kv_admission", "queue"))),
        extra={"kvoffload_disk": parse_disk_opts(list(config.getini("kv_disk_opts")) + list(config.getoption("kv_disk_opts")),
                                                 block_size)},
    )


def _raise_interrupt(signum, frame):
    # SIGTERM (a CI timeout, `kill`) takes the same path as Ctrl-C, so servers are torn down.
    raise KeyboardInterrupt(f"signal {signum}")


def check_server_commands(settings: Settings, registry) -> None:
    """Build every selected backend's server command once, in a throwaway folder, so that a command that
    cannot work here (BackendConfigError) stops the run before any server starts."""
    if settings.server_url:
        return
    with tempfile.TemporaryDirectory(prefix="kvoffload-preflight-") as scratch:
        for name in settings.backends:
            backend = registry.get(name)
            if backend.unavailable_reason() is None:
                server_command(backend, LaunchContext(settings, Path(scratch) / name), port=0)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    registry = default_registry()
    config.hook.pytest_kvoffload_register_backends(registry=registry)
    try:
        register_variants(registry, split_backends(str(_value(config, "kv_backend", "all"))))
        ab_value = _value(config, "kv_ab", None)
        ab = register_ab(registry, str(ab_value)) if ab_value else None
        use_python(registry, list(config.getoption("kv_backend_python") or []))
        settings = build_settings(config, registry, ab)
        check_server_commands(settings, registry)
    except (OptionError, BackendConfigError) as exc:
        raise pytest.UsageError(str(exc)) from None
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def progress(message: str) -> None:
        # Server start-up takes minutes on a CPU: say so live, past pytest's output capture.
        if reporter is None:
            return
        if capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"[kvoffload] {message}")
        else:
            reporter.write_line(f"[kvoffload] {message}")

    options = {name: str(value) if isinstance(value, Path) else value
               for name, value in vars(settings).items() if name != "model"}
    options["model"] = {"name": settings.model.name, "path": str(settings.model.path),
                        "kv_bytes_per_token": settings.kv_bytes_per_token}
    try:
        replay_plan = build_replay_plan(config, _value)
    except OptionError as exc:
        raise pytest.UsageError(str(exc)) from None
    if replay_plan is not None:
        options["trace"] = replay_plan.describe()
    worker = distributed.worker_id(config)
    if worker and config.workerinput.get(distributed.LOADGROUP_KEY):
        config.option.loadgroup = True
    devices = None
    if worker and machine.has_cuda():
        try:
            devices = distributed.devices_for(worker, settings.tensor_parallel, distributed.visible_gpus())
        except OptionError as exc:
            raise pytest.UsageError(str(exc)) from None
    run_id = config.workerinput.get(distributed.RUN_ID_KEY) if worker else None
    config.stash[SESSION_KEY] = KVSession(settings, registry, options, progress, hook=config.hook, run_id=run_id,
                                          worker=worker, devices=devices,
                                          controller=distributed.is_controller(config))
    config.stash[SESSION_KEY].replay_plan = replay_plan
    config.pluginmanager.register(PhaseClock(config.stash[SESSION_KEY]), "kvoffload-phases")
    config.pluginmanager.register(fixtures, "kvoffload-fixtures")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_interrupt)


def pytest_report_header(config):
    session = config.stash.get(SESSION_KEY, None)
    if session is None:
        return None
    s = session.settings
    cpu = machine.describe()
    return [f"kvoffload: backends {','.join(s.backends)}; model {s.model.name} "
            f"({s.kv_bytes_per_token:,} KV bytes/token); lengths {','.join(map(str, s.lengths))}; "
            f"fractions {','.join(f'{f:g}' for f in s.fractions)}; rounds {s.rounds}; device {machine.device_kind()}",
            f"kvoffload: dtype {s.dtype}: {s.dtype_reason}; CPU {cpu['cpu']}, {cpu['cpu_count']} cores, "
            f"flags {' '.join(cpu['cpu_flags']) or 'none of note'}"] + [
            f"kvoffload: {name}: {note}" for name in s.backends
            if (note := session.registry.get(name).platform_note())]


def _parametrized_by_test(metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        argnames = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        names = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    session = metafunc.config.stash[SESSION_KEY]
    settings = session.settings
    if "kv_backend" in metafunc.fixturenames and not _parametrized_by_test(metafunc, "kv_backend"):
        # Session scope groups tests by backend, so each backend's server starts once.
        metafunc.parametrize("kv_backend", list(settings.backends), indirect=True, scope="session")
    if "kv_cell" in metafunc.fixturenames:
        cells = grid(settings.lengths, settings.fractions)
        metafunc.parametrize("kv_cell", cells, ids=[c.id for c in cells])
    if "kv_length" in metafunc.fixturenames:
        metafunc.parametrize("kv_length", list(settings.lengths), ids=[str(n) for n in settings.lengths])
    if "kv_fraction" in metafunc.fixturenames:
        metafunc.parametrize("kv_fraction", list(settings.fractions), ids=[f"f{f:g}" for f in settings.fractions])


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Tier-hit cells of a backend without an offload tier have nothing to measure: deselect them.
    Every test of a backend joins that backend's xdist group (one server, in one worker)."""
    session = config.stash[SESSION_KEY]
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec else {}
        cell, name = params.get("kv_cell"), params.get("kv_backend")
        if name is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(name))
        if cell is not None and name in session.registry and cell.state is State.TIER_HIT \
                and session.registry.get(name).tier is None:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_xdist_groups(config, items):
    distributed.group_node_ids(config, items)


class PhaseClock:
    """Time by test file (setup, call and teardown), for the phase line at the end of the run."""

    def __init__(self, session: KVSession) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report) -> None:
        self.session.add_phase(report.nodeid.split("::")[0], report.duration)


def pytest_sessionfinish(session, exitstatus):
    kv = session.config.stash.get(SESSION_KEY, None)
    if kv is not None:
        kv.finish(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)


def pytest_unconfigure(config):
    kv = config.stash.get(SESSION_KEY, None)
    if kv is not None:
        kv.pool.stop_all()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    kv = config.stash.get(SESSION_KEY, None)
    if kv is None or not kv.has_record:
        return
    terminalreporter.section("kvoffload")
    try:
        run = read_run(kv.writer.path)
    except RecordError as exc:
        terminalreporter.write_line(str(exc))
        return
    terminalreporter.write_line(render(run))
    terminalreporter.write_line(f"results: {kv.writer.run_dir}")
    if kv.phases:
        terminalreporter.write_line("time by phase (a test file's time includes the start-ups it caused): " + ", ".join(
            f"{name} {seconds:.0f} s" for name, seconds in sorted(kv.phases.items(), key=lambda kv: -kv[1])))

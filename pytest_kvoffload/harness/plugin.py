"""pytest hooks and option wiring; every piece of logic lives in the modules this one calls."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import pytest

from pytest_kvoffload.serve import compile_cache, cpu_engine
from pytest_kvoffload.harness import distributed
from pytest_kvoffload.harness import fixtures
from pytest_kvoffload.harness import hookspecs
from pytest_kvoffload.core import machine
from pytest_kvoffload.harness import server_plan
from pytest_kvoffload.serve.backend import BackendConfigError, LaunchContext
from pytest_kvoffload.serve.command_line import server_command, server_release
from pytest_kvoffload.core.vllm_releases import UnsupportedVllm
from pytest_kvoffload.serve.builtin import default_registry
from pytest_kvoffload.measure.cells import grid
from pytest_kvoffload.core.cell_state import State
from pytest_kvoffload.harness.fixtures import SESSION_KEY
from pytest_kvoffload.record.run_record import RecordError, read_run
from pytest_kvoffload.record.summary_text import summary_text
from pytest_kvoffload.harness.options import OptionError, OptionValues, add_options, read_options
from pytest_kvoffload.harness.option_parsing import output_checks, write_weights
from pytest_kvoffload.core.progress import ProgressLine
from pytest_kvoffload.harness.session import KVSession
from pytest_kvoffload.core.settings import Settings

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
    add_options(parser)


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
    config.addinivalue_line("markers", "kv_after_cells: runs after the other tests of its backend, whose "
                                       "measured cells it reads (the break-even, the recompute fit)")
    config.addinivalue_line("markers", "kv_kills_server: runs after every other test of its backend (it kills "
                                       "that backend's server)")
    config.addinivalue_line("markers", server_plan.MARKER_HELP)
    registry = default_registry()
    config.hook.pytest_kvoffload_register_backends(registry=registry)
    try:
        settings, replay_plan = read_options(OptionValues.from_config(config), registry)
        check_server_commands(settings, registry)
        write_weights(settings.model, machine.has_cuda())  # parsing planned them; nothing was written there
    except (OptionError, BackendConfigError) as exc:
        raise pytest.UsageError(str(exc)) from None
    progress = ProgressLine(config.pluginmanager.get_plugin("terminalreporter"),
                            config.pluginmanager.get_plugin("capturemanager"), quiet=config.option.verbose < 0)
    options = {name: str(value) if isinstance(value, Path) else value
               for name, value in vars(settings).items() if name != "model"}
    options["model"] = {"name": settings.model.name, "path": str(settings.model.path),
                        "kv_bytes_per_token": settings.kv_bytes_per_token}
    options["output_checks"] = output_checks(settings.model)
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
            f"flags {' '.join(cpu['cpu_flags']) or 'none of note'}",
            f"kvoffload: {compile_cache.describe(machine.has_cuda())}",
            f"kvoffload: {cpu_engine.describe(s.engine, machine.has_cuda(), s.tensor_parallel, s.server_args)}",
            f"kvoffload: output checks: {output_checks(s.model)}"] + vllm_lines(session) + [
            f"kvoffload: {name}: {note}" for name in s.backends
            if (note := session.registry.get(name).platform_note())]


def vllm_lines(session) -> list[str]:
    """One line per vLLM the run's servers use: its version, its backends and how their hits are verified."""
    by_version: dict[tuple, list[str]] = {}
    for name in session.settings.backends:
        backend = session.registry.get(name)
        try:
            found, version = server_release(backend)
            key = (version, backend.python, found.verification)
        except UnsupportedVllm as exc:
            key = (None, backend.python, str(exc))
        by_version.setdefault(key, []).append(name)
    return [f"kvoffload: vLLM {version or '?'} ({python or 'this interpreter'}): {', '.join(names)}; "
            f"cached tokens verified {how}" for (version, python, how), names in by_version.items()]


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
    items[:] = after_cells_last(items)


def after_cells_last(items: list) -> list:
    """Tests marked kv_after_cells (they read the break-even or the recompute fit of the cells measured
    before them) move to just after the last other test of their backend, order kept otherwise: there
    that backend's server is still up, and its cells are measured. Those marked kv_kills_server (a test
    that kills the backend's server to watch the failure) come after every other test of it."""
    def backend(item):
        callspec = getattr(item, "callspec", None)
        return callspec.params.get("kv_backend") if callspec else None

    def kills(item):
        return item.get_closest_marker("kv_kills_server") is not None

    def marked(item):
        return backend(item) is not None and (item.get_closest_marker("kv_after_cells") is not None or kills(item))

    last = {backend(item): i for i, item in enumerate(items) if not marked(item)}
    waiting: dict = {}
    for item in items:
        if marked(item) and backend(item) in last:
            waiting.setdefault(backend(item), []).append(item)
    for group in waiting.values():
        group.sort(key=kills)  # stable: the others keep their order
    ordered = []
    for i, item in enumerate(items):
        if marked(item) and backend(item) in last:
            continue
        ordered.append(item)
        if last.get(backend(item)) == i:
            ordered += waiting.pop(backend(item), [])
    for rest in waiting.values():
        ordered += rest
    return ordered


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_xdist_groups(config, items):
    distributed.group_node_ids(config, items)


class PhaseClock:
    """Time by test file (setup, call and teardown), for the phase line at the end of the run."""

    def __init__(self, session: KVSession) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report) -> None:
        self.session.add_phase(report.nodeid.split("::")[0], report.duration)


def pytest_collection_finish(session):
    kv = session.config.stash.get(SESSION_KEY, None)
    if kv is not None:
        kv.server_plan = server_plan.plan(
            session.items, lambda name: name not in kv.registry or kv.registry.get(name).unavailable_reason() is None,
            kv.settings.ab)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """--kv-server-plan: print the servers the selected tests would start, and start none."""
    kv = session.config.stash.get(SESSION_KEY, None)
    if kv is None or not session.config.getoption("kv_server_plan") or kv.server_plan is None:
        return None
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in kv.server_plan.lines():
        reporter.write_line(line)
    return True


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
        run = read_run(kv.run_record().path)
    except RecordError as exc:
        terminalreporter.write_line(str(exc))
        return
    terminalreporter.write_line(summary_text(run))
    terminalreporter.write_line(f"results: {kv.run_record().run_dir}")
    if kv.phases:
        terminalreporter.write_line("time by phase (a test file's time includes the start-ups it caused): " + ", ".join(
            f"{name} {seconds:.0f} s" for name, seconds in sorted(kv.phases.items(), key=lambda kv: -kv[1])))
    if kv.starts or kv.server_plan is not None:
        terminalreporter.write_line(server_plan.startup_line(kv.starts, kv.server_plan))

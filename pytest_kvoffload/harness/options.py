"""Every --kv-* option, declared once (flag, ini key, help), read (the command line, then the ini file) and
parsed into the run's Settings and replay plan. A bad value is an OptionError: one line naming the option and
what would be valid, raised before any server starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pytest_kvoffload.core import machine
from pytest_kvoffload.serve.backend import BackendConfigError, BackendRegistry
from pytest_kvoffload.harness.backend_options import use_python
from pytest_kvoffload.connector.config import OPTIONS as CONNECTOR_OPTIONS, RIGGED_OPTIONS
from pytest_kvoffload.serve.builtin import (gpu_only, kvoffload_disk, lmcache_disk, lmcache_inproc_disk, native_cpu,
                                            native_disk)
from pytest_kvoffload.core.settings import Settings
from pytest_kvoffload.harness.backend_options import register_ab, register_variants, split_backends
from pytest_kvoffload.harness.option_parsing import (OptionError, check_calibration_here, check_engine_tokens,
                                                     check_fits_model, parse_admission, parse_backends,
                                                     parse_disk_opts, parse_dtype, parse_engine, parse_fractions,
                                                     parse_lengths, parse_max_prefill, parse_model, parse_page_cache,
                                                     parse_positive_float, parse_positive_int, parse_results_dir,
                                                     parse_server_args, parse_server_url, parse_weights,
                                                     parse_whole_number, parse_window)
from pytest_kvoffload.traces.read import FORMATS, Scaling, TraceError, read_trace, select
from pytest_kvoffload.traces.selection import ReplayPlan


@dataclass(frozen=True)
class Option:
    flag: str  # on the command line
    name: str  # its dest and its ini key
    help: str
    repeatable: bool = False  # given any number of times; in the ini file a list split like a shell
    switch: bool = False  # a flag without a value, on the command line only (nothing to check)


# Defaults not written here come from the machine (machine.defaults) or from the parser that reads the option.
OPTIONS = (
    Option("--kv-backend", "kv_backend",
           "backends to measure: all, or a comma list (default: all); a variant NAME[KEY=VALUE,...] adds "
           f"connector options, e.g. {kvoffload_disk.NAME}[io_threads=4]"),
    Option("--kv-ab", "kv_ab",
           "A,B: compare two backends or variants in one run, both servers up, rounds interleaved, a paired "
           "verdict per cell (suites/test_ab.py); B may equal A"),
    Option("--kv-model", "kv_model", "a shipped model name or a folder with an HF config.json"),
    Option("--kv-lengths", "kv_lengths", "prompt lengths in tokens, comma separated"),
    Option("--kv-fractions", "kv_fractions", "cached-prefix fractions in (0, 1], comma separated"),
    Option("--kv-rounds", "kv_rounds", "fresh-prompt repetitions of each cell"),
    Option("--kv-random-seed", "kv_random_seed",
           "seed of the prompts' token draws and of vLLM's --seed, so a rerun sends the same prompts (default 0)"),
    Option("--kv-max-prefill", "kv_max_prefill",
           "leave out default lengths whose cold prefill, measured when the first server starts, takes longer "
           "than this many seconds, or 'off' (default: 3 on a CPU, off on a GPU; --kv-lengths are always kept)"),
    Option("--kv-results-dir", "kv_results_dir", "where run folders are written (default: results)"),
    Option("--kv-server-url", "kv_server_url", "measure this running vLLM server instead of starting one"),
    Option("--kv-server-timeout", "kv_server_timeout", "seconds to wait for a server's /health (default: 600)"),
    Option("--kv-server-plan", "kv_server_plan",
           "print the vLLM servers the selected tests would start, and which tests start each, then stop "
           "without starting any (harness/server_plan.py)", switch=True),
    Option("--kv-server-arg", "kv_server_args", "extra vLLM server arguments, split like a shell (repeatable)",
           repeatable=True),
    Option("--kv-backend-python", "kv_backend_python",
           "NAME=/path/to/venv/bin/python: run that backend's server with another environment (another vLLM or "
           "LMCache); its versions are recorded in run.json (repeatable)", repeatable=True),
    Option("--kv-weights", "kv_weights",
           "weights of a model given without any: random (seeded, written once to a cache folder; outputs then "
           "depend on the KV, so output checks have teeth), dummy (vLLM's +-1e-3) or auto (random on a CPU, "
           "dummy on a GPU)"),
    Option("--kv-dtype", "kv_dtype",
           "dtype of the model and its KV: auto (bfloat16 where the CPU computes it natively, float32 otherwise; "
           "the model's own on a GPU), bfloat16, float16 or float32"),
    Option("--kv-admission", "kv_admission",
           "the rule the admission suite guards: queue (default), static, online, or a control with which the "
           "suite must fail: always, never, static:scale=F, static:no-fixed; or queue:full-credit (whole queue credited)"),
    Option("--kv-engine", "kv_engine",
           "how a CPU server runs its engine: vllm (vLLM's own: a worker process bound to its cores; default) or "
           "one-process (engine and worker in one process, as vLLM runs one GPU: 5 s less per start-up, but a "
           "connector's I/O threads then share the engine's process; make test uses it; docs/servers.md)"),
    Option("--kv-engine-tokens", "kv_engine_tokens",
           "the engine's own KV cache in tokens, whole blocks (vLLM's --num-gpu-blocks-override), the same for "
           "every server; at least --max-model-len (default: what VLLM_CPU_KVCACHE_SPACE or "
           "--kv-gpu-memory-utilization gives; make test uses 32768: docs/servers.md)"),
    Option("--kv-page-cache", "kv_page_cache",
           "a buffered disk tier's files before each tier-only round: cold (dropped from the page cache, so "
           "hits read the disk; default) or warm (left cached: figures served from memory, flagged so)"),
    Option("--kv-block-size", "kv_block_size",
           "KV block size in tokens passed to vLLM (default: 128 on CPU, 16 on GPU)"),
    Option("--kv-cpu-gib", "kv_cpu_gib",
           f"CPU memory for CPU tiers ({native_cpu.NAME}, {native_disk.NAME}'s first tier, LMCache's staging), GiB "
           "(default: "
           "an eighth of this machine's without a GPU, at most 4; a quarter with one, at most 64)"),
    Option("--kv-disk-gb", "kv_disk_gb",
           f"capacity of disk tiers ({kvoffload_disk.NAME}, {lmcache_inproc_disk.NAME}; {lmcache_disk.NAME}'s fs tier "
           "has none), GB "
           "(default: half the free space under "
           "--kv-results-dir, at most 256)"),
    Option("--kv-disk-opt", "kv_disk_opts",
           f"{kvoffload_disk.NAME} connector option KEY=VALUE (repeatable), e.g. store_dir=/nvme/kv or read_gbps=6 "
           "(a test knob: the test-only connector then serves it, rigged/); "
           "keys: " + ", ".join(sorted(CONNECTOR_OPTIONS | set(RIGGED_OPTIONS))), repeatable=True),
    Option("--kv-gpu-memory-utilization", "kv_gpu_memory_utilization",
           "share of GPU memory vLLM may use, passed on CUDA only (default 0.9)"),
    Option("--kv-tensor-parallel", "kv_tensor_parallel", "GPUs per server (vLLM --tensor-parallel-size; default 1)"),
    Option("--kv-trace", "kv_trace", "a Mooncake- or Bailian-style JSONL trace to replay (suites/test_trace_replay.py)"),
    Option("--kv-trace-format", "kv_trace_format", "mooncake or bailian (default: detected from the first line)"),
    Option("--kv-trace-tokens-per-block", "kv_trace_tokens_per_block",
           "tokens per trace block after scaling (default: the format's own, 512 or 16)"),
    Option("--kv-trace-time-scale", "kv_trace_time_scale",
           "factor on arrival times, 0.1 = ten times faster (default 1)"),
    Option("--kv-trace-limit", "kv_trace_limit", "replay at most this many requests"),
    Option("--kv-trace-window", "kv_trace_window", "replay only requests arriving in START:END seconds"),
    Option("--kv-trace-slice", "kv_trace_slice",
           "replay this many requests taken as whole prefix trees (requests sharing their first block), so the "
           "slice keeps the trace's reuse, which a first-N window cuts; after the window and limit"),
    Option("--kv-trace-mode", "kv_trace_mode", "open (at arrival times, default) or closed (back to back)"),
    Option("--kv-trace-concurrency", "kv_trace_concurrency", "requests in flight at most (default 4)"),
    Option("--kv-trace-max-output", "kv_trace_max_output", "cap on output tokens per request (default 4)"),
    Option("--kv-trace-repeats", "kv_trace_repeats",
           f"replays per backend, caches emptied before each; the verdict against {gpu_only.NAME} pairs requests over "
           "them (default 3)"),
)
OPTION_NAMES = frozenset(option.name for option in OPTIONS)
REPEATABLE = frozenset(option.name for option in OPTIONS if option.repeatable)


def add_options(parser) -> None:
    """Declare every option with pytest: a command-line flag and an ini key."""
    group = parser.getgroup("kvoffload", "KV offload break-even measurements (pytest-kvoffload)")
    for option in OPTIONS:
        if option.switch:
            group.addoption(option.flag, dest=option.name, action="store_true", default=False, help=option.help)
        elif option.repeatable:
            group.addoption(option.flag, dest=option.name, action="append", default=[], help=option.help)
            parser.addini(option.name, type="args", help=option.help, default=[])
        else:
            group.addoption(option.flag, dest=option.name, default=None, help=option.help)
            parser.addini(option.name, help=option.help, default=None)


class OptionValues:
    """The raw values by option name (the command line's, else the ini file's), and the folder relative
    paths are taken from."""

    def __init__(self, lookup: Callable[[str], object], root: Path) -> None:
        self.lookup = lookup
        self.root = root

    @classmethod
    def from_config(cls, config) -> "OptionValues":
        def lookup(name: str):
            if name in REPEATABLE:
                return list(config.getini(name)) + list(config.getoption(name) or [])
            value = config.getoption(name)
            return config.getini(name) if value is None else value
        return cls(lookup, Path(config.rootpath))

    @classmethod
    def from_mapping(cls, values: dict, root: Path | None = None) -> "OptionValues":
        """Values given by name (`{"kv_lengths": "512"}`), as a program or a test holds them."""
        unknown = set(values) - OPTION_NAMES
        if unknown:
            raise KeyError(f"no such option: {', '.join(sorted(unknown))}")
        return cls(lambda name: values.get(name, [] if name in REPEATABLE else None), root or Path.cwd())

    def get(self, name: str, fallback=None):
        value = self.lookup(name)
        return fallback if value in (None, "") else value

    def given(self, name: str) -> bool:
        return self.lookup(name) not in (None, "")

    def items(self, name: str) -> list[str]:
        return list(self.lookup(name) or [])


def read_options(values: OptionValues, registry: BackendRegistry) -> tuple[Settings, ReplayPlan | None]:
    """The run's settings and its replay plan (None without --kv-trace). Registers in `registry` the variants,
    the A/B pair and the interpreters the options name. Raises OptionError."""
    try:
        register_variants(registry, split_backends(str(values.get("kv_backend", "all"))))
        pair = values.get("kv_ab")
        ab = register_ab(registry, str(pair)) if pair else None
        use_python(registry, values.items("kv_backend_python"))
    except BackendConfigError as exc:
        raise OptionError(str(exc)) from None
    return build_settings(values, registry, ab), build_replay_plan(values)


def build_settings(values: OptionValues, registry: BackendRegistry, ab: tuple[str, str] | None = None) -> Settings:
    d = machine.defaults()
    block_size = parse_positive_int("--kv-block-size", values.get("kv_block_size", d["block_size"]))
    model = parse_weights(str(values.get("kv_weights", "auto")),
                          parse_model(str(values.get("kv_model", d["model"]))), machine.has_cuda())
    lengths = parse_lengths(str(values.get("kv_lengths", d["lengths"])), block_size)
    check_fits_model(lengths, model)
    dtype, dtype_reason = parse_dtype(str(values.get("kv_dtype", "auto")), machine.native_dtype(model.dtype))
    results = parse_results_dir(values.get("kv_results_dir", "results"), values.root)
    disk_opts = parse_disk_opts(values.items("kv_disk_opts"), block_size)
    tensor_parallel = parse_positive_int("--kv-tensor-parallel", values.get("kv_tensor_parallel", 1))
    check_calibration_here(disk_opts, model, dtype, block_size, tensor_parallel, results)
    settings = Settings(
        # An A/B run measures its pair (in every suite); --kv-backend chooses otherwise.
        backends=ab if ab else parse_backends(str(values.get("kv_backend", "all")), registry.names()),
        ab=ab,
        model=model,
        lengths=lengths,
        fractions=parse_fractions(str(values.get("kv_fractions", d["fractions"]))),
        rounds=parse_positive_int("--kv-rounds", values.get("kv_rounds", d["rounds"])),
        results_dir=results,
        block_size=block_size,
        server_url=parse_server_url(values.get("kv_server_url")),
        server_args=parse_server_args(values.items("kv_server_args")),
        server_timeout=parse_positive_float("--kv-server-timeout", values.get("kv_server_timeout", 600)),
        random_seed=parse_whole_number("--kv-random-seed", values.get("kv_random_seed", 0), minimum=0),
        cpu_gib=parse_positive_float("--kv-cpu-gib", values.get("kv_cpu_gib", machine.default_cpu_gib())),
        disk_gb=parse_positive_float("--kv-disk-gb", values.get("kv_disk_gb", machine.default_disk_gb(results))),
        gpu_memory_utilization=parse_positive_float(
            "--kv-gpu-memory-utilization", values.get("kv_gpu_memory_utilization", 0.9), upper=1.0),
        tensor_parallel=tensor_parallel,
        dtype=dtype,
        dtype_reason=dtype_reason,
        max_prefill_s=parse_max_prefill(values.get("kv_max_prefill", d["max_prefill_s"])),
        lengths_given=values.given("kv_lengths"),
        admission=parse_admission(str(values.get("kv_admission", "queue"))),
        page_cache=parse_page_cache(str(values.get("kv_page_cache", "cold"))),
        engine=parse_engine(str(values.get("kv_engine", "vllm"))),
        engine_tokens=(parse_positive_int("--kv-engine-tokens", values.get("kv_engine_tokens"))
                       if values.given("kv_engine_tokens") else None),
        disk_opts=disk_opts,
    )
    check_engine_tokens(settings)
    return settings


def build_replay_plan(values: OptionValues) -> ReplayPlan | None:
    """The --kv-trace options: the trace read and its requests selected; None without --kv-trace."""
    path = values.get("kv_trace")
    if not path:
        return None
    fmt = values.get("kv_trace_format")
    if fmt is not None and fmt not in FORMATS:
        raise OptionError(f"--kv-trace-format {fmt!r}: expected one of {', '.join(FORMATS)}")
    try:
        trace = read_trace(path, fmt)
    except TraceError as exc:
        raise OptionError(f"--kv-trace: {exc}") from None
    per_block, limit = values.get("kv_trace_tokens_per_block"), values.get("kv_trace_limit")
    slice_size = values.get("kv_trace_slice")
    window = values.get("kv_trace_window")
    scaling = Scaling(
        tokens_per_block=parse_positive_int("--kv-trace-tokens-per-block", per_block) if per_block else None,
        time_factor=parse_positive_float("--kv-trace-time-scale", values.get("kv_trace_time_scale", 1)),
        limit=parse_positive_int("--kv-trace-limit", limit) if limit else None,
        window_s=parse_window(window),
    )
    mode = str(values.get("kv_trace_mode", "open"))
    if mode not in ("open", "closed"):
        raise OptionError(f"--kv-trace-mode {mode!r}: expected open or closed")
    plan = ReplayPlan(trace, scaling, mode,
                      parse_positive_int("--kv-trace-concurrency", values.get("kv_trace_concurrency", 4)),
                      parse_positive_int("--kv-trace-max-output", values.get("kv_trace_max_output", 4)),
                      parse_positive_int("--kv-trace-repeats", values.get("kv_trace_repeats", 3)),
                      parse_positive_int("--kv-trace-slice", slice_size) if slice_size else None)
    if not select(trace, scaling):
        raise OptionError(f"--kv-trace: no request of {path} falls inside --kv-trace-window {window}")
    return plan
